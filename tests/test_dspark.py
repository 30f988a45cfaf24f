"""DSpark drafter (`model/dspark.py`): shapes, position-addressed rollback, exact draft distributions,
confidences, the training forward equal to the serving one, the target's taps, training (loss falls, a run is
a function of its seed), STS calibration and V4.1 checkpoint names."""

import numpy as np
import pytest
import jax
import jax.numpy as jnp
from flax import nnx

from model.initialize import init_model
from model.calibration import calibration_error, fit_sts, prefix_ece
from model.checkpoint import load_model, save_checkpoint
from model.config_v41 import V41Config
from model.dspark import DSparkConfig, draw_draft, init_drafter
from model.safetensors_io import read_tensors, write_tensors
from training.drafter import DrafterSettings, DrafterTrainer, kept_at_budget, sample_anchors, train_drafter

V, G = 64, 4
TARGET = V41Config(
    vocab_size=V, hidden_size=32, num_hidden_layers=3, num_attention_heads=2, head_dim=16, qk_rope_head_dim=8,
    q_lora_rank=16, o_groups=2, o_lora_rank=8, sliding_window=8, compress_ratios=(0, 2, 1, 0, 0),
    kv_source_layer_ids=(1, 2), index_source_layer_ids=(1, 2), candidate_source_layer_id=-1, index_n_heads=2,
    index_head_dim=16, index_topk=4, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
    moe_intermediate_size=32, rms_norm_eps=1e-6, rope_scaling=None, max_position_embeddings=512,
    num_nextn_predict_layers=2, dspark_block_size=G, dspark_noise_token_id=V - 1, dspark_target_layer_ids=(0, 2),
    dspark_markov_rank=8, dspark_n_routed_experts=4, dspark_num_experts_per_tok=2, qat_fake_quant=False,
)
CONFIG = DSparkConfig.from_v41(TARGET)
F = len(CONFIG.target_layer_ids) * TARGET.hidden_size


@pytest.fixture(scope="module")
def target():
    return init_model(TARGET, seed=0)


@pytest.fixture(scope="module")
def drafter():
    return init_drafter(TARGET, CONFIG, seed=1)


def shared(target):
    module = target.module()
    return module.embed.weight[...], module.head.weight[...]


def rows(r: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(r, 32, F)).astype(np.float32), rng.integers(0, V, (r, 32)).astype(np.int32),
            np.stack([np.full(r, 7, np.uint32), np.arange(r, dtype=np.uint32)], axis=1))


def test_shapes_and_position_addressed_rollback(target, drafter):
    feats, toks, seeds = rows(3)
    temps = np.array([1.0, 0.0, 0.7], np.float32)
    zeros, width = np.zeros(3), 10  # every call has the same width (one compiled draft): rows past count are padding
    fresh = drafter.draft(target, feats[:, :10], zeros, np.full(3, 10), drafter.init_state(3), toks[:, 10], seeds, temps)
    assert fresh.tokens.shape == (3, G) and fresh.tokens.dtype == jnp.int32
    assert fresh.probs.shape == (3, G, V) and fresh.confidences.shape == (3, G)
    assert [s["ring_kv"].shape for s in fresh.state] == [(3, 8 + G + 1, 16)] * 2
    # the same context through another history: positions 0..7, a speculative 8..11 that is rejected (row 0 had
    # committed 8), then a restart at 9 (row 0, one feature) or 8 (two features)
    state = drafter.init_state(3)
    state = drafter.draft(target, feats[:, :width], zeros, np.full(3, 8), state, toks[:, 8], seeds, temps).state
    speculative = np.concatenate([-feats[:, 8:12], feats[:, 12:18]], axis=1)
    speculative[0, 0] = feats[0, 8]
    state = drafter.draft(target, speculative, np.full(3, 8), np.full(3, 4), state, toks[:, 12], seeds, temps).state
    replay = np.full((3, width, F), 99.0, np.float32)
    replay[:, :2], replay[0, 0], replay[0, 1] = feats[:, 8:10], feats[0, 9], 99.0
    again = drafter.draft(target, replay, np.array([9, 8, 8]), np.array([1, 2, 2]), state, toks[:, 10], seeds, temps)
    np.testing.assert_array_equal(again.tokens, fresh.tokens)
    np.testing.assert_allclose(again.probs, fresh.probs, atol=1e-6)
    np.testing.assert_allclose(again.confidences, fresh.confidences, atol=1e-6)


