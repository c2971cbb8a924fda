"""SamplingParams validation and the batched sampler (greedy, temperature, top-k, top-p, seeds)."""
from __future__ import annotations

import pytest
import torch

from orca_ext.errors import InvalidRequestError
from orca_ext.request import Request
from orca_ext.sampling import Sampler, SamplingParams, filter_logits


def req(params: SamplingParams, name="r") -> Request:
    return Request(name, [1], params)


@pytest.mark.parametrize("kwargs, field", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=2.5), "max_tokens"),
    (dict(max_tokens=True), "max_tokens"),
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=float("inf")), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_p=float("nan")), "top_p"),
    (dict(top_k=-1), "top_k"),
    (dict(top_k=1.5), "top_k"),
    (dict(seed="7"), "seed"),
    (dict(seed=1.0), "seed"),
    (dict(seed=True), "seed"),
    (dict(seed=2**64), "seed"),
    (dict(seed=-(2**63) - 1), "seed"),
    (dict(seed=torch.tensor([1, 2])), "seed"),
    (dict(seed=torch.tensor(1.5)), "seed"),
    (dict(stop=[""]), "stop"),
    (dict(stop=["ok", 3]), "stop"),
    (dict(stop=5), "stop"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(stop_token_ids=["a"]), "stop_token_ids"),
    (dict(ignore_eos="yes"), "ignore_eos"),
])
def test_invalid_params_raise_naming_the_field(kwargs, field):
    with pytest.raises(InvalidRequestError, match=field) as info:
        SamplingParams(**kwargs)
    assert info.value.param == field  # an entry of a list is reported as the list
    assert issubclass(InvalidRequestError, ValueError)


def test_integer_seeds_of_every_kind_become_ints_that_seed_the_sampler():
    """numpy and torch integer scalars are seeds like the int of the same value, across the whole
    int64 and uint64 range: the same draws, and no failure in the sampler."""
    import numpy as np

    logits = torch.randn(1, 50)
    for raw, value in [(np.uint64(2**64 - 1), 2**64 - 1), (np.int64(-(2**63)), -(2**63)), (torch.tensor(7), 7),
                       (np.int32(5), 5), (2**64 - 1, 2**64 - 1)]:
        kinds = [SamplingParams(temperature=1.0, seed=s) for s in (raw, value)]
        assert type(kinds[0].seed) is int and kinds[0].seed == value and kinds[0] == kinds[1]
        draws = [Sampler()(logits.expand(3, -1).contiguous(), [req(p, f"s{i}") for i in range(3)]) for p in kinds]
        assert draws[0].tokens == draws[1].tokens and None not in draws[0].tokens, draws[0].errors


def test_params_are_normalised_and_immutable():
    p = SamplingParams(max_tokens=3, temperature=1, stop="END", stop_token_ids=[5, 6])
    assert p.stop == ("END",) and p.stop_token_ids == (5, 6)
    assert isinstance(p.temperature, float) and not p.greedy
    assert SamplingParams().greedy
    with pytest.raises(Exception):
        p.max_tokens = 4  # frozen: params may be shared by many requests


def test_greedy_is_one_argmax_per_row():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(7, 1009, generator=g)
    reqs = [req(SamplingParams(), f"g{i}") for i in range(7)]
    out = Sampler()(logits, reqs)
    assert out.tokens == logits.argmax(dim=-1).tolist()
    assert out.errors == [None] * 7


def test_non_finite_logits_fail_only_their_row():
    logits = torch.randn(5, 33)
    logits[1, 5] = float("nan")
    logits[2, :] = float("-inf")  # nothing usable in this row
    logits[3, 0] = float("inf")
    logits[4, 7] = float("-inf")  # one masked token is fine
    reqs = [req(SamplingParams(temperature=0.7 * (i % 2), seed=i), f"n{i}") for i in range(5)]
    out = Sampler()(logits, reqs)
    for i in (1, 2, 3):
        assert out.tokens[i] is None and "non-finite" in out.errors[i]
    assert out.errors[0] is None and out.errors[4] is None
    assert out.tokens[0] == int(logits[0].argmax()) and out.tokens[4] != 7


