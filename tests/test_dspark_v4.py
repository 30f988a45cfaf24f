"""A DSpark drafter beside a V4 target (V4-Flash-0731 / V4-Flash-DSpark): its checkpoint names load, its block
forward is the published one (checked against a NumPy composition of that description), it trains on the V4
target's features, and the engine decodes with it losslessly."""

import dataclasses
import json
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from model.checkpoint import CheckpointError, load_model, save_checkpoint
from model.config import preset
from model.dspark import DSparkConfig, init_drafter
from pallas_kernels.hyper import hc_site_reference as hc_site
from model.rope import apply_rope, inv_frequencies
from model.safetensors_io import read_tensors, write_tensors
from serving.core.engine import Engine
from serving.base.sampling import SamplingParams
from serving.speculation.verify_plan import CostTable
from tests.helpers import greedy_full_forward, random_model
from training.drafter import DrafterSettings, DrafterTrainer, train_drafter

TINY = preset("tiny")
TARGET = dataclasses.replace(TINY, num_nextn_predict_layers=0,  # V4-Flash-0731 has no MTP block
                             compress_ratios=TINY.compress_ratios[:TINY.num_hidden_layers])
V, D, N_HC = TARGET.vocab_size, TARGET.hidden_size, TARGET.hc_mult
LAYERS, STAGES, G, RANK = (1, 2, 3), 2, 5, 16
DSPARK_FIELDS = {"dspark_block_size": G, "dspark_markov_rank": RANK, "dspark_noise_token_id": V - 1,
                 "dspark_target_layer_ids": list(LAYERS)}


CONFIG = DSparkConfig(target_layer_ids=LAYERS, num_layers=STAGES, block_size=G, noise_token_id=V - 1,
                      markov_rank=RANK, n_routed_experts=4, num_experts_per_tok=2, window=TARGET.sliding_window)


@pytest.fixture(scope="module")
def target():
    return random_model(TARGET, seed=4)


def upstream_names() -> dict[str, tuple[int, ...]]:
    """Every tensor of a V4-Flash-DSpark drafter of this size, spelled and shaped as DeepSeek's checkpoint: V4
    layers under mtp.{s}, the context projection under mtp.0, the collapse, norm and heads under the last."""
    c, h, hd = TARGET, TARGET.num_attention_heads, TARGET.head_dim
    e, inter, width = c.n_routed_experts, c.moe_intermediate_size, (2 + N_HC) * N_HC
    last = f"mtp.{STAGES - 1}."
    names = {"mtp.0.main_proj.weight": (D, len(LAYERS) * D), "mtp.0.main_norm.weight": (D,),
             last + "norm.weight": (D,), last + "hc_head_fn": (N_HC, N_HC * D), last + "hc_head_base": (N_HC,),
             last + "hc_head_scale": (1,), last + "markov_head.markov_w1.weight": (V, RANK),
             last + "markov_head.markov_w2.weight": (V, RANK), last + "confidence_head.proj.weight": (1, D + RANK)}
    for s in range(STAGES):
        p = f"mtp.{s}."
        for site in ("attn", "ffn"):
            names |= {p + f"hc_{site}_fn": (width, N_HC * D), p + f"hc_{site}_base": (width,),
                      p + f"hc_{site}_scale": (3,), p + f"{site}_norm.weight": (D,)}
        names |= {p + "attn.attn_sink": (h,), p + "attn.wq_a.weight": (c.q_lora_rank, D),
                  p + "attn.q_norm.weight": (c.q_lora_rank,), p + "attn.wq_b.weight": (h * hd, c.q_lora_rank),
                  p + "attn.wkv.weight": (hd, D), p + "attn.kv_norm.weight": (hd,),
                  p + "attn.wo_a.weight": (c.o_groups * c.o_lora_rank, h * hd // c.o_groups),
                  p + "attn.wo_b.weight": (D, c.o_groups * c.o_lora_rank), p + "ffn.gate.weight": (e, D),
                  p + "ffn.gate.bias": (e,)}
        for expert in [f"ffn.experts.{i}." for i in range(e)] + ["ffn.shared_experts."]:
            names |= {p + expert + "w1.weight": (inter, D), p + expert + "w3.weight": (inter, D),
                      p + expert + "w2.weight": (D, inter)}
    return names


def test_a_v4_flash_0731_checkpoint_loads_its_dspark_drafter(target, tmp_path):
    """The V4-Flash-0731 form: config.json keeps MTP's num_nextn_predict_layers=1 and lists one compress ratio
    per stage; the stages are counted from the mtp.* tensors and the experts are the target's."""
    save_checkpoint(target, tmp_path / "ckpt")
    raw = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    n = TARGET.num_hidden_layers
    raw |= DSPARK_FIELDS | {"num_nextn_predict_layers": 1, "compress_ratios": list(TARGET.compress_ratios[:n])
                            + [0] * STAGES}
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(raw))
    rng = np.random.default_rng(5)
    tensors = {name: rng.normal(size=shape).astype(np.float32) for name, shape in upstream_names().items()}
    write_tensors(tmp_path / "ckpt" / "mtp.safetensors", tensors)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loaded = load_model(tmp_path / "ckpt")
    assert loaded.drafter.config == CONFIG
    assert loaded.config.num_nextn_predict_layers == 0
    params = nnx.to_pure_dict(loaded.drafter.params)
    np.testing.assert_array_equal(params["hc_head"]["fn"], tensors[f"mtp.{STAGES - 1}.hc_head_fn"])
    np.testing.assert_array_equal(params["markov_head"]["head"]["weight"],
                                  tensors[f"mtp.{STAGES - 1}.markov_head.markov_w2.weight"])
    np.testing.assert_array_equal(params["layers"][1]["ffn"]["gate"]["bias"], tensors["mtp.1.ffn.gate.bias"])
    tokens = np.random.default_rng(0).integers(0, V, (2, 20))
    np.testing.assert_array_equal(np.asarray(loaded.logits(tokens)), np.asarray(target.logits(tokens)))
    save_checkpoint(loaded, tmp_path / "again")  # written back beside the target under the same names
    assert set(read_tensors(tmp_path / "again" / "dspark.safetensors")) == set(tensors)
    assert load_model(tmp_path / "again").drafter.config == loaded.drafter.config