def test_draft_distributions_are_the_markov_softmax_and_match_the_training_forward(target, drafter):
    feats, toks, seeds = rows(3, seed=3)
    temps = np.array([0.8, 0.0, 1.0], np.float32)
    out = drafter.draft(target, feats[:, :10], np.zeros(3), np.full(3, 10), drafter.init_state(3), toks[:, 10],
                        seeds, temps)
    tokens, probs, conf = (np.asarray(x) for x in out[:3])
    assert np.all((conf > 0) & (conf < 1))
    # the training path: blocks anchored at 10 of whole sequences whose context is the same features
    module, (embed, head) = drafter.module(), shared(target)
    sequence = toks.copy()
    sequence[:, 11:11 + G] = tokens  # teacher forcing with the sampled drafts reproduces the serving chain
    logits, conf_logits = jax.jit(module.teacher_forced)(embed, head, jnp.asarray(feats[:, :16]),
                                                         jnp.asarray(sequence[:, :16]), jnp.full((3, 1), 10))
    np.testing.assert_allclose(jax.nn.sigmoid(conf_logits[:, 0]), conf, atol=1e-5)
    np.testing.assert_allclose(jax.nn.softmax(logits[0, 0] / 0.8, axis=-1), probs[0], atol=1e-5)
    np.testing.assert_allclose(probs[0].sum(-1), 1.0, atol=1e-5)
    np.testing.assert_array_equal(probs[1], np.eye(V)[tokens[1]])  # greedy: one-hot at the argmax
    np.testing.assert_array_equal(tokens[1], np.argmax(logits[1, 0], axis=-1))


def test_draft_tokens_follow_their_distribution():
    logits = jnp.asarray(np.random.default_rng(0).normal(size=V) * 2, jnp.float32)
    n = 4000
    seeds = jnp.stack([jnp.zeros(n, jnp.uint32), jnp.arange(n, dtype=jnp.uint32)], axis=1)
    tokens, probs = jax.jit(draw_draft)(jnp.broadcast_to(logits, (n, V)), seeds, jnp.full(n, 5),
                                        jnp.full(n, 1.5))
    freq = np.bincount(np.asarray(tokens), minlength=V) / n
    np.testing.assert_allclose(probs[0], jax.nn.softmax(logits / 1.5), atol=1e-6)
    assert np.abs(freq - np.asarray(probs[0])).max() < 0.03


def test_taps_are_the_mean_streams_of_the_collected_layers(target):
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, V, (2, 12)), jnp.int32)

    @jax.jit
    def run(params, tokens):
        module = nnx.merge(target.graphdef, params)
        plain, _ = module(tokens, module.init_cache(2, 12))
        logits, _, taps = module(tokens, module.init_cache(2, 12), collect=(2, 0))
        return plain, logits, taps, module.streams(tokens, module.init_cache(2, 12))[0]

    plain, logits, taps, streams = run(target.params, tokens)
    np.testing.assert_array_equal(logits, plain)
    assert taps.shape == (2, 12, 64)
    np.testing.assert_allclose(taps[..., :32], streams.mean(axis=2), atol=1e-6)  # layer 2 first, as named


def test_training_loss_falls_and_a_run_is_a_function_of_its_seed(target):
    rng = np.random.default_rng(0)
    cycle = rng.integers(0, V - 1, 7)
    sequences = np.stack([np.roll(np.tile(cycle, 6), -i)[:40] for i in range(12)]).astype(np.int32)
    settings = DrafterSettings(steps=30, batch=4, anchors=6, lr=1e-2, warmup=3, seed=0)
    trainer = DrafterTrainer(target, CONFIG, settings)
    anchors = sample_anchors((8, 40), 4, 6, G, 0, 0)
    assert anchors.min() >= 8 and anchors.max() <= 40 - 1 - G
    before = trainer.evaluate(trainer.initial, sequences[:4], anchors)
    state, losses = train_drafter(trainer, sequences, prompt_len=8)
    after = trainer.evaluate(state, sequences[:4], anchors)
    assert np.mean(losses[-5:]) < 0.7 * np.mean(losses[:5])
    assert after["loss"] < before["loss"] and np.mean(after["ce"]) < np.mean(before["ce"])
    _, again = train_drafter(trainer, sequences, prompt_len=8)
    assert again == losses


def test_sts_lowers_the_calibration_error_on_held_out_drafts():
    rng = np.random.default_rng(0)
    truth = rng.normal(0.5, 1.5, (4000, G)) - np.arange(G) * 0.3
    accept = 1 / (1 + np.exp(-truth))
    raw = 3.0 * truth + rng.normal(0, 0.3, truth.shape)  # overconfident, more so than a temperature fixes exactly
    temps = fit_sts(raw[:2000], accept[:2000])
    assert all(t > 1 for t in temps)
    before, after = 1 / (1 + np.exp(-raw[2000:])), 1 / (1 + np.exp(-raw[2000:] / np.asarray(temps)))
    assert calibration_error(accept[2000:], after) < 0.5 * calibration_error(accept[2000:], before)
    assert np.all(prefix_ece(accept[2000:], after) < prefix_ece(accept[2000:], before))
    direct = 1 / (1 + np.exp(-raw[2000:] / np.asarray(fit_sts(raw[:2000], accept[:2000], "abs_error"))))
    assert calibration_error(accept[2000:], direct) < 0.5 * calibration_error(accept[2000:], before)


