"""Training (`training/`): a run is a function of its settings (same seed, same losses; a resumed run equals an
uninterrupted one), batches depend only on (seed, step), the bigram baseline and the exported checkpoint."""

import dataclasses

import jax
import numpy as np
import pytest

from model.engram import canonical_vocab
from training.data import bigram_loss, held_out_windows, model_loss, train_batch
from training.train import Trainer, TrainSettings, bundled_config, export, train

SETTINGS = TrainSettings(steps=4, batch=2, seq_len=32, warmup=1, eval_every=2, eval_windows=2, checkpoint_every=2)
STREAMS = np.random.default_rng(0).integers(0, 256, 3000).astype(np.int32), np.arange(200, dtype=np.int32)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(config, canonical token map, tokenizer.json): a byte-level tokenizer of 256 ids and the bundled
    architecture (4 layers: ratio-2 and ratio-1 sources, candidate pool, Engram, MoE) at toy widths."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer, tokenizer.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    tokenizer.save(str(path))
    token_map = canonical_vocab(path)
    config = dataclasses.replace(bundled_config(256, int(token_map.max()) + 1), hidden_size=32, q_lora_rank=16,
                                 moe_intermediate_size=32, head_dim=16, qk_rope_head_dim=8, index_head_dim=16,
                                 o_lora_rank=8)
    return config, token_map, path


def run(setup, out, until=None, settings=SETTINGS):
    trainer = Trainer(*setup[:2], settings)
    return trainer, *train(trainer, *STREAMS, out, until=until, progress=False)


@pytest.fixture(scope="module")
def straight(setup, tmp_path_factory):
    return run(setup, tmp_path_factory.mktemp("train") / "straight")


def test_the_same_seed_reproduces_the_losses(setup, straight, tmp_path):
    trainer, _, history = straight
    _, _, again = run(setup, tmp_path / "again")  # a new trainer: same initial weights, batches and steps
    assert len(history["loss"]) == SETTINGS.steps and np.isfinite(history["loss"]).all()
    np.testing.assert_allclose(again["loss"], history["loss"], rtol=0, atol=1e-5)
    assert [s for s, _ in again["held_out"]] == [2, 4]
    np.testing.assert_allclose([v for _, v in again["held_out"]], [v for _, v in history["held_out"]], atol=1e-5)
    other = Trainer(*setup[:2], dataclasses.replace(SETTINGS, seed=1))
    assert not np.allclose(*(jax.tree.leaves(t.initial["trainable"]["params"])[0] for t in (trainer, other)))
    assert not np.array_equal(*(train_batch(STREAMS[0], 2, 33, s.settings.seed, 0) for s in (trainer, other)))


def test_a_resumed_run_equals_an_uninterrupted_one(setup, straight, tmp_path):
    trainer, state, history = straight
    _, first = train(trainer, *STREAMS, tmp_path / "resumed", until=2, progress=False)
    assert len(first["loss"]) == 2
    resumed_state, resumed = train(trainer, *STREAMS, tmp_path / "resumed", progress=False)
    np.testing.assert_allclose(resumed["loss"], history["loss"], rtol=0, atol=1e-5)
    for a, b in zip(*(jax.tree.leaves(s["trainable"]) for s in (resumed_state, state))):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="other settings"):
        run(setup, tmp_path / "resumed", settings=dataclasses.replace(SETTINGS, lr=1e-3))


def test_router_biases_move_by_the_balance_rate(straight):
    """Only the aux-loss-free update moves a selection bias (no gradient reaches it): +-rate per step."""
    _, state, _ = straight
    for layer in state["trainable"]["params"]["layers"].values():
        steps = np.asarray(layer["ffn"]["gate"]["bias"]) / SETTINGS.balance_rate
        np.testing.assert_allclose(steps, np.round(steps), atol=1e-3)
        assert np.abs(steps).max() <= SETTINGS.steps and steps.any()


def test_export_loads_through_load_model_with_the_same_loss(setup, straight, tmp_path):
    trainer, state, _ = straight
    model = export(trainer, state, setup[2], tmp_path / "ckpt")
    windows = held_out_windows(STREAMS[1], SETTINGS.seq_len + 1)
    assert model.tokenizer is not None and model.engram is not None
    assert model_loss(model, windows) == pytest.approx(trainer.evaluate(state, windows), abs=1e-4)


def test_batches_depend_only_on_seed_and_step():
    stream = np.arange(1000, dtype=np.int32)
    a = train_batch(stream, 4, 17, seed=3, step=5)
    assert a.shape == (4, 17) and (np.diff(a, axis=1) == 1).all()  # contiguous windows
    np.testing.assert_array_equal(a, train_batch(stream, 4, 17, seed=3, step=5))
    assert not np.array_equal(a, train_batch(stream, 4, 17, seed=3, step=6))
    with pytest.raises(ValueError, match="too short"):
        train_batch(stream[:10], 1, 17, seed=0, step=0)


def test_bigram_baseline():
    cycle = np.tile(np.arange(8, dtype=np.int32), 50)  # every token has one successor
    assert bigram_loss(cycle, held_out_windows(cycle, 9), 16) < 0.02
    noise = np.random.default_rng(1).integers(0, 16, 4000).astype(np.int32)
    assert bigram_loss(noise, held_out_windows(noise[:800], 9), 16) == pytest.approx(np.log(16), abs=0.05)
