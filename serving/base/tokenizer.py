"""Tokenizers the serving layer can use: the model's own, or a byte-level fallback for models without one."""

from __future__ import annotations

import codecs
from collections.abc import Iterable, Sequence
from typing import Protocol, runtime_checkable

REPLACEMENT = "\ufffd"


@runtime_checkable
class Tokenizer(Protocol):
    """What the serving layer needs of a tokenizer."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as token ids (0..255): the fallback for a model that ships no tokenizer.

    It needs `vocab_size >= 256`. Ids in `skip_ids` (the model's EOS) are left out of decoded text, like a
    tokenizer's special tokens; ids >= 256 are not bytes and decode to U+FFFD. `decode` never emits broken
    UTF-8: invalid byte sequences become U+FFFD, and an incomplete sequence at the end becomes U+FFFD too
    (`final=True`, a finished text) or is held back (`final=False`, a text that may still grow, so every
    later decode extends it).
    """

    def __init__(self, vocab_size: int, skip_ids: Iterable[int] = ()):
        if vocab_size < 256:
            raise ValueError(f"the model has no tokenizer and its vocabulary ({vocab_size} ids) is too small for "
                             "the byte-level fallback, which needs 256 ids (one per byte)")
        self.vocab_size = vocab_size
        self.skip_ids = frozenset(int(t) for t in skip_ids)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode("utf-8"))  # bytes have no special tokens to add

    def token_text(self, token: int) -> str | None:
        """None: a byte, or a model id beyond them, has no text of its own."""
        return None

    def decode(self, ids: Sequence[int], final: bool = True) -> str:
        parts, run = [], bytearray()
        for t in ids:
            t = int(t)
            if t in self.skip_ids:
                continue
            if 0 <= t < 256:
                run.append(t)
            else:  # not a byte: what came before is complete (an unfinished sequence becomes U+FFFD)
                parts += [run.decode("utf-8", errors="replace"), REPLACEMENT]
                run.clear()
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        parts.append(decoder.decode(bytes(run), final=final))  # final=False holds back an unfinished sequence
        return "".join(parts)


def tokenizer_for(model) -> Tokenizer:
    """The model's tokenizer (`model.tokenizer`: `encode(str) -> list[int]`, `decode(list[int]) -> str`), else the
    byte-level fallback (ValueError if the vocabulary is smaller than 256)."""
    if getattr(model, "tokenizer", None) is not None:
        return model.tokenizer
    eos = model.config.eos_token_id
    return ByteTokenizer(model.config.vocab_size, () if eos is None else (eos,))
