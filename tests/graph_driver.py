"""Drive a DecodeGraphRunner and an eager twin of the same model through the same iterations.

Requests come and go as in a serving run: each step decodes a random subset of the live requests
(so batch sizes, and with them the buckets, change every step), sometimes together with a new
request's prefill (a mixed iteration, which must run eagerly), and finished requests return their
slabs, which later requests reuse (a stale padding row would then write into a live request's KV).
Every step compares the two forwards request by request. Used by the CPU tests (a stand-in for the
graph capture) and the CUDA tests (real CUDA graphs).
"""
from __future__ import annotations

import dataclasses
import random

import torch

from orca_ext import _C
from orca_ext.models.batch import ForwardBatch
from orca_ext.models.causal_lm import CausalLM
from orca_ext.cuda_graphs import DecodeGraphRunner


def eager_twin(model: CausalLM) -> CausalLM:
    """A second CausalLM over the same weight tensors, with its own KV cache."""
    return CausalLM(model.spec, model.embed, model.layers, model.final_norm, model.lm_head, model.device,
                    model.dtype)


@dataclasses.dataclass
class Live:
    tokens: list[int]
    slab: int
    cached: int = 0     # tokens in the KV cache
    budget: int = 0     # tokens still to generate


@dataclasses.dataclass
class DriveReport:
    steps: int = 0
    decode_batch_sizes: set = dataclasses.field(default_factory=set)
    mixed_steps: int = 0
    max_logit_diff: float = 0.0
    token_mismatches: list = dataclasses.field(default_factory=list)   # (step, request, ours, eager, eager gap)


def drive(runner: DecodeGraphRunner, eager: CausalLM, *, n_slots: int, steps: int, seed: int,
          max_batch: int, max_prompt: int = 40, max_new: int = 30, margin: float = 0.0) -> DriveReport:
    """Run `steps` iterations on both models; returns what happened. A greedy token may differ from
    the eager one only where the eager logits of the two tokens are within `margin` (0: never)."""
    rng = random.Random(seed)
    vocab = runner.spec.vocab_size
    alloc = _C.SlabAllocator(n_slots)
    live: dict[int, Live] = {}
    waiting = 0
    report = DriveReport()
    next_id = 0
    for step in range(steps):
        # Admit a new request now and then (its prefill joins this iteration).
        new = None
        if (not live or rng.random() < 0.5) and len(live) < max_batch:
            prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, max_prompt))]
            budget = rng.randint(1, max_new)
            slab = alloc.allocate(len(prompt) + budget)
            if slab >= 0:
                new = next_id
                live[new] = Live(prompt, slab, 0, budget)
                next_id += 1
        decoders = [r for r in live if live[r].cached > 0]
        rng.shuffle(decoders)
        room = max(1, min(len(decoders), max_batch - (new is not None)))
        # Often everyone (large batches), otherwise a random subset (every size below).
        chosen = decoders[:room if rng.random() < 0.3 else rng.randint(1, room)]
        if new is not None:
            chosen.append(new)
        if not chosen:
            waiting += 1
            continue
        inputs = []
        for r in chosen:
            req = live[r]
            inputs.append((req.tokens[req.cached:], req.cached, req.slab))
        batch = ForwardBatch.build(inputs, runner.device)
        ours = runner.forward(batch).float()
        ref = eager.forward(batch).float()
        report.steps += 1
        if new is None:
            report.decode_batch_sizes.add(len(chosen))
        else:
            report.mixed_steps += 1
        report.max_logit_diff = max(report.max_logit_diff, float((ours - ref).abs().max()))
        ours_tok, ref_tok = ours.argmax(-1).tolist(), ref.argmax(-1).tolist()
        for i, r in enumerate(chosen):
            req = live[r]
            if ours_tok[i] != ref_tok[i]:
                gap = float(ref[i, ref_tok[i]] - ref[i, ours_tok[i]])
                report.token_mismatches.append((step, r, ours_tok[i], ref_tok[i], gap))
                assert gap <= margin, (f"step {step}, request {r} (batch of {len(chosen)}): graph token "
                                       f"{ours_tok[i]} vs eager {ref_tok[i]}, eager logit gap {gap:.4g}")
            req.cached = len(req.tokens)
            req.tokens.append(ref_tok[i])  # both continue from the eager token
            req.budget -= 1
            if req.budget == 0:
                alloc.free(req.slab)
                del live[r]
    return report


def written_slots(model: CausalLM, n_slots: int) -> torch.Tensor:
    """[n_slots] bool: the slots among the first n_slots whose K or V holds anything but zeros."""
    kv = torch.stack([p[:n_slots] for p in model.k_cache + model.v_cache])  # [2L, S, Hkv, D]
    return (kv != 0).flatten(2).any(-1).any(0).cpu()