def empirical(logits_row: torch.Tensor, params_kwargs: dict, n: int = 4000) -> torch.Tensor:
    """Token frequencies of n single draws (n requests with distinct seeds, one batch)."""
    reqs = [req(SamplingParams(seed=1000 + i, **params_kwargs), f"e{i}") for i in range(n)]
    out = Sampler()(logits_row.expand(n, -1).contiguous(), reqs)
    counts = torch.bincount(torch.tensor(out.tokens), minlength=logits_row.numel()).double()
    return counts / n


def total_variation(p: torch.Tensor, q: torch.Tensor) -> float:
    return 0.5 * float((p - q).abs().sum())


def test_temperature_sampling_follows_the_softmax():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 1.5, -0.3])
    for t in (0.5, 1.0, 2.0):
        want = torch.softmax(logits.double() / t, dim=-1)
        assert total_variation(empirical(logits, dict(temperature=t)), want) < 0.035


def test_top_k_restricts_to_the_k_largest_and_renormalises():
    logits = torch.tensor([0.3, 2.0, -1.0, 1.7, 1.0, 0.9, -0.2])
    freq = empirical(logits, dict(temperature=1.0, top_k=3))
    keep = [1, 3, 4]
    assert float(freq[[0, 2, 5, 6]].sum()) == 0.0
    want = torch.zeros(7, dtype=torch.float64)
    want[keep] = torch.softmax(logits[keep].double(), dim=-1)
    assert total_variation(freq, want) < 0.035


def test_top_p_keeps_the_smallest_nucleus():
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])
    logits = probs.log()
    # sorted: 0.5, 0.3, 0.15, 0.05 -> top_p 0.75 needs {1, 3}; 0.85 needs {1, 3, 2}
    freq = empirical(logits, dict(temperature=1.0, top_p=0.75))
    assert float(freq[0] + freq[2]) == 0.0
    assert total_variation(freq, torch.tensor([0, 0.5 / 0.8, 0, 0.3 / 0.8], dtype=torch.float64)) < 0.035
    freq = empirical(logits, dict(temperature=1.0, top_p=0.85))
    assert float(freq[0]) == 0.0 and float(freq[2]) > 0.1


def _reference_nucleus(row: torch.Tensor, top_k: int, top_p: float) -> list[int]:
    """The tokens a row keeps, by the definition: sort (float64), keep the top k (0 or >= V: all),
    renormalise, keep the smallest prefix whose mass reaches top_p."""
    row = row.double()
    order = row.argsort(descending=True).tolist()
    k = top_k if 0 < top_k < row.numel() else row.numel()
    kept = order[:k]
    p = torch.softmax(row[kept], dim=-1).tolist()
    nucleus, mass = [], 0.0
    for tok, pr in zip(kept, p):
        if top_p < 1.0 and mass >= top_p:
            break
        nucleus.append(tok)
        mass += pr
    return nucleus


def _check_filter(logits, top_k, top_p):
    before = logits.clone()
    got = filter_logits(logits, torch.tensor(top_k), torch.tensor(top_p, dtype=torch.float32))
    assert torch.equal(logits, before)  # never in place
    for i in range(logits.shape[0]):
        nucleus = _reference_nucleus(logits[i], top_k[i], top_p[i])
        assert set(torch.isfinite(got[i]).nonzero().flatten().tolist()) == set(nucleus), i
        assert torch.equal(got[i][nucleus], logits[i][nucleus])


def test_filter_logits_matches_a_row_by_row_reference():
    g = torch.Generator().manual_seed(3)
    _check_filter(torch.randn(6, 257, generator=g) * 3, [0, 1, 5, 0, 40, 257], [0.9, 1.0, 0.5, 1.0, 0.3, 0.999])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_filter_logits_over_a_large_vocabulary_ranks_candidates_or_the_whole_row(seed):
    """V = 5,003 > NUCLEUS_CANDIDATES: peaked rows' nuclei lie among the candidates, flat rows'
    (top_p 0.9 of nearly uniform logits) reach past them; top_k past V is off; rows with no filter
    pass through untouched beside filtered ones."""
    from orca_ext.sampling import NUCLEUS_CANDIDATES

    g = torch.Generator().manual_seed(seed)
    vocab = 5003
    assert vocab > 4 * NUCLEUS_CANDIDATES
    peaked = torch.randn(4, vocab, generator=g) * 4
    flat = torch.randn(3, vocab, generator=g) * 0.01
    logits = torch.cat([peaked, flat])
    _check_filter(logits, [0, 40, 2 ** 62, 1500, 0, 0, 7], [0.95, 0.9, 1.0, 0.99, 0.9, 1.0, 0.5])
    _check_filter(peaked, [0, 0, 0, 0], [0.95, 0.5, 0.99, 0.8])  # candidates only
    _check_filter(flat, [0, 3000, 0], [0.9, 0.9, 0.2])  # one nucleus past the candidates: whole rows
    # One token with ~10% of the mass over a flat rest: its largest probability alone does not rule
    # the candidates out, their mass (~0.28) does.
    spiked = flat[:2].clone()
    spiked[:, 17] = float(torch.log(torch.tensor(0.11 * vocab)))
    _check_filter(torch.cat([spiked, peaked[:1]]), [0, 0, 0], [0.9, 0.25, 0.95])
    unfiltered = filter_logits(logits, torch.tensor([0] * 7), torch.ones(7))
    assert unfiltered is logits
    assert filter_logits(logits, torch.full((7,), 2 ** 62), torch.ones(7)) is logits


