"""Which slice of a model one worker holds under tensor x pipeline parallelism.

Pipeline parallelism splits the decoder layers into `pp` contiguous ranges (as evenly as
possible; earlier stages take the extra layers, because the last stage also runs the lm_head);
the embedding lives on the first stage, the final norm and lm_head on the last.

Tensor parallelism (Megatron style) splits every layer of a stage over `tp` ranks:
  - q/k/v by heads (column-parallel): rank r computes its query heads and the KV heads they read,
    and its KV pools hold only those KV heads;
  - gate/up by intermediate columns (column-parallel);
  - o_proj and down by input columns (row-parallel): each rank's product is a partial sum, and
    one all-reduce per projection adds them up;
  - lm_head by vocabulary rows (vocab-parallel): each rank computes logits of its vocabulary
    slice, and the slices are gathered into full rows.
Norms (including Qwen3's per-head q/k norms, whose weight is shared by every head) are replicated.
Row-parallel biases are kept by tensor rank 0 only, so the all-reduce adds them once.

When tp exceeds the number of KV heads, each KV head is replicated on tp / num_kv_heads ranks
(every rank holds exactly one KV head: the one its query heads read).
"""
from __future__ import annotations

import dataclasses

from .config import ModelSpec


@dataclasses.dataclass(frozen=True)
class ShardSpec:
    """The slice of the model held by the worker at (stage, tp_rank)."""

    tp_size: int
    tp_rank: int
    pp_size: int
    stage: int
    layer_start: int        # this stage's decoder layers are [layer_start, layer_end)
    layer_end: int
    q_head_start: int       # this rank's query heads [q_head_start, q_head_start + num_q_heads)
    num_q_heads: int
    kv_head_start: int      # this rank's KV heads [kv_head_start, kv_head_start + num_kv_heads)
    num_kv_heads: int
    inter_start: int        # this rank's gate/up rows and down columns [inter_start, + inter_size)
    inter_size: int
    vocab_start: int        # this rank's lm_head rows [vocab_start, vocab_end)
    vocab_end: int
    vocab_padded: int       # every rank's logits are padded to this many columns for the gather

    @property
    def first_stage(self) -> bool:
        return self.stage == 0

    @property
    def last_stage(self) -> bool:
        return self.stage == self.pp_size - 1

    @property
    def keeps_row_parallel_bias(self) -> bool:
        return self.tp_rank == 0


def layer_ranges(num_layers: int, pp: int) -> list[tuple[int, int]]:
    """[start, end) of each stage's layers: sizes differ by at most one, earlier stages larger."""
    base, extra = divmod(num_layers, pp)
    ranges, start = [], 0
    for stage in range(pp):
        end = start + base + (1 if stage < extra else 0)
        ranges.append((start, end))
        start = end
    return ranges


def check_shardable(spec: ModelSpec, tp: int, pp: int) -> None:
    """ValueError naming every divisibility rule that `spec` breaks under (tp, pp)."""
    for name, value in (("tensor_parallel_size", tp), ("pipeline_parallel_size", pp)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    problems = []
    if spec.num_heads % tp:
        problems.append(f"num_attention_heads={spec.num_heads} must be divisible by "
                        f"tensor_parallel_size={tp}")
    nkv = spec.num_kv_heads
    if tp <= nkv and nkv % tp:
        problems.append(f"num_key_value_heads={nkv} must be divisible by tensor_parallel_size={tp} "
                        f"(or tensor_parallel_size a multiple of it, which replicates KV heads)")
    if tp > nkv and tp % nkv:
        problems.append(f"tensor_parallel_size={tp} exceeds num_key_value_heads={nkv}, so it must "
                        f"be a multiple of it (each KV head is then replicated on tp/num_kv_heads ranks)")
    if spec.intermediate_size % tp:
        problems.append(f"intermediate_size={spec.intermediate_size} must be divisible by "
                        f"tensor_parallel_size={tp}")
    if spec.vocab_size < tp:
        problems.append(f"vocab_size={spec.vocab_size} must be >= tensor_parallel_size={tp}")
    if pp > spec.num_layers:
        problems.append(f"pipeline_parallel_size={pp} exceeds the model's {spec.num_layers} layers "
                        f"(every stage needs at least one layer)")
    if problems:
        raise ValueError(f"{spec.architecture} cannot be split with tensor_parallel_size={tp}, "
                         f"pipeline_parallel_size={pp}: " + "; ".join(problems))


def make_shard(spec: ModelSpec, tp: int, pp: int, tp_rank: int, stage: int) -> ShardSpec:
    check_shardable(spec, tp, pp)
    if not (0 <= tp_rank < tp and 0 <= stage < pp):
        raise ValueError(f"tp_rank={tp_rank}, stage={stage} outside tp={tp}, pp={pp}")
    layer_start, layer_end = layer_ranges(spec.num_layers, pp)[stage]
    nq = spec.num_heads // tp
    if tp <= spec.num_kv_heads:
        nkv = spec.num_kv_heads // tp
        kv_start = tp_rank * nkv
    else:  # replicated KV heads: the one KV head this rank's query heads belong to
        nkv = 1
        kv_start = tp_rank * spec.num_kv_heads // tp
    inter = spec.intermediate_size // tp
    vocab_padded = -(-spec.vocab_size // tp)
    vocab_start = min(tp_rank * vocab_padded, spec.vocab_size)
    return ShardSpec(
        tp_size=tp, tp_rank=tp_rank, pp_size=pp, stage=stage,
        layer_start=layer_start, layer_end=layer_end,
        q_head_start=tp_rank * nq, num_q_heads=nq, kv_head_start=kv_start, num_kv_heads=nkv,
        inter_start=tp_rank * inter, inter_size=inter,
        vocab_start=vocab_start, vocab_end=min(vocab_start + vocab_padded, spec.vocab_size),
        vocab_padded=vocab_padded,
    )
