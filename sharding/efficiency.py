"""What fraction of a device's peak each kind of op reaches, and what the MoE all-to-alls cost: the step-time
model's constants, each a cited public measurement, or a table measured on the device (`--calibration FILE`,
the JSON lines `jaxseek bench kernels --json` writes there).

Fractions are of the peak of the rate an op runs at (the FP8 or bf16 FLOP/s, the HBM bandwidth); all-to-all
fractions are of the scale-up link (inside one NVLink domain) or of the scale-out NIC (beyond it).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from pathlib import Path

from sharding.platform import DeviceProfile


@dataclasses.dataclass(frozen=True)
class Efficiency:
    """Fractions of peak compute (None: the op's FLOPs are not counted) and of HBM bandwidth one op class
    reaches, and where they come from."""

    compute: float | None
    memory: float
    source: str


@dataclasses.dataclass(frozen=True)
class AllToAll:
    """One DeepEP all-to-all: a latency intercept plus bytes over each path at a fraction of its bandwidth."""

    latency_s: float
    scale_up: float
    scale_out: float
    source: str


_DEEPGEMM = "DeepGEMM FP8 GEMM: 1,550 TFLOPS on H800, 0.78 of 1,979 (deepseek-ai/DeepGEMM README)"
_DERATE = "HBM derated to 0.8 by AIConfigurator and InferSim (alibaba/InferSim hardware/gpu.py)"
EFFICIENCY = {
    "dense_gemm": Efficiency(0.78, 0.8, f"{_DEEPGEMM}; {_DERATE}"),
    "expert_gemm": Efficiency(0.78, 0.8, f"{_DEEPGEMM} (its grouped GEMMs); {_DERATE}"),
    "attention": Efficiency(0.67, 0.9, "FlashMLA decode on H800: 660 TFLOPS of 989 bf16 and 3,000 GB/s of "
                                       "3.35 TB/s (deepseek-ai/FlashMLA README)"),
    "prefill_attention": Efficiency(0.64, 0.9, "FlashMLA sparse prefill: 1,450 TFLOPS on B200, 0.64 of 2,250 "
                                               "(deepseek-ai/FlashMLA README); memory as decode"),
    "indexer": Efficiency(0.78, 0.8, f"the index scores run as FP8 DeepGEMM kernels: {_DEEPGEMM}; {_DERATE}"),
    "lookup": Efficiency(None, 0.8, _DERATE),
}
# AIConfigurator adds a constant 3 us to every op it times (the kernel's fixed cost), docs/design
LAUNCH_S = 3e-6
_AIC_LL = "AIConfigurator's DeepEP low-latency fit on GB200 (docs/DEEPEP_LL_MODELING.md)"
ALL_TO_ALL = {  # mode -> direction -> figures; decode runs DeepEP's low-latency kernels, prefill its normal ones
    "low_latency": {
        "dispatch": AllToAll(15.9e-6, 634 / 900, 43 / 50,
                             f"{_AIC_LL}: t0 15.9 us, 634 GB/s of 900; DeepEP low-latency EP64 on CX7: 43 GB/s "
                             "of 50 (deepseek-ai/DeepEP docs/legacy.md)"),
        "combine": AllToAll(16.9e-6, 777 / 900, 46 / 50,
                            f"{_AIC_LL}: t0 16.9 us, 777 GB/s of 900; DeepEP low-latency EP64 on CX7: 46 GB/s of "
                            "50 (deepseek-ai/DeepEP docs/legacy.md)")},
    "normal": {
        "dispatch": AllToAll(15.9e-6, 726 / 900, 51 / 50,
                             f"DeepEP V2 on SM100 NVLink EP8: 726 GB/s of 900 (deepseek-ai/DeepEP README); V1 "
                             f"normal RDMA EP64: 51 GB/s of 50, local traffic counted (docs/legacy.md); t0 of "
                             f"{_AIC_LL}"),
        "combine": AllToAll(16.9e-6, 740 / 900, 50 / 50,
                            f"DeepEP V2 on SM100 NVLink EP8: 740 GB/s of 900; V1 normal RDMA EP64: 50 GB/s of 50; "
                            f"t0 of {_AIC_LL}")},
}

# `jaxseek bench kernels` cases -> (op class, fraction): each measured fraction replaces that default
CALIBRATED_CASES = {
    "sparse_attention_decode": ("attention", "memory"),
    "paged_sink_attention_decode": ("attention", "memory"),
    "paged_hca_attention_decode": ("attention", "memory"),
    "sparse_attention_prefill": ("prefill_attention", "compute"),
    "paged_index_scores_decode": ("indexer", "memory"),
    "routed_experts_decode": ("expert_gemm", "memory"),
    "routed_experts_prefill": ("expert_gemm", "compute"),
}


class CalibrationError(ValueError):
    """A calibration file that cannot stand for the device studied."""


def calibrated(path: str, profile: DeviceProfile) -> dict[str, Efficiency]:
    """The efficiency table with the fractions that `path` (the JSON lines of `jaxseek bench kernels --json`
    run on a `profile` device) measured in place of the defaults; several cases of one fraction give their
    median. Raises CalibrationError naming what is wrong with the file."""
    file = Path(path)
    if not file.is_file():
        raise CalibrationError(f"--calibration {path}: no such file")
    rows = []
    for number, line in enumerate(file.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise CalibrationError(f"--calibration {path}: line {number} is not JSON ({e.msg}); expected the "
                                   "output of `jaxseek bench kernels --json`") from None
        if not isinstance(row, dict):
            raise CalibrationError(f"--calibration {path}: line {number} is not a JSON object")
        rows.append((number, row))
    summary = next((row for _, row in rows if row.get("summary")), None)
    if summary is None:
        raise CalibrationError(f"--calibration {path}: no summary line; expected the output of "
                               "`jaxseek bench kernels --json`")
    if summary.get("small"):
        raise CalibrationError(f"--calibration {path} is a --small run (scaled-down shapes, interpret mode): its "
                               "timings say nothing about a device")
    if summary.get("profile") != profile.name:
        raise CalibrationError(f"--calibration {path} was measured against the {summary.get('profile')!r} "
                               f"profile, not the studied device {profile.name!r}")
    measured: dict[tuple[str, str], list[float]] = {}
    for number, row in rows:
        if row.get("case") not in CALIBRATED_CASES:
            continue
        op, kind = CALIBRATED_CASES[row["case"]]
        key, peak = ("bytes_per_s", profile.hbm_bytes_per_s) if kind == "memory" else \
            ("flops_per_s", profile.bf16_flops)
        value = row.get(key)
        if not isinstance(value, (int, float)) or value <= 0:
            raise CalibrationError(f"--calibration {path}: line {number} ({row['case']}) has no positive {key}")
        if value > peak:
            raise CalibrationError(f"--calibration {path}: line {number} ({row['case']}) measured {value:.3g} "
                                   f"{key}, above {profile.name}'s peak {peak:.3g}")
        measured.setdefault((op, kind), []).append(value / peak)
    if not measured:
        raise CalibrationError(f"--calibration {path} has none of the cases the model reads "
                               f"({', '.join(CALIBRATED_CASES)})")
    table = dict(EFFICIENCY)
    for (op, kind), fractions in measured.items():
        table[op] = dataclasses.replace(table[op], **{kind: statistics.median(fractions)},
                                        source=f"{kind} measured ({path}); else {table[op].source}")
    return table