def test_a_smaller_budget_keeps_the_accepted_drafts_of_the_pairs_it_admits():
    """Hand-computed: expected acceptances 0.9, 0.45, 0.225 (row 0) and 0.2, 0.1, 0.1 (row 1), 1.975 in all."""
    accept = np.array([[[0.9, 0.5, 0.5], [0.2, 0.5, 1.0]]])
    by_confidence = np.array([[[0.8, 0.4, 0.2], [0.3, 0.1, 0.05]]])
    by_position = np.broadcast_to([1.0, 0.5, 0.25], (1, 2, 3))  # ties go to the earlier row
    assert kept_at_budget(accept, by_confidence, 0.0) == pytest.approx(1.0)
    assert kept_at_budget(accept, by_confidence, 1 / 3) == pytest.approx(1.775 / 1.975)  # 4 pairs: 3 + 1
    assert kept_at_budget(accept, by_position, 1 / 3) == pytest.approx(1.65 / 1.975)  # 2 + 2
    assert kept_at_budget(accept, by_confidence, 0.5) == pytest.approx(1.55 / 1.975)  # 2 + 1


def upstream_names() -> dict[str, tuple[int, ...]]:
    """Every DSpark tensor of a V4.1 checkpoint with this config, spelled as DeepSeek's checkpoints spell them."""
    d, r, hd, h, e, inter = 32, 8, 16, 2, 4, 32
    names = {"mtp.0.main_proj.weight": (d, 2 * d), "mtp.0.main_norm.weight": (d,), "mtp.1.norm.weight": (d,),
             "mtp.1.markov_head.embed.weight": (V, r), "mtp.1.markov_head.head.weight": (V, r),
             "mtp.1.confidence_head.proj.weight": (1, d + r)}
    for s in range(2):
        p = f"mtp.{s}."
        for site in ("attn", "ffn"):
            names |= {p + f"hc_{site}_fn": (24, 4 * d), p + f"hc_{site}_base": (24,), p + f"hc_{site}_scale": (3,),
                      p + f"{site}_norm.weight": (d,)}
        names |= {p + "attn.attn_sink": (h,), p + "attn.wq_a.weight": (16, d), p + "attn.q_norm.weight": (16,),
                  p + "attn.wq_b.weight": (h * hd, 16), p + "attn.wkv.weight": (hd, d), p + "attn.kv_norm.weight": (hd,),
                  p + "attn.wo_a.weight": (2 * 8, h * hd // 2), p + "attn.wo_b.weight": (d, 2 * 8),
                  p + "ffn.gate.weight": (e, d), p + "ffn.gate.bias": (e,), p + "ffn.gate.bias_vl": (e,)}
        for expert in [f"ffn.experts.{i}." for i in range(e)] + ["ffn.shared_experts."]:
            names |= {p + expert + "w1.weight": (inter, d), p + expert + "w3.weight": (inter, d),
                      p + expert + "w2.weight": (d, inter)}
    return names


def test_v41_dspark_checkpoint_names_load_and_round_trip(target, tmp_path):
    save_checkpoint(target, tmp_path / "ckpt")
    rng = np.random.default_rng(2)
    tensors = {n: rng.normal(size=s).astype(np.float32) for n, s in upstream_names().items()}
    write_tensors(tmp_path / "ckpt" / "mtp.safetensors", tensors)
    loaded = load_model(tmp_path / "ckpt")
    assert loaded.drafter is not None and loaded.drafter.config == CONFIG
    params = nnx.to_pure_dict(loaded.drafter.params)
    np.testing.assert_array_equal(params["markov_head"]["embed"]["weight"], tensors["mtp.1.markov_head.embed.weight"])
    np.testing.assert_array_equal(params["main_proj"]["weight"], tensors["mtp.0.main_proj.weight"])
    np.testing.assert_array_equal(params["layers"][1]["ffn"]["experts"]["w2"][3],
                                  tensors["mtp.1.ffn.experts.3.w2.weight"])
    np.testing.assert_array_equal(params["layers"][0]["hc_ffn"]["base"], tensors["mtp.0.hc_ffn_base"])
    # written back beside a checkpoint (dspark.json + dspark.safetensors) under the same names
    save_checkpoint(loaded, tmp_path / "again")
    assert set(read_tensors(tmp_path / "again" / "dspark.safetensors")) == set(tensors)
    assert load_model(tmp_path / "again").drafter.config == CONFIG


def test_the_bundled_drafter_drafts_what_the_bundled_model_writes():
    from pathlib import Path

    from training.drafter import TargetPass, verify_offline

    model = load_model()
    assert model.drafter is not None and len(model.drafter.config.confidence_temperatures) == 5
    text = (Path(__file__).with_name("data") / "heldout_slice.txt").read_text(encoding="utf-8")
    tokens = np.asarray(model.tokenizer.encode(text)[:4 * 96], np.int32).reshape(4, 96)  # held-out Shakespeare
    anchors = sample_anchors((40, 96), 4, 8, 5, 0, 0)
    target = TargetPass(model, model.drafter.config.target_layer_ids)
    for temperature in (0.0, 1.0):  # an untrained drafter: about 0.25 (first draft) and 0.15 (later ones)
        result = verify_offline(target, model.drafter, tokens, anchors, temperature, seed=0)
        assert result["accept_prob"][:, 0].mean() > 0.45 and result["accept_prob"].mean() > 0.3
