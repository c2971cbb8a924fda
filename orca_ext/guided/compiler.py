"""Grammar compilation: bounded, cached by constraint text, and meant to run off the engine thread.

`GrammarCompiler.compile(spec)` turns a GuidedSpec into a CompiledGrammar for one tokenizer. It is
synchronous and thread-safe; the HTTP layer runs it on a small pool of its own threads, shared
fairly between clients (http/service.py), so a slow compile delays neither the event loop nor the
engine. Bounds:
- the constraint's size and depth (spec.py), before anything is compiled;
- llguidance's parser limits (PARSER_LIMITS): they cap the work of building the lexer and the
  work of computing one token mask, so neither a compile nor a step of a hostile grammar can run
  long (a step over its budget fails only that request, see masks.py);
- a CPU-time budget (`timeout`): a compile that used more of its thread's CPU is refused, naming
  the time. CPU rather than wall time, because the HTTP layer runs compiles at the lowest priority:
  on a machine the forward keeps busy a compile waits for cycles, and waiting is not its cost.
Results are cached by (kind, text) in an LRU of `cache_size` entries; refusals are cached too,
so that resending a bad constraint costs nothing. Concurrent compiles of one text share one run.
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from typing import Any, Iterable, Optional, Union

from ..errors import InvalidRequestError
from .matcher import CompiledGrammar
from .spec import GuidedSpec

DEFAULT_COMPILE_TIMEOUT = 5.0   # seconds of the compiling thread's CPU time
DEFAULT_CACHE_SIZE = 256
MAX_ERROR_CHARS = 300

# llguidance's limits, lowered from its defaults so that one mask step of any grammar stays in
# the low milliseconds (its documented speeds: lexer fuel ~14k/ms, Earley items ~20k/ms).
_LIMITS = dict(
    max_items_in_row=2000,
    initial_lexer_fuel=1_000_000,   # building the lexer: ~20 ms at most
    step_lexer_fuel=50_000,         # one mask: ~4 ms of lexer work at most
    step_max_items=20_000,          # one mask: ~1 ms of parser work at most
    max_lexer_states=50_000,        # ~100 MB of lexer states at most
    max_grammar_size=100_000,
    verbose_errors=False,           # errors name the problem, not the parser's internal state
)


def parser_limits():
    import llguidance

    return llguidance.LLParserLimits(**_LIMITS)


def llg_tokenizer(hf_tokenizer: Any, eos_token_ids: Iterable[int], vocab_size: Optional[int] = None):
    """llguidance's view of a Hugging Face (fast) tokenizer; a finished grammar allows only the
    EOS tokens, which end the request."""
    import llguidance.hf

    eos = sorted(int(t) for t in eos_token_ids)
    if not eos and getattr(hf_tokenizer, "eos_token_id", None) is not None:
        eos = [int(hf_tokenizer.eos_token_id)]
    return llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=eos or None)


class GrammarCompiler:
    """Compiles GuidedSpecs for one tokenizer. `tokenizer`: an llguidance.LLTokenizer, or a
    zero-argument callable that makes one (built once, on first use: it takes ~0.3 s)."""

    def __init__(self, tokenizer: Any, *, timeout: float = DEFAULT_COMPILE_TIMEOUT,
                 cache_size: int = DEFAULT_CACHE_SIZE) -> None:
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds (got {timeout!r})")
        if not isinstance(cache_size, int) or cache_size < 1:
            raise ValueError(f"cache_size must be an integer >= 1 (got {cache_size!r})")
        self.timeout = float(timeout)
        self.cache_size = cache_size
        self._tokenizer = tokenizer
        self._lock = threading.Lock()
        self._cache: "OrderedDict[tuple, Union[CompiledGrammar, InvalidRequestError]]" = OrderedDict()
        self._running: dict[tuple, Future] = {}
        self.compiles = 0   # compiles actually run (cache misses)

    def tokenizer(self):
        with self._lock:
            if callable(self._tokenizer):
                self._tokenizer = self._tokenizer()
            return self._tokenizer

    def compile(self, spec: GuidedSpec) -> CompiledGrammar:
        """The compiled grammar; InvalidRequestError (param spec.field) when the constraint is
        invalid, over the parser limits or took more than `timeout` seconds of CPU to compile."""
        key = spec.key
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
            else:
                running = self._running.get(key)
                if running is None:
                    running = self._running[key] = Future()
                    owner = True
                else:
                    owner = False
        if hit is None:
            if owner:
                try:
                    hit = self._run(spec)
                except BaseException as exc:  # a bug, not the client's constraint: not cached
                    with self._lock:
                        del self._running[key]
                    running.set_exception(exc)
                    raise
                with self._lock:
                    self._cache[key] = hit
                    while len(self._cache) > self.cache_size:
                        self._cache.popitem(last=False)
                    del self._running[key]
                running.set_result(hit)
            else:
                hit = running.result()
        if isinstance(hit, InvalidRequestError):
            raise InvalidRequestError(str(hit), param=spec.field)
        return hit

    def _run(self, spec: GuidedSpec) -> Union[CompiledGrammar, InvalidRequestError]:
        import llguidance

        tokenizer = self.tokenizer()
        with self._lock:
            self.compiles += 1
        start = time.thread_time()  # llguidance builds on this thread (with the GIL dropped)
        try:
            grammar = spec.grammar()
        except (ValueError, TypeError) as exc:
            return InvalidRequestError(f"{spec.field}: {_short(str(exc))}", param=spec.field)
        # Builds the lexer (llguidance drops the GIL meanwhile); errors leave it in an error state.
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=parser_limits())
        if not matcher.is_error():
            # The first mask builds the lexer states of the start (up to tens of ms for a large
            # schema); computed here, on this thread, every request's copy starts from them and
            # the engine thread never pays for it.
            matcher.compute_bitmask()
        elapsed = time.thread_time() - start
        if matcher.is_error():
            return InvalidRequestError(f"{spec.field} is not a usable constraint: {_short(matcher.get_error())}",
                                       param=spec.field)
        if elapsed > self.timeout:
            return InvalidRequestError(f"{spec.field} took {elapsed:.1f} s of CPU to compile; the limit is "
                                       f"{self.timeout:g} s", param=spec.field)
        return CompiledGrammar(spec, grammar, tokenizer, matcher)


def _short(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= MAX_ERROR_CHARS else text[:MAX_ERROR_CHARS] + "..."