def test_seeded_request_samples_the_same_whatever_its_batch_mates():
    g = torch.Generator().manual_seed(11)
    steps = [torch.randn(6, 301, generator=g) for _ in range(12)]
    target = dict(temperature=0.9, top_k=50, top_p=0.95, seed=1234)

    def run(position: int, mates: list[dict]) -> list[int]:
        params = mates[:position] + [target] + mates[position:]
        reqs = [req(SamplingParams(**p), f"m{i}") for i, p in enumerate(params)]
        sampler = Sampler()
        toks = []
        for logits in steps:
            rows = logits[:len(reqs)].clone()
            rows[position] = logits[5]  # the target always sees the same logits
            toks.append(sampler(rows, reqs).tokens[position])
        return toks

    alone = run(0, [])
    mates = [dict(temperature=1.3, seed=1), dict(), dict(temperature=0.5), dict(temperature=2.0, top_p=0.5, seed=9)]
    assert run(2, mates) == alone
    assert run(4, mates) == alone
    different = [req(SamplingParams(**{**target, "seed": 999}), "x")]
    sampler = Sampler()
    toks = [sampler(logits[5:6], different).tokens[0] for logits in steps]
    assert toks != alone  # a different seed gives a different stream (12 draws, ~never equal)


def test_logits_shape_is_checked():
    with pytest.raises(ValueError, match="logits"):
        Sampler()(torch.zeros(3, 5), [req(SamplingParams())])


def test_draw_never_picks_a_masked_token_and_follows_the_probabilities():
    from orca_ext.sampling import draw

    gen = torch.Generator().manual_seed(11)
    vocab = 49_152
    probs = torch.zeros(4, vocab)
    probs[0, 0] = 1.0                      # only the first token
    probs[1, vocab - 1] = 1.0              # only the last token
    probs[2, [7, 9000, vocab - 2]] = torch.tensor([0.2, 0.3, 0.5])  # masked tokens all around
    probs[3] = torch.softmax(torch.randn(vocab, generator=gen), dim=-1)
    counts = torch.zeros(3)
    for _ in range(2000):
        picked = draw(probs, [gen] * 4).tolist()
        assert picked[0] == 0 and picked[1] == vocab - 1
        assert picked[2] in (7, 9000, vocab - 2)
        assert 0 <= picked[3] < vocab
        counts[[7, 9000, vocab - 2].index(picked[2])] += 1
    assert total_variation(counts.double() / counts.sum(), torch.tensor([0.2, 0.3, 0.5], dtype=torch.float64)) < 0.04


def test_draw_takes_one_number_per_row_from_each_rows_generator():
    from orca_ext.sampling import draw

    probs = torch.softmax(torch.randn(3, 1000, generator=torch.Generator().manual_seed(1)), dim=-1)
    alone = [draw(probs[i:i + 1], [torch.Generator().manual_seed(5 + i)]).item() for i in range(3)]
    together = draw(probs, [torch.Generator().manual_seed(5 + i) for i in range(3)]).tolist()
    assert together == alone
    gen = torch.Generator().manual_seed(5)
    draw(probs[:1], [gen])
    assert torch.rand(1, generator=gen, dtype=torch.float64).item() != \
        torch.rand(1, generator=torch.Generator().manual_seed(5), dtype=torch.float64).item()
