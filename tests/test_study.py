"""Layout studies: published KV figures from the real cache structures, per-device bytes, the CLI's JSON."""

import json
from pathlib import Path

import pytest

from jaxseek.cli import main
from model.config import load_config, preset
from model.step_cost import decode_step_cost
from sharding.mesh import MeshSpec, MeshSpecError
from sharding.storage import kv_figures, v32
from sharding.study import StudyOptions, device_profile, study

V32_BYTES = 61 * (512 + 16 + 64 * 2 + 128 + 4)  # V3.2 report accounting: FlashMLA FP8 latent + FP8 index key


@pytest.fixture(scope="module")
def v4_kv():
    return {name: kv_figures(preset(name)) for name in ("v4-flash", "v4-pro")}


def test_published_kv_figures(v4_kv):
    # DeepSeek-V4 report: ~3.47 KB (Flash) and ~4.97 KB (Pro) per token with FP8 entries, BF16 rope dims and
    # FP4 index keys: 21 x (576/4 + 68/4) + 20 x 576/128 and 30 x 161 + 31 x 4.5
    assert v4_kv["v4-flash"]["kv_bytes_per_token_global"] == pytest.approx(3471.0)
    assert v4_kv["v4-pro"]["kv_bytes_per_token_global"] == pytest.approx(4969.5)
    assert kv_figures(v32())["kv_bytes_per_token_global"] == V32_BYTES == 48068
    ratios = {name: v4_kv[name]["kv_bytes_per_token_global"] / V32_BYTES for name in v4_kv}
    print(f"\nKV / V3.2: Flash {100 * ratios['v4-flash']:.1f}%, Pro {100 * ratios['v4-pro']:.1f}% (published 7%, 10%)")
    assert round(100 * ratios["v4-flash"]) == 7 and round(100 * ratios["v4-pro"]) == 10
    # vLLM's all-BF16 accounting of Pro: 9.62 GiB at 1M tokens
    assert kv_figures(preset("v4-pro"), "bf16")["kv_bytes_per_token_global"] * 2 ** 20 / 2 ** 30 == \
        pytest.approx(9.62, abs=0.005)


def test_v41_global_kv_and_window():
    kv = kv_figures(preset("v41-flash"))
    assert kv["kv_bytes_per_token_global"] == 890.0  # published: FP4 latents + FP4 index keys, 4 sources
    assert kv["kv_bytes_per_token_swa"] == 40 * (512 + 512 // 32)  # every layer's FP8 window entry + scales


def test_cli_json_v41_flash_dep64(capsys):
    assert main(["study", "--config", "v41-flash", "--mesh", "dp=64,ep=64", "--device", "sm100",
                 "--compile", "none", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["devices"] == 64 and report["device"] == "B200"
    assert report["kv_bytes_per_token_global"] == 890.0
    assert report["experts_per_device"] == 6  # 384 experts over 64 shards
    expert_bytes = 40 * 6 * 3 * 2304 * 5120 * (0.5 + 1 / 32)  # FP4 + UE8M0 per 32
    assert report["param_bytes_experts_per_device"] == pytest.approx(expert_bytes)
    engram = (384006168 + 384016682) * (256 + 8) / 64  # FP8 rows + scales, sharded over 64 devices
    assert report["param_bytes_engram_per_device"] == pytest.approx(engram)
    free = 180e9 * 0.9 - report["param_bytes_per_device"] - report["kv_fixed_bytes_per_sequence"]
    assert report["context_tokens_fit_per_device"] == int(free // 890)
    assert report["kv_bytes_per_token"] >= report["kv_bytes_per_token_global"]


def test_redundant_experts_and_placements():
    opts = dict(compile_steps=())
    base = study("v41-flash", MeshSpec(dp=64, ep=64), StudyOptions(**opts))
    more = study("v41-flash", MeshSpec(dp=64, ep=64), StudyOptions(redundant_experts=64, engram="host", **opts))
    assert more["experts_per_device"] == 7
    assert more["param_bytes_experts_per_device"] == pytest.approx(base["param_bytes_experts_per_device"] * 7 / 6)
    assert more["param_bytes_engram_per_device"] == 0 and more["engram_host_bytes"] > 190e9
    with pytest.raises(MeshSpecError, match="redundant"):
        study("v41-flash", MeshSpec(dp=64, ep=64), StudyOptions(redundant_experts=10, **opts))


def _whole_step(config_name: str, spec: MeshSpec, batch: int, max_len: int) -> dict:
    """Figures of the decode step compiled as one program (the reference for the study's pieces)."""
    import jax
    import jax.numpy as jnp

    from sharding.expert_parallel import expert_parallel
    from sharding.mesh import batch_sharded, make_mesh, model_forward, param_shardings
    from sharding.study import _abstract, _compiled_figures, _with_shardings

    _, model = _abstract(config_name)
    mesh = make_mesh(spec)
    params = _with_shardings(model.params, param_shardings(model.params, mesh))
    inputs = (jax.ShapeDtypeStruct((batch, 1), jnp.int32), jax.eval_shape(lambda: model.module().init_cache(batch,
                                                                                                           max_len)))
    with expert_parallel(mesh):
        traced = jax.jit(model_forward(model)).trace(params, *_with_shardings(inputs, batch_sharded(mesh, inputs)))
    return _compiled_figures(traced.lower().compile())


def test_compiled_ep_study_and_chart(tmp_path):
    reports = [study("tiny", MeshSpec.parse(text), StudyOptions(device="h200", compile_steps=steps, context=64))
               for text, steps in (("dp=2,ep=2", ("decode",)), ("dp=2", ()))]
    decode = reports[0]["steps"]["decode"]
    assert decode["tokens"] == 2 and decode["flops_per_token"] > 0
    analytic = decode_step_cost(preset("tiny"), 1, 63)["flops"]  # what one token at the compiled context needs
    assert decode["flops_per_token_analytic"] == analytic
    assert decode["compiled_over_analytic"] == pytest.approx(decode["flops_per_token"] / analytic)
    assert decode["collectives"]["all-to-all"] == 3 * 4  # experts are reached by all-to-all: 3 per MoE layer
    # compiled in pieces (each distinct layer once): the same collectives and FLOPs as the whole step
    whole = _whole_step("tiny", MeshSpec(dp=2, ep=2), batch=2, max_len=64)
    assert decode["programs_compiled"] < 1 + 4 and decode["collectives"] == whole["collectives"]
    assert decode["flops_per_token"] == pytest.approx(whole["flops"] * 2 / 2, rel=1e-2)
    pytest.importorskip("matplotlib")
    from sharding.study import chart

    chart(reports, str(tmp_path / "memory.png"))
    assert (tmp_path / "memory.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_inputs():
    with pytest.raises(MeshSpecError, match="unknown mesh axis"):
        MeshSpec.parse("tp=2")
    with pytest.raises(MeshSpecError, match="must divide"):
        MeshSpec.parse("dp=4,ep=8")
    with pytest.raises(ValueError, match="unknown device"):
        device_profile("tpu9")
    assert MeshSpec.parse("ep=8") == MeshSpec(dp=8, ep=8)


def test_checkpoint_config_is_studied():
    bundled = str(Path(__file__).resolve().parent.parent / "model" / "bundled")
    report = study(bundled, MeshSpec(dp=2), StudyOptions(compile_steps=()))
    assert report["devices"] == 2 and report["kv_bytes_per_token_global"] == kv_figures(load_config(bundled))[
        "kv_bytes_per_token_global"] > 0
