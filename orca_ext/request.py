"""Request state machine and the public output records (docs/DESIGN.md sections 3 and 5).

A `Request` is the engine's mutable view of one generation: its prompt, the tokens generated so
far, its KV slab and its place in Algorithm 1's state machine. Users never see it; they see
`RequestOutput` snapshots built from it.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from .prefix_cache import common_prefix

if TYPE_CHECKING:  # pragma: no cover
    from .detokenizer import IncrementalDetokenizer
    from .sampling import SamplingParams


class RequestState(enum.Enum):
    INITIATION = "initiation"  # in the pool, nothing computed, no slab
    RUNNING = "running"        # inside a batch that is executing
    INCREMENT = "increment"    # has its KV, ready for its next iteration
    RELEASED = "released"      # left the pool, slab returned
    # `Request.finished` is a different fact: a finish reason is set. A finished request stays in
    # the pool (RUNNING) until the batch it sits in returns; only then is it RELEASED.


@dataclass(frozen=True)
class TokenLogprob:
    """The log probability of one token, and the `top` most likely tokens at its position as
    (token id, logprob) pairs, most likely first. Generated tokens: of the distribution the
    sampler drew from (after penalties, logit_bias, temperature, top-k and top-p; -inf for a
    token those filtered out). Prompt tokens: of the model's raw distribution."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class RequestOutput:
    """One snapshot of a request. `text` is the full text so far (not a delta)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: Optional[str] = None  # None | "stop" | "length" | "abort" | "error"
    error: Optional[str] = None
    arrival_time: float = 0.0
    first_token_time: Optional[float] = None
    finish_time: Optional[float] = None
    # One entry per token_ids entry when params.logprobs is set, else None.
    logprobs: Optional[list[TokenLogprob]] = None
    # One entry per prompt token when params.prompt_logprobs is set (the first is None: nothing
    # predicts it), else None. Filled as the prompt's chunks are computed.
    prompt_logprobs: Optional[list[Optional[TokenLogprob]]] = None
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache (not computed)


@dataclass(frozen=True)
class IterationRecord:
    """What one engine iteration ran (kept when the server has record_iterations=True).
    `launch_time` and `complete_time` (time.perf_counter clock): when the batch was handed to the
    executor and when its tokens came back (None while in flight; with pipeline parallelism a
    later batch is launched before an earlier one completes)."""

    index: int
    request_ids: tuple[str, ...]
    num_prefill_tokens: int
    num_decode_tokens: int
    slots_reserved: int
    launch_time: float = 0.0
    complete_time: Optional[float] = None
    # New tokens per request (request_ids order): 1 per decode, the prompt or a chunk of it per prefill.
    chunk_sizes: tuple[int, ...] = ()


class Request:
    """Engine-side state of one request. Mutated only by the engine loop under the server lock."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: "SamplingParams",
                 detokenizer: "Optional[IncrementalDetokenizer]" = None,
                 eos_token_ids: frozenset[int] = frozenset(), client: Optional[str] = None):
        self.request_id = request_id
        self.client = client               # whose request, for fair admission (None: anonymous)
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.arrival_time = time.time()
        self.state = RequestState.INITIATION
        self.slab_start = -1               # first KV slot of the slab; -1 = no slab
        self.output_token_ids: list[int] = []
        self.num_cached = 0                # tokens whose K/V are in the slab
        self.num_prefix_hit = 0            # of them, prompt tokens copied from the prefix cache
        self.num_scheduled = 0             # new tokens in its current batch (set by the scheduler)
        self.first_token_time: Optional[float] = None
        self.finish_time: Optional[float] = None
        self.finish_reason: Optional[str] = None
        self.error: Optional[str] = None
        self.detokenizer = detokenizer
        self.text = ""                     # published text (stop strings excluded, held-back tail not shown)
        # Tokens that finish the request with "stop". EOS counts unless ignore_eos.
        self.stop_token_ids = frozenset(params.stop_token_ids) | frozenset(() if params.ignore_eos else eos_token_ids)
        self.generator = None              # per-request torch.Generator, made on first sampled step
        self.version = 0                   # bumped whenever a new snapshot is available
        self.stop_matcher = params.stop_matcher()  # streaming stop-string search (None: no stops)
        # A sibling of an earlier request with the same prompt (n > 1): the engine holds it back
        # until that request's prompt is cached, then copies the prompt's KV rows instead of
        # prefilling them again (Engine._fork). Cleared once used.
        self.fork_of: Optional["Request"] = None
        self.logprobs: Optional[list[TokenLogprob]] = [] if params.logprobs is not None else None
        self.prompt_logprobs: Optional[list[Optional[TokenLogprob]]] = (
            [None] if params.prompt_logprobs is not None else None)
        # Its position in its output grammar (guided decoding; None: unconstrained), advanced by
        # the sampler with each token it samples.
        self.guided = params.guided.matcher() if params.guided is not None else None

    # -- Algorithm 1 accessors -------------------------------------------------------------
    @property
    def reservation(self) -> int:
        """KV slots reserved at admission: len(prompt) + max_tokens."""
        return len(self.prompt_token_ids) + self.params.max_tokens

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def prompt_remaining(self) -> int:
        """Prompt tokens not yet in the KV cache (0 once the request is decoding)."""
        return max(0, len(self.prompt_token_ids) - self.num_cached)

    @property
    def prefix_cache_limit(self) -> int:
        """The most prompt tokens admission may take from cached KV rows (0: none). All but the
        last, whose logits give the first output token. A request that asks for prompt logprobs
        must report every position, which a hit skips: only as many as the request it shares a
        prefill with (fork_of) has logprobs for, of the tokens they share, else none."""
        last = len(self.prompt_token_ids) - 1
        if self.params.prompt_logprobs is None:
            return last
        parent = self.fork_of
        if parent is None or parent.prompt_logprobs is None or \
                parent.params.prompt_logprobs < self.params.prompt_logprobs:
            return 0
        return min(self.rows_shared_with(parent), len(parent.prompt_logprobs) - 1)

    def rows_shared_with(self, parent: "Request") -> int:
        """How many leading KV rows it may take from `parent`'s instead of computing them: those
        of the tokens their prompts share, but never the prompt's last (its logits give the
        first output token). With prompt logprobs one fewer where the prompts part: that row
        scores its own next token, so entry p (p <= the rows taken) is the same for both."""
        shared = common_prefix(parent.prompt_token_ids, self.prompt_token_ids, 0, len(self.prompt_token_ids))
        if self.params.prompt_logprobs is not None:
            shared -= 1
        return max(0, min(shared, len(self.prompt_token_ids) - 1))

    def start_from_cache(self, n_tokens: int) -> None:
        """Admission filled its first n_tokens KV rows from the prefix cache (n_tokens <=
        prefix_cache_limit): it prefills only the rest, and takes those positions' prompt
        logprobs from fork_of's."""
        self.num_cached = self.num_prefix_hit = n_tokens
        if self.prompt_logprobs is not None:
            self.prompt_logprobs = self.fork_of.prompt_logprobs_upto(n_tokens + 1, self.params.prompt_logprobs)

    @property
    def emits_token(self) -> bool:
        """Whether its scheduled input reaches the end of its known tokens, so the iteration
        samples its next token: False only for a prompt chunk that is not the prompt's last."""
        remaining = self.prompt_remaining
        return remaining == 0 or self.num_scheduled == 0 or self.num_scheduled >= remaining

    @property
    def logit_rows(self) -> int:
        """Logits rows its scheduled input needs: one per new token of a prompt chunk when it asks
        for prompt logprobs (row p predicts token p + 1), else one, its last token's."""
        if self.params.prompt_logprobs is None or not self.prompt_remaining:
            return 1
        return len(self.next_inputs()[0])

    def next_inputs(self) -> tuple[list[int], int]:
        """(new token ids, start position) for this request's next iteration: while the prompt
        is not all cached, its next chunk (at most `num_scheduled` tokens; the whole rest when
        that is 0), then its newest token."""
        remaining = self.prompt_remaining
        if remaining:
            n = remaining if self.num_scheduled == 0 else min(remaining, self.num_scheduled)
            return self.prompt_token_ids[self.num_cached:self.num_cached + n], self.num_cached
        return [self.output_token_ids[-1]], self.num_cached

    def prompt_logprobs_upto(self, count: int, top: int) -> Optional[list[Optional[TokenLogprob]]]:
        """Its first `count` prompt logprob entries with at most `top` alternatives each, or None
        when it has fewer entries or kept fewer alternatives."""
        have = self.prompt_logprobs
        if have is None or len(have) < count or self.params.prompt_logprobs < top:
            return None
        return [e if e is None or len(e.top) <= top else TokenLogprob(e.token_id, e.logprob, e.top[:top])
                for e in have[:count]]

    # -- lifecycle ---------------------------------------------------------------------------
    def mark_finished(self, reason: str, error: Optional[str] = None) -> None:
        """Set the finish reason (first call wins). Leaving the pool is the scheduler's job."""
        if self.finish_reason is not None:
            return
        self.finish_reason = reason
        self.error = error
        self.finish_time = time.time()
        self.version += 1

    def snapshot(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=list(self.prompt_token_ids),
            token_ids=list(self.output_token_ids),
            text=self.text,
            finished=self.finished,
            finish_reason=self.finish_reason,
            error=self.error,
            arrival_time=self.arrival_time,
            first_token_time=self.first_token_time,
            finish_time=self.finish_time,
            logprobs=None if self.logprobs is None else list(self.logprobs),
            prompt_logprobs=None if self.prompt_logprobs is None else list(self.prompt_logprobs),
            num_cached_tokens=self.num_prefix_hit,
        )

    def __repr__(self) -> str:  # pragma: no cover - debugging aid
        return (f"Request({self.request_id!r}, state={self.state.name}, prompt={len(self.prompt_token_ids)}, "
                f"out={len(self.output_token_ids)}, slab={self.slab_start}, finish={self.finish_reason})")
