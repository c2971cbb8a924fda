"""Incremental detokenization and stop-string matching.

Byte-level tokenizers can split one UTF-8 character over several tokens; decoding a prefix then
ends in U+FFFD. The detokenizer holds such text back until the character is complete, so a
streamed text only ever grows and never shows half a character. It decodes a short window
(a few already-emitted tokens plus the new ones) rather than the whole sequence, and seeds that
window with the tail of the prompt so a first token's leading space survives SentencePiece-style
decoding.

Stop strings are searched by StopMatcher, a streaming Aho-Corasick search: each generated
token's check reads only the new characters, so its cost does not grow with the number of stop
strings times their length.
"""
from __future__ import annotations

from typing import Sequence

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Feed generated token ids one by one; `text` is the resolved text so far (append-only)."""

    def __init__(self, tokenizer, prompt_token_ids: Sequence[int] = (), *,
                 skip_special_tokens: bool = True, context_tokens: int = 5):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        context = list(prompt_token_ids)[-context_tokens:] if context_tokens > 0 else []
        self._ids: list[int] = context
        self._prefix = 0              # window start: tokens before it are fully emitted
        self._read = len(context)     # tokens before it have been emitted as text
        self.text = ""

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip, clean_up_tokenization_spaces=False)

    def add(self, token_id: int) -> str:
        """Append one token; return the newly resolved text ("" while a character is incomplete)."""
        self._ids.append(int(token_id))
        prefix_text = self._decode(self._ids[self._prefix:self._read])
        new_text = self._decode(self._ids[self._prefix:])
        if len(new_text) > len(prefix_text) and not new_text.endswith(REPLACEMENT_CHAR):
            delta = new_text[len(prefix_text):]
            self._prefix, self._read = self._read, len(self._ids)
            self.text += delta
            return delta
        return ""

    def flush(self) -> str:
        """At the end of generation: emit whatever is still held back, even an incomplete character."""
        prefix_text = self._decode(self._ids[self._prefix:self._read])
        new_text = self._decode(self._ids[self._prefix:])
        delta = new_text[len(prefix_text):] if len(new_text) > len(prefix_text) else ""
        self._prefix = self._read = len(self._ids)
        self.text += delta
        return delta


class StopAutomaton:
    """The stop strings of one SamplingParams compiled into an Aho-Corasick automaton (immutable,
    shared by every request that uses those params).

    A state is a node of the trie of all stop strings: the longest suffix of the text read so far
    that is a prefix of some stop string. Reading one character costs O(1) amortised and at most
    O(longest stop) at once, whatever the number of stop strings, which is what keeps the
    per-token stop check linear in the new text (scanning every stop string at every position
    costs their count times their length per token, on the engine thread).
    """

    __slots__ = ("goto", "fail", "depth", "match_len", "longest")

    def __init__(self, stops: Sequence[str]):
        if not stops or not all(isinstance(s, str) and s for s in stops):
            raise ValueError("StopAutomaton needs at least one stop string, all non-empty")
        goto: list[dict[str, int]] = [{}]
        depth = [0]
        terminal = [False]
        for stop in stops:
            node = 0
            for ch in stop:
                nxt = goto[node].get(ch)
                if nxt is None:
                    nxt = len(goto)
                    goto[node][ch] = nxt
                    goto.append({})
                    depth.append(depth[node] + 1)
                    terminal.append(False)
                node = nxt
            terminal[node] = True
        fail = [0] * len(goto)
        # match_len[v]: length of the longest stop string that is a suffix of v's string (0: none);
        # the longest one ending at a position is the one that starts earliest there.
        match_len = [0] * len(goto)
        queue = list(goto[0].values())  # the root's children fail to the root
        for v in queue:  # breadth first: a node's failure link is shallower than the node
            match_len[v] = depth[v] if terminal[v] else match_len[fail[v]]
            for ch, w in goto[v].items():
                f = fail[v]
                while f and ch not in goto[f]:
                    f = fail[f]
                fail[w] = goto[f].get(ch, 0)
                queue.append(w)
        self.goto = goto
        self.fail = fail
        self.depth = depth
        self.match_len = match_len
        self.longest = max(len(s) for s in stops)


class StopMatcher:
    """One request's streaming stop-string search over its append-only detokenized text."""

    __slots__ = ("_auto", "_state", "_pos")

    def __init__(self, automaton: StopAutomaton):
        self._auto = automaton
        self._state = 0    # trie node: longest suffix of text[:_pos] that is a prefix of a stop
        self._pos = 0      # characters of the text already read

    def feed(self, text: str) -> int | None:
        """Read the characters of `text` not read before (`text` only ever grows). Returns the
        start index of the earliest-starting stop string that ends in them, or None."""
        auto = self._auto
        goto, fail, match_len = auto.goto, auto.fail, auto.match_len
        state, pos, end, best = self._state, self._pos, len(text), None
        while pos < end:
            if best is not None and pos - auto.longest + 1 > best:
                break  # every later match starts after the one found
            ch = text[pos]
            while state and ch not in goto[state]:
                state = fail[state]
            state = goto[state].get(ch, 0)
            n = match_len[state]
            if n and (best is None or pos - n + 1 < best):
                best = pos - n + 1
            pos += 1
        self._state, self._pos = state, pos
        return best

    @property
    def held(self) -> int:
        """Length of the longest suffix of the text read so far that is a prefix of some stop
        string. A streamed snapshot withholds it: if the stop string completes later it must not
        appear in the output, and published text must never shrink."""
        return self._auto.depth[self._state]
