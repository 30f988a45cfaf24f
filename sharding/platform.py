"""Where the model runs (`--device cpu|cuda|ascend`), what kernels that means, and device profiles.

`setup(device, pjrt_plugin)` selects the JAX platform before any array is made: `cuda` needs the `cuda13`
extra (`jax[cuda13]`), reports the compute capability (SM90 / SM100 kernel variants) and refuses cuBLAS older
than 13.2 on compute capability 10.x-11.x (the CUDA plugin warns those versions can free tensor memory twice
under concurrent streams: silent corruption). `ascend` registers a PJRT plugin through jax's plugin
registration, from a shared library path or a Python module with the `initialize()` of the `jax_plugins`
convention (`--pjrt-plugin` or `$JAXSEEK_PJRT_PLUGIN`), and runs the reference kernels (Pallas has no Ascend
lowering). Device profiles feed the cost models and the kernel microbenchmark's fraction of peak.
"""

import dataclasses
import importlib
import importlib.util
import os

import jax

from pallas_kernels.tuning import compute_capability

DEVICES = ("cpu", "cuda", "ascend")
PLUGIN_ENV = "JAXSEEK_PJRT_PLUGIN"
MIN_CUBLAS_SM100 = 130200  # cuBLAS 13.2.0, as cublasGetVersion encodes it


class PlatformError(RuntimeError):
    """The requested device cannot be used as asked (missing plugin or library, unsafe library version)."""


@dataclasses.dataclass(frozen=True)
class DeviceProfile:
    """Peak figures of one accelerator (dense, per chip, bandwidths one direction) for cost models: HBM, the
    dense bf16 and FP8 rates, the scale-up link (NVLink) among the `scale_up_domain` chips of one domain and
    the scale-out NIC beyond it. `source` names where each figure comes from."""

    name: str
    hbm_bytes: float
    hbm_bytes_per_s: float
    bf16_flops: float
    fp8_flops: float
    interconnect: str
    scale_up_bytes_per_s: float
    scale_up_domain: int
    scale_out_bytes_per_s: float
    source: str


G, T, P = 1e9, 1e12, 1e15
_AIC = "ai-dynamo/aiconfigurator src/aiconfigurator/systems/"
PROFILES = {profile.name: profile for profile in (
    DeviceProfile("H800", 80 * G, 3.35 * T, 989 * T, 1979 * T, "NVLink 4 (export)", 200 * G, 8, 50 * G,
                  f"{_AIC}h800_sxm.yaml; NVLink 200 GB/s a direction, ConnectX-7 400 Gb/s per GPU"),
    DeviceProfile("H100", 80 * G, 3.35 * T, 989 * T, 1979 * T, "NVLink 4", 450 * G, 8, 50 * G,
                  f"{_AIC}h100_sxm.yaml; ConnectX-7 400 Gb/s per GPU"),
    DeviceProfile("H200", 141 * G, 4.8 * T, 989 * T, 1979 * T, "NVLink 4", 450 * G, 8, 50 * G,
                  "NVIDIA H200 SXM datasheet, dense = half the sparse figure; "
                  f"{_AIC}h200_sxm.yaml for the links (ConnectX-7 400 Gb/s per GPU)"),
    DeviceProfile("B200", 180 * G, 8.0 * T, 2.25 * P, 4.5 * P, "NVLink 5", 900 * G, 8, 50 * G,
                  "NVIDIA HGX B200 datasheet per GPU, dense = half the sparse figure; NVLink 5 inside the "
                  "8-GPU board; ConnectX-7 400 Gb/s per GPU, as many B200 fleets run (SemiAnalysis "
                  "InferenceMAX; AIConfigurator's b200_sxm.yaml assumes ConnectX-8, 100 GB/s)"),
    DeviceProfile("B300", 288 * G, 7.75 * T, 2.25 * P, 4.5 * P, "NVLink 5", 900 * G, 8, 100 * G,
                  f"{_AIC}b300_sxm.yaml; ConnectX-8 800 Gb/s per GPU"),
    DeviceProfile("GB200", 186 * G, 8.0 * T, 2.5 * P, 5.0 * P, "NVLink 5 (NVL72)", 900 * G, 72, 100 * G,
                  f"{_AIC}gb200.yaml: one NVLink domain of 72 GPUs, 100 GB/s per GPU between racks"),
    DeviceProfile("GB300", 288 * G, 8.0 * T, 2.5 * P, 5.0 * P, "NVLink 5 (NVL72)", 900 * G, 72, 100 * G,
                  "NVIDIA GB300 NVL72 datasheet per GPU, dense = half the sparse figure; "
                  f"{_AIC}gb300.yaml for the links (ConnectX-8, 72 NICs a rack)"),
    DeviceProfile("Ascend 950", 144 * G, 4.0 * T, 0.5 * P, 1.0 * P, "Lingqu", 1.0 * T, 8192, 1.0 * T,
                  "Huawei Connect 2025 roadmap (secondary coverage), 950DT (HiZQ 2.0): FP8 1 PFLOPS, "
                  "interconnect 2 TB/s (taken as both directions), bf16 assumed half of FP8 (not "
                  "published); the Atlas 950 SuperPoD's Lingqu fabric joins 8,192 chips, so no separate "
                  "scale-out figure"),
)}
_KIND_TO_PROFILE = (("GB300", "GB300"), ("GB200", "GB200"), ("B300", "B300"), ("B200", "B200"),
                    ("H200", "H200"), ("H100", "H100"), ("H800", "H800"))


