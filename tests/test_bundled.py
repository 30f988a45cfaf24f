"""The bundled default model (`model/bundled/`): `load_model()` reads it like any V4.1 checkpoint, its tokenizer
round-trips text, it predicts held-out Shakespeare far better than a bigram model, and `jaxseek generate` runs it
when no model is named."""

import json
from pathlib import Path

import numpy as np
import pytest

from model.checkpoint import BUNDLED, load_model
from jaxseek.cli import main
from model.config_v41 import V41Config
from tests.helpers import greedy_full_forward
from training.data import held_out_windows, model_loss

# A fixed slice of Julius Caesar (a held-out work: no line of it was trained on), Act I from its start.
SLICE = Path(__file__).with_name("data") / "heldout_slice.txt"
# Measured on this slice when the shipped model was trained (model/bundled/README.md): its loss, and the loss
# of the bigram baseline counted on the training works (training.data.bigram_loss), in nats per token.
SLICE_LOSS, SLICE_BIGRAM_LOSS = 3.7363, 4.4374
PROMPT = "FLAVIUS.\nHence! home, you idle creatures"


@pytest.fixture(scope="module")
def model():
    return load_model()


def test_a_v41_checkpoint_with_its_tokenizer_in_the_package(model):
    assert isinstance(model.config, V41Config) and model.engram is not None and model.tokenizer is not None
    assert {p.name for p in BUNDLED.iterdir()} >= {"config.json", "model.safetensors", "tokenizer.json", "README.md"}
    assert sum(p.stat().st_size for p in BUNDLED.iterdir()) <= 25 * 2**20
    assert model.tokenizer.vocab_size == model.config.vocab_size


def test_tokenizer_round_trips_and_hides_special_tokens(model):
    tok = model.tokenizer
    text = "ROMEO.\nBut soft! what light through yonder window breaks?\n\n  café ☃ 🎭\t1599"
    ids = tok.encode(text)
    assert all(isinstance(i, int) and 0 <= i < model.config.vocab_size for i in ids)
    assert tok.decode(ids) == text
    special = {t: tok.tokenizer.token_to_id(t) for t in ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>",
                                                           "<｜▁pad▁｜>", "<｜User｜>", "<｜Assistant｜>", "<think>",
                                                           "</think>")}
    assert list(special.values()) == list(range(7))
    assert (model.config.bos_token_id, model.config.eos_token_id, model.config.engram_pad_id) == (0, 1, 2)
    assert tok.decode([0, *ids, 1]) == text
    assert tok.encode("<｜User｜>") == [3]


def test_held_out_loss_beats_the_bigram_baseline(model):
    ids = np.asarray(model.tokenizer.encode(SLICE.read_text(encoding="utf-8")), np.int32)
    loss = model_loss(model, held_out_windows(ids, 257))
    assert loss < SLICE_LOSS + 0.01
    assert loss < SLICE_BIGRAM_LOSS - 0.3


def test_generate_runs_the_bundled_model_by_default(model, capsys):
    # the engine tests/test_disagg.py, test_router.py and test_server.py run (2 slots, 96 tokens, 8-token prefill
    # chunks, batch-invariant, 5 top logprobs), so the persistent compile cache serves all four modules
    status = main(["generate", "--prompt", PROMPT, "--max-tokens", "12", "--temperature", "0", "--logprobs", "5",
                   "--max-slots", "2", "--max-len", "96", "--prefill-chunk", "8", "--batch-invariant", "--no-warmup",
                   "--output-format", "jsonl-compact"])
    out, err = capsys.readouterr()
    record = json.loads(out)
    assert status == 0 and "randomly initialised" not in err
    # greedy by the full forward, padded to the length tests/test_server.py's reference runs (one compile for both)
    assert record["token_ids"] == greedy_full_forward(model, [model.tokenizer.encode(PROMPT)], 12, rows=1,
                                                      width=96)[0][0]
    assert record["text"] == model.tokenizer.decode(record["token_ids"])
    words = record["text"].split()
    assert words and all(w.strip(".,;:!?'-").isalpha() for w in words if w.strip(".,;:!?'-")), record["text"]


def test_generate_runs_the_bundled_model_on_dp4_ep2(model, capsys):
    """`jaxseek generate --mesh dp=4,ep=2` (the 8 emulated devices of tests/conftest.py): the bundled model's
    greedy tokens of the full forward, as on one device (the flags of the test above)."""
    status = main(["generate", "--prompt", PROMPT, "--max-tokens", "12", "--temperature", "0", "--max-slots", "4",
                   "--max-len", "96", "--prefill-chunk", "8", "--batch-invariant", "--no-warmup", "--mesh", "dp=4,ep=2",
                   "--output-format", "jsonl-compact"])
    record = json.loads(capsys.readouterr().out)
    assert status == 0
    assert record["token_ids"] == greedy_full_forward(model, [model.tokenizer.encode(PROMPT)], 12, rows=1,
                                                      width=96)[0][0]