def test_a_v4_model_with_an_mtp_block_and_a_dspark_drafter_is_not_saved(tmp_path):
    """Both would be named mtp.*: the save refuses rather than write a checkpoint that cannot load."""
    model = random_model(TINY, seed=1)
    model.drafter = init_drafter(TINY, CONFIG)
    with pytest.raises(CheckpointError, match="both MTP blocks and a DSpark drafter"):
        save_checkpoint(model, tmp_path / "both")
    assert not (tmp_path / "both").exists()


def _rms(x, eps=TARGET.rms_norm_eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


FREQS = inv_frequencies(TARGET.qk_rope_head_dim, TARGET.rope_theta, None)
ROPE = jax.jit(lambda x, positions: apply_rope(x, positions, FREQS))
SITE = jax.jit(lambda streams, fn, base, scale: hc_site(streams, fn, base, scale, None, TARGET.hc_sinkhorn_iters,
                                                        TARGET.hc_eps, TARGET.rms_norm_eps))


def _rope(x, positions):
    return np.asarray(ROPE(jnp.asarray(x), jnp.asarray(positions)))


def reference_block(module, embed, head, taps, tokens, anchor):
    """(logits with the Markov bias of the true previous tokens [G, V], raw confidences [G]) of the block
    anchored at `anchor` of one sequence, composed in NumPy from the published description of V4-Flash-DSpark's
    drafter: context = main_norm(main_proj(mean over hc of the target layers' streams)) of the window before
    the anchor; the block [anchor token, noise x (G-1)] through V4 layers (each mHC site collapsing its own
    input, queries RMS-normalised per head, attention over [context keys ; block keys] with sinks, MoE);
    the last stage's hc_head, norm and the target's head; Markov bias W2 W1[previous token]; confidence
    proj . [pre-norm hidden ; W1[previous token]]. mHC sites, RoPE and the MoE are the target's, checked
    against transformers elsewhere."""
    p = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(module)))
    cfg = TARGET
    h_, hd = cfg.num_attention_heads, cfg.head_dim
    mean_taps = taps.reshape(len(taps), len(LAYERS), N_HC, D).mean(2).reshape(len(taps), -1)
    main_x = _rms(mean_taps @ p["main_proj"]["weight"].T) * p["main_norm"]["weight"]
    ctx_pos = np.arange(max(0, anchor - module.config.window), anchor)
    block_pos = anchor + np.arange(G)
    block_ids = np.array([tokens[anchor]] + [module.config.noise_token_id] * (G - 1))
    streams = np.repeat(embed[block_ids][:, None], N_HC, axis=1)  # [G, n, D]
    for s, blk in enumerate(module.layers):
        ps = p["layers"][s]
        a = ps["attn"]

        def site(streams, hc):
            _, post, comb, x = SITE(jnp.asarray(streams[None]), hc["fn"], hc["base"], hc["scale"])
            return np.asarray(post[0]), np.asarray(comb[0]), np.asarray(x[0])

        post, comb, x = site(streams, ps["hc_attn"])
        x = _rms(x) * ps["attn_norm"]["weight"]
        q = (_rms(x @ a["wq_a"]["weight"].T) * a["q_norm"]["weight"]) @ a["wq_b"]["weight"].T
        q = _rope(_rms(q.reshape(G, h_, hd)), block_pos)
        latents = [_rms(y @ a["wkv"]["weight"].T) * a["kv_norm"]["weight"] for y in (main_x[ctx_pos], x)]
        kv = np.concatenate([_rope(latents[0][:, None], ctx_pos)[:, 0], _rope(latents[1][:, None], block_pos)[:, 0]])
        scores = np.einsum("ghd,kd->ghk", q, kv) / np.sqrt(hd)
        scores = np.concatenate([scores, np.broadcast_to(a["attn_sink"][None, :, None], (G, h_, 1))], -1)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs = probs[..., :-1] / probs.sum(-1, keepdims=True)
        output = jax.jit(lambda o, pos: blk.attn.output(o, pos, np.asarray(blk.attn.freqs, np.float32)))
        out = np.asarray(output(jnp.asarray(np.einsum("ghk,kd->ghd", probs, kv)[None]), jnp.asarray(block_pos)))[0]
        streams = post[..., None] * out[:, None] + np.einsum("gij,gid->gjd", comb, streams)
        post, comb, x = site(streams, ps["hc_ffn"])
        y = np.asarray(jax.jit(blk.ffn)(jnp.asarray(_rms(x) * ps["ffn_norm"]["weight"])[None],
                                        jnp.asarray(block_ids)[None]))[0]
        streams = post[..., None] * y[:, None] + np.einsum("gij,gid->gjd", comb, streams)
    hc = p["hc_head"]
    flat = _rms(streams.reshape(G, -1))
    pre = 1 / (1 + np.exp(-(flat @ hc["fn"].T * hc["scale"][0] + hc["base"]))) + cfg.hc_eps
    hidden = np.einsum("gn,gnd->gd", pre, streams)
    previous = tokens[anchor + np.arange(G)]
    e = p["markov_head"]["embed"]["weight"][previous]
    logits = (_rms(hidden) * p["norm"]["weight"]) @ head.T + e @ p["markov_head"]["head"]["weight"].T
    return logits, np.concatenate([hidden, e], -1) @ p["confidence_head"]["proj"]["weight"][0]