@dataclasses.dataclass(frozen=True)
class Platform:
    device: str                  # cpu | cuda | ascend
    backend: str                 # the JAX platform name selected
    compute_capability: tuple[int, int] | None
    kernels: str                 # the registry's default on this platform
    profile: DeviceProfile | None


def setup(device: str = "cpu", pjrt_plugin: str | None = None) -> Platform:
    """Select `device` for this process (call before any JAX computation) and describe it."""
    if device not in DEVICES:
        raise PlatformError(f"--device must be one of {DEVICES}, got {device!r}")
    if device == "cuda":
        return _setup_cuda()
    if device == "ascend":
        return _setup_ascend(pjrt_plugin or os.environ.get(PLUGIN_ENV))
    jax.config.update("jax_platforms", "cpu")
    return Platform("cpu", "cpu", None, "reference", None)


def profile_for(device_kind: str) -> DeviceProfile | None:
    """The profile whose chip `device_kind` (e.g. 'NVIDIA B200') names, if any."""
    for token, name in _KIND_TO_PROFILE:
        if token in device_kind:
            return PROFILES[name]
    return None


def check_cublas(capability: tuple[int, int], cublas_version: int | None) -> None:
    """Refuse cuBLAS < 13.2 on compute capability 10.x / 11.x (SM100-class)."""
    if 10 <= capability[0] < 12 and (cublas_version is None or cublas_version < MIN_CUBLAS_SM100):
        found = "an unknown version" if cublas_version is None else \
            f"{cublas_version // 10000}.{cublas_version // 100 % 100}"
        raise PlatformError(
            f"compute capability {capability[0]}.{capability[1]} needs cuBLAS >= 13.2, found {found}: cuBLAS "
            "12.8-13.1 can free tensor memory twice when kernels run on concurrent streams (silent data "
            "corruption). Install a newer nvidia-cublas wheel with the cuda13 extra.")


def _setup_cuda() -> Platform:
    if not _installed("jax_plugins.xla_cuda13"):
        raise PlatformError("--device cuda needs the CUDA 13 plugin: pip install 'jaxseek[cuda13]' "
                            "(which installs jax[cuda13])")
    jax.config.update("jax_platforms", "cuda")
    try:
        devices = jax.devices("cuda")
    except RuntimeError as e:
        raise PlatformError(f"--device cuda: no usable CUDA device ({e})") from None
    capability = compute_capability()
    from jax._src.lib import cuda_versions

    check_cublas(capability, None if cuda_versions is None else int(cuda_versions.cublas_get_version()))
    return Platform("cuda", "cuda", capability, "pallas", profile_for(devices[0].device_kind))


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # its parent package is missing
        return False


def _setup_ascend(plugin: str | None) -> Platform:
    if not plugin:
        raise PlatformError(f"--device ascend needs an Ascend PJRT plugin: pass --pjrt-plugin PATH (its shared "
                            f"library, or a Python module with initialize()) or set ${PLUGIN_ENV}")
    from jax._src import xla_bridge

    if plugin.endswith(".so") or os.sep in plugin:
        if not os.path.isfile(plugin):
            raise PlatformError(f"Ascend PJRT plugin library not found: {plugin} (from --pjrt-plugin or "
                                f"${PLUGIN_ENV})")
        try:
            xla_bridge.register_plugin("ascend", library_path=plugin)
        except Exception as e:  # noqa: BLE001 - any loader failure becomes one clear message
            raise PlatformError(f"could not load the Ascend PJRT plugin {plugin}: {e}") from None
    else:
        try:
            module = importlib.import_module(plugin)
        except ImportError as e:
            raise PlatformError(f"Ascend PJRT plugin module {plugin!r} cannot be imported: {e}") from None
        module.initialize()
    jax.config.update("jax_platforms", "ascend")
    try:
        jax.devices()
    except RuntimeError as e:
        raise PlatformError(f"the Ascend PJRT plugin {plugin} registered but gave no device: {e}") from None
    return Platform("ascend", "ascend", None, "reference", PROFILES["Ascend 950"])
