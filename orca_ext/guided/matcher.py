"""A compiled grammar (shared, immutable) and one request's matcher state over it."""
from __future__ import annotations

from typing import Any, Optional

from .spec import GuidedSpec


class CompiledGrammar:
    """A GuidedSpec compiled for one tokenizer. `matcher()` gives a fresh per-request state; the
    matcher made at compile time is the template every request's matcher is copied from."""

    __slots__ = ("spec", "grammar", "tokenizer", "_template")

    def __init__(self, spec: GuidedSpec, grammar: str, tokenizer: Any, template: Any) -> None:
        self.spec = spec
        self.grammar = grammar
        self.tokenizer = tokenizer
        self._template = template

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer.vocab_size)

    def matcher(self) -> "GuidedMatcher":
        return GuidedMatcher(self._template.deep_copy(), self.vocab_size)

    def __repr__(self) -> str:
        return f"CompiledGrammar({self.spec.kind}, {len(self.spec.text)} chars)"


class GuidedMatcher:
    """One request's position in its grammar, advanced with each token it accepts.
    Used only by the engine's sampler, on the engine's thread."""

    __slots__ = ("_m", "vocab_size")

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self._m = matcher
        self.vocab_size = vocab_size

    def fill_mask(self, row_ptr: int, row_bytes: int) -> Optional[str]:
        """Write the allowed-token bitmask (bit t of 32-bit word t // 32) at row_ptr; an error
        message instead when the grammar cannot go on (over its step budget, or ended wrongly)."""
        self._m.unsafe_compute_mask_ptr(row_ptr, row_bytes)
        return self.error()

    def accept(self, token: int) -> Optional[str]:
        """Advance past the sampled token; an error message when the grammar refuses it."""
        if self._m.consume_token(int(token)):
            return None
        return self.error() or f"token {int(token)} is not allowed by the grammar"

    def error(self) -> Optional[str]:
        if self._m.is_error():
            return f"guided decoding failed: {self._m.get_error()[:300]}"
        return None

    @property
    def finished(self) -> bool:
        """The grammar is complete and allows nothing but EOS."""
        return bool(self._m.is_stopped())