def test_the_v4_drafter_block_is_the_published_forward(target):
    graphdef, state = nnx.split(init_drafter(TARGET, CONFIG, seed=6).module())
    wave = lambda x: x + 0.1 * jnp.sin(1.7 * jnp.arange(x.size).reshape(x.shape))  # noqa: E731
    module = nnx.merge(graphdef, jax.tree.map(wave, state))  # no zero biases, sinks or mHC bases
    tokens = np.random.default_rng(7).integers(0, V, 24).astype(np.int32)
    m = target.module()
    _, _, taps = jax.jit(lambda t: m.streams(t, m.init_cache(1, 32), collect=LAYERS))(jnp.asarray(tokens[None]))
    embed, head = np.asarray(m.embed.weight[...]), np.asarray(m.head.weight[...])
    anchors = np.array([[3, 12, 17]])  # a short context, a full window, the last anchor with G tokens after it
    logits, conf = jax.jit(module.teacher_forced)(jnp.asarray(embed), jnp.asarray(head), taps,
                                                  jnp.asarray(tokens[None]), jnp.asarray(anchors))
    for i, anchor in enumerate(anchors[0]):
        ref_logits, ref_conf = reference_block(module, embed, head, np.asarray(taps[0]), tokens, anchor)
        np.testing.assert_allclose(np.asarray(logits[0, i]), ref_logits, rtol=2e-4, atol=2e-4)
        np.testing.assert_allclose(np.asarray(conf[0, i]), ref_conf, rtol=2e-4, atol=2e-4)


def test_the_v4_drafter_trains_on_the_targets_features(target):
    """A few steps on sequences the target's layers see (a repeated cycle): the loss falls."""
    cycle = np.random.default_rng(9).integers(0, V - 1, 7)
    sequences = np.stack([np.roll(np.tile(cycle, 6), -i)[:32] for i in range(8)]).astype(np.int32)
    trainer = DrafterTrainer(target, CONFIG, DrafterSettings(steps=30, batch=4, anchors=4, lr=1e-2, warmup=3))
    _, losses = train_drafter(trainer, sequences, prompt_len=8)
    assert np.mean(losses[-5:]) < 0.7 * np.mean(losses[:5])


def test_a_v4_target_decodes_losslessly_with_its_dspark_drafter(target):
    """Greedy outputs equal plain decoding, through prompt chunks, verify steps and zero-overhead reads; the
    untrained drafter's blocks are verified (DSpark on fixed bucket costs under which verifying pays). The
    engine's speculation modes share this path with V4.1 targets (`test_spec_engine`); what a V4 target
    changes is the drafter's input (flattened streams) and layers."""
    model = random_model(TARGET, seed=4)
    model.drafter = init_drafter(TARGET, CONFIG, seed=6)
    prompts = [np.random.default_rng(8).integers(0, V, n).tolist() for n in (21, 6)]
    engine = Engine(model, max_slots=2, max_len=64, page_tokens=16, prefill_chunk=16, max_prefill_rows=1,
                    speculation="dspark", num_drafts=3, verify_widths=(4,), batch_invariant=True)
    engine.speculation.costs = CostTable({(r, w): 1.0 for r in engine.decode_rows
                                          for w in (0, 1) + engine.speculation.verify_widths}, window=0)
    outputs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    for prompt, out, (reference, _) in zip(prompts, outputs, greedy_full_forward(target, prompts, 12)):
        assert out.token_ids == reference
    assert engine.speculation_metrics()["verified_per_step"] > 0
