"""Incremental detokenisation for streaming: the text of a growing token list, piece by piece, never cutting a
UTF-8 character in two and never re-decoding the whole output per piece."""

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
