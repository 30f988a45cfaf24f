"""Platform selection: PJRT plugin registration (a fake Ascend plugin module), clear errors for missing
plugins and unsafe cuBLAS, device profiles, and the CLI's --device / --kernels flags."""

import json
import subprocess
import sys
import textwrap

import pytest

from jaxseek import cli
from sharding import platform

REPO = __import__("pathlib").Path(__file__).parent.parent


def test_fake_ascend_plugin_registers_and_is_selected(tmp_path):
    """A plugin module with the jax_plugins `initialize()` registers the `ascend` backend, which is selected;
    the registry then defaults to the reference kernels. (A fresh process: backends are process-global.)"""
    (tmp_path / "fake_ascend_plugin.py").write_text(textwrap.dedent("""
        from jax._src import xla_bridge

        def initialize():  # a real plugin registers its PJRT library; this one serves CPU devices as `ascend`
            xla_bridge.register_backend_factory("ascend", xla_bridge.make_cpu_client, priority=500,
                                                fail_quietly=False, experimental=True)
    """))
    script = textwrap.dedent("""
        import json, jax
        from jax._src import xla_bridge
        from model import registry
        from sharding.platform import setup

        p = setup("ascend", "fake_ascend_plugin")
        x = jax.numpy.arange(3.0).sum()
        print(json.dumps({"device": p.device, "kernels": p.kernels, "profile": p.profile.name,
                          "backends": sorted(xla_bridge.backends()), "platforms": jax.config.jax_platforms,
                          "registry": registry.implementation(), "sum": float(x)}))
    """)
    env = {"PYTHONPATH": f"{tmp_path}:{REPO}", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"device": "ascend", "kernels": "reference", "profile": "Ascend 950", "backends": ["ascend"],
                      "platforms": "ascend", "registry": "reference", "sum": 3.0}


def test_missing_ascend_library_is_a_clear_error(tmp_path, monkeypatch):
    missing = tmp_path / "libascend_pjrt.so"
    with pytest.raises(platform.PlatformError, match=f"Ascend PJRT plugin library not found: {missing}"):
        platform.setup("ascend", str(missing))
    monkeypatch.setenv(platform.PLUGIN_ENV, str(missing))
    with pytest.raises(platform.PlatformError, match="library not found"):
        platform.setup("ascend")
    monkeypatch.delenv(platform.PLUGIN_ENV)
    with pytest.raises(platform.PlatformError, match="--pjrt-plugin PATH"):
        platform.setup("ascend")
    with pytest.raises(platform.PlatformError, match="cannot be imported"):
        platform.setup("ascend", "no_such_plugin_module")


def test_cuda_without_the_plugin_names_the_extra():
    if platform._installed("jax_plugins.xla_cuda13"):
        pytest.skip("the CUDA 13 plugin is installed here")
    with pytest.raises(platform.PlatformError, match=r"jaxseek\[cuda13\]"):
        platform.setup("cuda")


def test_old_cublas_is_refused_on_sm100_only():
    with pytest.raises(platform.PlatformError, match="needs cuBLAS >= 13.2, found 13.1"):
        platform.check_cublas((10, 0), 130100)
    with pytest.raises(platform.PlatformError, match="unknown version"):
        platform.check_cublas((10, 3), None)
    platform.check_cublas((10, 0), 130200)
    platform.check_cublas((9, 0), 120800)  # Hopper is not affected
    platform.check_cublas((12, 0), 120800)


def test_device_profiles():
    assert platform.profile_for("NVIDIA B200").name == "B200"
    assert platform.profile_for("NVIDIA GB300").name == "GB300"
    assert platform.profile_for("NVIDIA H200").name == "H200"
    assert platform.profile_for("NVIDIA A100-SXM4-80GB") is None
    for profile in platform.PROFILES.values():
        assert profile.hbm_bytes_per_s > 1e12 and profile.fp8_flops >= profile.bf16_flops > 1e14


def test_cli_flags_select_kernels_and_report_missing_plugins(capsys, monkeypatch):
    from model import registry

    monkeypatch.delenv(platform.PLUGIN_ENV, raising=False)
    assert cli.main(["forward", "--config", "tiny", "--device", "ascend", "--tokens", "1,2"]) == 2
    assert "--pjrt-plugin PATH" in capsys.readouterr().err
    try:
        assert cli.main(["forward", "--config", "tiny", "--kernels", "pallas", "--tokens", "1,2,3"]) == 0
        assert registry.implementation() == "pallas"
        assert json.loads(capsys.readouterr().out)["logits_shape"] == [1, 3, 256]
    finally:
        registry.set_implementation(None)
