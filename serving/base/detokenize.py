"""Incremental detokenisation for streaming: the text of a growing token list, piece by piece, never cutting a
UTF-8 character in two and never re-decoding the whole output per piece; and a streamed reply's pieces, held
back while they may be the start of a stop string or of a chat-format marker."""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns token ids, as they arrive, into text increments whose concatenation is the decoded text.

    Byte-level BPE tokens may hold part of a multi-byte character, which a decoder shows as U+FFFD: a piece
    whose text ends in U+FFFD is held back until the next tokens complete the character (or `flush` gives up
    on it). Each `push` decodes only the tokens since the last emitted piece plus a few tokens of context
    before them (so a token's leading space or merged bytes decode as they do in the full text), as vLLM does.
    """

    def __init__(self, decode: Callable[[Sequence[int]], str], context: int = 4):
        self.decode, self.context = decode, context
        self.ids: list[int] = []
        self.prefix = 0  # start of the context tokens decoded before the new ones
        self.read = 0  # tokens whose text has been emitted

    def push(self, ids: Sequence[int]) -> str:
        """Add tokens; returns the text that became complete (possibly empty)."""
        self.ids.extend(int(t) for t in ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """The text still held back (an unfinished character shows as U+FFFD): call once the output is done."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self.read == len(self.ids):
            return ""
        before = self.decode(self.ids[self.prefix:self.read])
        text = self.decode(self.ids[self.prefix:])
        if not final and (text.endswith(REPLACEMENT) or len(text) <= len(before)):
            return ""  # an unfinished character (or nothing visible yet): wait for more tokens
        self.prefix, self.read = max(self.prefix, len(self.ids) - self.context), len(self.ids)
        return text[len(before):]


def markup_decoder(tokenizer, drop_ids) -> Callable[[Sequence[int]], str]:
    """A decode function that keeps the chat markup tokens in the text (`</think>`, DSML, ...), which the chat
    format parses, and drops only `drop_ids` (bos, eos). For a tokenizer without special tokens (the byte-level
    fallback) it is the tokenizer's own decode."""
    hf = getattr(tokenizer, "tokenizer", None)
    if hf is None:
        return tokenizer.decode
    drop = frozenset(int(t) for t in drop_ids if t is not None)

    def decode(ids: Sequence[int]) -> str:
        return hf.decode([int(t) for t in ids if int(t) not in drop], skip_special_tokens=False)

    return decode


def _held_suffix(text: str, patterns) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `patterns` (text that may
    still become a stop string or a markup marker)."""
    best = 0
    for p in patterns:
        for k in range(min(len(p) - 1, len(text)), best, -1):
            if text.endswith(p[:k]):
                best = k
                break
    return best


class ChoiceStream:
    """One streamed choice: incremental text split into reasoning, content and a tool-call block (which is
    swallowed and parsed at the end), with text held back while it may be the start of a stop string or of
    the marker that ends the current part. `markers` maps a part to the marker that ends it (chat format)."""

    def __init__(self, decode, stop: tuple[str, ...], markers: dict[str, str] | None = None,
                 thinking: bool = False):
        self.detok = IncrementalDetokenizer(decode)
        self.stop, self.markers = stop, markers or {}
        self.phase = "reasoning" if thinking else "content"
        self.pending = ""  # decoded, not yet emitted
        self.consumed = 0  # characters of the full text emitted or swallowed
        self.emitted = {"reasoning": "", "content": ""}

    def push(self, token_ids: list[int]) -> list[tuple[str, str]]:
        self.pending += self.detok.push(token_ids)
        return self._advance(final=False)

    def finish(self, full_text: str) -> list[tuple[str, str]]:
        """The rest of the choice, given its final text (cut at a stop string by the engine)."""
        self.pending = full_text[self.consumed:]
        return self._advance(final=True)

    def _advance(self, final: bool) -> list[tuple[str, str]]:
        out = []
        while self.pending and self.phase != "tools":
            marker = self.markers.get(self.phase)
            cut = len(self.pending)
            if not final:
                hits = [self.pending.find(s) for s in self.stop if s in self.pending]
                cut = min(hits) if hits else cut - _held_suffix(self.pending, self.stop + ((marker,) if marker else ()))
            found = self.pending.find(marker) if marker else -1
            if 0 <= found and (found < cut or final):
                self._emit(out, self.pending[:found].rstrip() if self.phase == "content" else self.pending[:found])
                self.consumed += found + len(marker)
                self.pending = self.pending[found + len(marker):]
                self.phase = "content" if self.phase == "reasoning" else "tools"
                continue
            if marker and self.phase == "content" and not final:
                cut = len(self.pending[:cut].rstrip())  # whitespace before a tool-call block is not content
            self._emit(out, self.pending[:cut])
            self.consumed += cut
            self.pending = self.pending[cut:]
            break
        if self.phase == "tools":  # swallowed: the whole block is parsed at the end
            self.consumed += len(self.pending)
            self.pending = ""
        return out

    def _emit(self, out: list, text: str) -> None:
        if text:
            out.append((self.phase, text))
            self.emitted[self.phase] += text
