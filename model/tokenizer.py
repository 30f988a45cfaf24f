"""A checkpoint's own tokenizer: `tokenizer.json` (HF `tokenizers` format, as DeepSeek ships it) behind the
`encode(str) -> list[int]` / `decode(list[int]) -> str` interface the serving layer uses."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer


class TextTokenizer:
    """Text <-> token ids with a `tokenizer.json`. `encode` adds no special tokens (the model sees exactly the
    prompt) unless asked (then those the tokenizer.json's post-processor adds, such as bos); `decode` leaves
    special tokens (bos, eos, chat markers) out of the text."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)

    @classmethod
    def from_file(cls, path: str | Path) -> TextTokenizer:
        return cls(Tokenizer.from_file(str(path)))

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode([int(t) for t in ids], skip_special_tokens=True)

    def token_text(self, token: int) -> str | None:
        """A token's own text, special tokens included (None for an id the vocabulary lacks)."""
        return self.tokenizer.id_to_token(int(token))
