"""Layout studies (`jaxseek study`): what one device of a mesh holds and does, before owning the hardware.

For a config, a mesh spec and a device profile the study builds the model abstractly (shapes only), places
its parameters by the rules of `sharding.mesh`, and reports per device: parameter bytes (backbone
replicated over attention ranks, routed experts split over `ep` with EPLB's redundant slots, Engram by
placement), KV bytes per token from the model's own cache structure in a storage format
(`sharding.storage`), the tokens of context that fit in what HBM is left, and, when compiled on emulated
CPU devices, the collectives of the decode and prefill steps, their FLOPs per token and temp memory, and the
decode step's compiled FLOPs against what the step needs (`model.step_cost`: every weight's matmul once, each
token's k experts, attention over the window, the top-k picks or the visible HCA entries, the index keys an
index source scores, at the compiled context).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import json
import math
import os
import re
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from model.axes import logical_axes
from model.checkpoint import WEIGHTS, layout_for
from model.step_cost import decode_step_cost
from sharding.expert_parallel import expert_parallel
from sharding.mesh import MeshSpec, MeshSpecError, batch_sharded, make_mesh, model_forward, param_shardings
from sharding.efficiency import EFFICIENCY, calibrated
from sharding.platform import PROFILES, DeviceProfile
from sharding.step_time import Speculation, StepModel, best_under_tpot, decode, front, prefill
from sharding.storage import KV_FORMATS, kv_figures, v32

DEVICE_ALIASES = {"sm90": "H200", "sm100": "B200", "sm103": "GB300", "ascend950": "Ascend 950",
                  "ascend": "Ascend 950"}
ENGRAM_PLACEMENTS = ("host", "device", "sharded")
ENGRAM_ROW_SCALE_BLOCK = 32  # FP8 rows with one UE8M0 scale per 32 channels (model.engram.SCALE_BLOCK)
COLLECTIVES = ("all-to-all", "ragged-all-to-all", "all-gather", "all-reduce", "reduce-scatter",
               "collective-permute")
STEPS = ("decode", "prefill")
# the context of the compiled and timed decode steps when --context is not given (and the most compiled):
# DeepInfer profiles its decode cost table at a synthetic 8,192-token context
STEP_CONTEXT = 8192


def device_profile(name: str) -> DeviceProfile:
    """A profile by name (`B200`) or alias (`sm100`, `h200`, `gb300`, `ascend950`), case-insensitively."""
    key = name.lower().replace(" ", "").replace("-", "")
    for profile_name in PROFILES:
        if profile_name.lower().replace(" ", "") == key:
            return PROFILES[profile_name]
    if key in DEVICE_ALIASES:
        return PROFILES[DEVICE_ALIASES[key]]
    raise ValueError(f"unknown device {name!r}; choose one of {sorted(PROFILES)} or {sorted(DEVICE_ALIASES)}")


@dataclasses.dataclass(frozen=True)
class StudyOptions:
    """What a study assumes beyond the config and mesh (the `jaxseek study` flags)."""

    device: str = "sm100"
    kv_format: str | None = None          # default: the config family's (sharding.storage)
    param_format: str = "checkpoint"
    redundant_experts: int = 0            # EPLB's extra physical expert slots per MoE layer
    engram: str = "sharded"               # Engram table placement: host | device | sharded
    hbm_utilization: float = 0.9          # fraction of HBM the engine may use
    sequences_per_device: int = 1         # concurrent requests each attention rank holds
    context: int | None = None            # context length the amortised KV per token refers to
    compile_steps: tuple[str, ...] = ("decode",)
    prefill_chunk: int = 512
    batch_per_device: tuple[int, ...] = ()       # decode batches to time (default: sequences_per_device)
    prefill_tokens_per_device: tuple[int, ...] = ()
    num_drafts: int = 0
    acceptance: tuple[float, ...] = ()
    tpot_target_ms: float | None = None
    calibration: str | None = None               # `jaxseek bench kernels --json` output measured on the device
    two_batch_overlap: bool = False

    def __post_init__(self) -> None:
        device_profile(self.device)
        Speculation(self.num_drafts, tuple(self.acceptance))
        for name in ("batch_per_device", "prefill_tokens_per_device"):
            bad = [v for v in getattr(self, name) if isinstance(v, bool) or not isinstance(v, int) or v < 1]
            if bad:
                raise ValueError(f"--{name.replace('_', '-')} values must be positive integers, got {bad}")
        if self.tpot_target_ms is not None and not self.tpot_target_ms > 0:
            raise ValueError(f"--tpot-target must be a positive number of milliseconds, got {self.tpot_target_ms}")
        if self.kv_format is not None and self.kv_format not in KV_FORMATS:
            raise ValueError(f"unknown KV format {self.kv_format!r}; choose one of {sorted(KV_FORMATS)}")
        if self.param_format not in WEIGHTS:
            raise ValueError(f"unknown parameter format {self.param_format!r}; choose one of {WEIGHTS}")
        if self.engram not in ENGRAM_PLACEMENTS:
            raise ValueError(f"Engram placement must be one of {ENGRAM_PLACEMENTS}, got {self.engram!r}")
        if not 0 < self.hbm_utilization <= 1:
            raise ValueError(f"hbm utilization must be in (0, 1], got {self.hbm_utilization}")
        for name in ("redundant_experts",):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("sequences_per_device", "prefill_chunk"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        bad = [s for s in self.compile_steps if s not in STEPS]
        if bad:
            raise ValueError(f"unknown steps to compile {bad}; choose from {STEPS}")


def parameter_bytes(model, config, spec: MeshSpec, options: StudyOptions) -> dict:
    """Per-device parameter bytes of `model` (abstract, in the format the engine would hold:
    `model.checkpoint.layout_for`): backbone (replicated), routed experts (their `ep` share of the physical
    slots, redundant ones included), Engram tables (by placement)."""
    n_experts = config.n_routed_experts
    slots = n_experts + options.redundant_experts
    if slots % spec.ep:
        raise MeshSpecError(f"{n_experts} experts + {options.redundant_experts} redundant slots do not divide "
                            f"over ep={spec.ep}; choose --redundant-experts so the sum is a multiple of {spec.ep}")
    backbone = experts = 0.0
    for _, var in nnx.to_flat_state(model.params):
        size = math.prod(var.shape) * np.dtype(var.dtype).itemsize
        if "expert" in logical_axes(var):
            experts += size * slots / n_experts / spec.ep
        else:
            backbone += size
    rows = sum(getattr(config, "engram_num_embeddings", ()))
    table = rows * config.engram_head_dim * (1 + 1 / ENGRAM_ROW_SCALE_BLOCK) if rows else 0.0
    share = {"host": 0.0, "device": 1.0, "sharded": 1 / spec.num_devices}[options.engram]
    return {"param_bytes_backbone_per_device": backbone,
            "param_bytes_experts_per_device": experts,
            "experts_per_device": slots // spec.ep,
            "param_bytes_engram_per_device": table * share,
            "engram_host_bytes": table if options.engram == "host" and rows else 0.0,
            "param_bytes_per_device": backbone + experts + table * share}


def _count_collectives(hlo: str) -> dict[str, int]:
    """Collective instructions in compiled HLO text, by kind (an instruction's type ends in `}` or `)`)."""
    return {op: len(re.findall(rf"[)}}] {op}(?:-start)?\(", hlo)) for op in COLLECTIVES}


def compile_steps(config_name: str, spec: MeshSpec, options: StudyOptions, max_len: int) -> dict:
    """Lower and compile the decode step (one token per sequence) and/or the prefill step (one chunk per
    sequence) on emulated CPU devices of `spec`; per step: collectives, FLOPs per token (of the compiled
    program: expert buckets are sized for the worst case, so it counts their padding), XLA:CPU temp bytes
    (indicative only: XLA:CPU computes bf16 dots in f32 and holds f32 copies of the weights; the HBM fit
    does not subtract it).

    A step is compiled in pieces (`step_programs`): each distinct layer once, and the program around the
    layers (embedding, head). The step's collectives and FLOPs are the pieces' sums weighted by how many
    layers each stands for (equal to one whole-step compile; tests/test_study.py checks it), its temp
    bytes the largest piece's. A process with too few devices (JAX fixes the count when it starts) compiles
    in a child process with `spec.num_devices` emulated CPU devices."""
    if len(jax.devices()) < spec.num_devices:
        return _compile_in_child(config_name, spec, options, max_len)
    config, model = _abstract(config_name)
    mesh = make_mesh(spec)
    params = _with_shardings(model.params, param_shardings(model.params, mesh))
    batch = spec.dp * options.sequences_per_device
    engram_ids = getattr(config, "engram_layer_ids", ())
    out = {}
    for step in options.compile_steps:
        chunk = 1 if step == "decode" else min(options.prefill_chunk, max_len)
        inputs = (jax.ShapeDtypeStruct((batch, chunk), jnp.int32),
                  jax.eval_shape(lambda: model.module().init_cache(batch, max_len)),
                  *[jax.ShapeDtypeStruct((batch, chunk, config.engram_lookups, config.engram_head_dim), jnp.float32)
                    for _ in engram_ids])
        start = time.perf_counter()
        with expert_parallel(mesh) if spec.ep > 1 else contextlib.nullcontext():
            programs = step_programs(model, mesh, params, _with_shardings(inputs, batch_sharded(mesh, inputs)))
            lowered = [traced.lower() for traced, _ in programs]
        with concurrent.futures.ThreadPoolExecutor(os.cpu_count()) as pool:  # XLA compiles without the GIL
            figures = list(pool.map(lambda low: _compiled_figures(low.compile()), lowered))
        layers = [n for _, n in programs]
        out[step] = {"tokens": batch * chunk,
                     "compile_s": round(time.perf_counter() - start, 2),
                     "programs_compiled": len(programs),
                     "collectives": {op: sum(f["collectives"][op] * n for f, n in zip(figures, layers))
                                     for op in COLLECTIVES},
                     "flops_per_token": sum(f["flops"] * n for f, n in zip(figures, layers))
                     * spec.num_devices / (batch * chunk),
                     "xla_cpu_temp_bytes_per_device": max(f["temp_bytes"] for f in figures)}
    return out


class _LayerRecorder(nnx.Module):
    """Stands in for one layer while a step is traced abstractly. The first layer of each kind (graph,
    abstract parameters and inputs) runs and is recorded in `kinds`; a later one of the same kind only
    counts and returns placeholders of the recorded output shapes."""

    def __init__(self, block, kinds: dict):
        self.block, self.kinds = block, kinds

    def __call__(self, *args):
        graphdef, state = nnx.split(self.block)
        state, shapes = _shapes(state), _shapes(args)
        leaves, treedef = jax.tree.flatten((state, shapes))
        key = (graphdef, treedef, tuple(leaves))
        if key in self.kinds:
            self.kinds[key]["layers"] += 1
            return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), self.kinds[key]["out"])
        out = self.block(*args)
        self.kinds[key] = {"graphdef": graphdef, "state": state, "args": shapes, "out": _shapes(out), "layers": 1}
        return out


def _shapes(tree):
    """Arrays (or tracers) of `tree` as ShapeDtypeStructs; other leaves (Python ints) unchanged."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if hasattr(x, "shape") else x, tree)


def step_programs(model, mesh, params, inputs: tuple) -> list[tuple]:
    """One step `(params, tokens, cache, *engram_rows)` as traced pieces with the number of layers each
    stands for: the step without its layers (embedding, stream set-up, head; 1), then each distinct layer
    on its own with its abstract inputs (batch-first arrays split over the attention ranks, parameters by
    the rules) and its count."""
    kinds: dict = {}
    jax.eval_shape(model_forward(model, layers=lambda blocks: [_LayerRecorder(b, kinds) for b in blocks]),
                   params, *inputs)
    traced = [(jax.jit(model_forward(model, layers=lambda blocks: []), donate_argnums=2).trace(params, *inputs), 1)]
    for kind in kinds.values():
        leaves, treedef = jax.tree.flatten(kind["args"])
        arrays = [i for i, leaf in enumerate(leaves) if isinstance(leaf, jax.ShapeDtypeStruct)]

        def layer(state, arrays_in, graphdef=kind["graphdef"], leaves=leaves, treedef=treedef, arrays=arrays):
            full = list(leaves)
            for i, value in zip(arrays, arrays_in):
                full[i] = value
            return nnx.merge(graphdef, state)(*jax.tree.unflatten(treedef, full))

        dynamic = [leaves[i] for i in arrays]
        state = _with_shardings(kind["state"], param_shardings(kind["state"], mesh))
        traced.append((jax.jit(layer).trace(state, _with_shardings(dynamic, batch_sharded(mesh, dynamic))),
                       kind["layers"]))
    return traced


def _compiled_figures(compiled) -> dict:
    """Collectives, FLOPs (per device) and temp bytes of one compiled program."""
    cost = compiled.cost_analysis() or {}
    return {"collectives": _count_collectives(compiled.as_text()), "flops": cost.get("flops", 0.0),
            "temp_bytes": float(compiled.memory_analysis().temp_size_in_bytes)}


def _with_shardings(shapes, shardings):
    return jax.tree.map(lambda leaf, s: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=s), shapes, shardings)


def _compile_in_child(config_name: str, spec: MeshSpec, options: StudyOptions, max_len: int) -> dict:
    """`compile_steps` in a fresh Python process with `spec.num_devices` emulated CPU devices."""
    request = {"config": config_name, "spec": dataclasses.asdict(spec), "options": dataclasses.asdict(options),
               "max_len": max_len}
    # the emulated program never runs: skip LLVM's optimisations (about a fifth of the compile time)
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0".strip()
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": str(spec.num_devices), "XLA_FLAGS": flags}
    done = subprocess.run([sys.executable, "-m", "sharding.study"], input=json.dumps(request), env=env,
                          capture_output=True, text=True, cwd=os.path.dirname(os.path.dirname(__file__)))
    if done.returncode:
        raise RuntimeError(f"compiling on {spec} emulated devices failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


@functools.lru_cache(maxsize=4)
def _abstract(config_name: str):
    """(config, abstract bf16 model) of a preset or a checkpoint's config.json, built once per process
    (comparisons reuse it)."""
    from model.api import abstract_model
    from model.config import load_config, preset

    config = load_config(config_name) if os.path.exists(config_name) else preset(config_name)
    return config, abstract_model(config, "bfloat16")


def study(config_name: str, spec: MeshSpec, options: StudyOptions) -> dict:
    """The per-device figures of one config on one mesh (see the module docstring)."""
    from model.stats import param_counts

    config, model = _abstract(config_name)
    profile = device_profile(options.device)
    kv = kv_figures(config, options.kv_format, model.module())
    context = options.context or config.max_position_embeddings
    if context > config.max_position_embeddings:
        raise ValueError(f"context {context} exceeds the model's {config.max_position_embeddings} positions")
    params = parameter_bytes(layout_for(config, options.param_format).model(config), config, spec, options)
    report = {"config": config_name, "mesh": str(spec), "devices": spec.num_devices, "device": profile.name,
              "hbm_bytes": profile.hbm_bytes, "param_format": options.param_format, **params,
              "redundant_experts": options.redundant_experts, "engram_placement": options.engram, **kv,
              "kv_bytes_per_token": kv["kv_bytes_per_token_global"] + kv["kv_fixed_bytes_per_sequence"] / context,
              "context": context,
              "kv_ratio_to_v32": kv["kv_bytes_per_token_global"]
              / kv_figures(v32())["kv_bytes_per_token_global"],
              "flops_per_token_params": 2 * param_counts(model, config)["active"]}
    compiled_len = min(context, STEP_CONTEXT)
    steps = compile_steps(config_name, spec, options, compiled_len) if options.compile_steps else {}
    if "decode" in steps:
        analytic = decode_step_cost(config, 1, compiled_len - 1)["flops"]
        steps["decode"].update(flops_per_token_analytic=analytic,
                               compiled_over_analytic=steps["decode"]["flops_per_token"] / analytic)
    usable = profile.hbm_bytes * options.hbm_utilization
    free = usable - params["param_bytes_per_device"] - kv["kv_fixed_bytes_per_sequence"] * options.sequences_per_device
    per_token = kv["kv_bytes_per_token_global"] / spec.cp  # CP ranks each store their chunks' entries
    report.update(steps=steps, hbm_usable_bytes=usable,
                  hbm_free_for_kv_bytes=max(free, 0.0),
                  context_tokens_fit_per_device=int(max(free, 0.0) // per_token) if per_token else None,
                  sequences_per_device=options.sequences_per_device)
    if free < 0:
        report["note"] = "the parameters exceed the usable HBM"
    report.update(_times(config, spec, options, profile, report))
    return report


def step_model(config, spec: MeshSpec, options: StudyOptions) -> StepModel:
    """The step-time model of `options` (device, formats, EPLB slots, calibration, overlap) on `spec`."""
    profile = device_profile(options.device)
    table = calibrated(options.calibration, profile) if options.calibration else dict(EFFICIENCY)
    return StepModel(config, spec, profile, options.param_format, options.kv_format, options.redundant_experts,
                     table, options.two_batch_overlap)


def _times(config, spec: MeshSpec, options: StudyOptions, profile: DeviceProfile, report: dict) -> dict:
    """The decode and prefill time predictions of a study (`sharding.step_time`), each decode point marked
    with whether its requests' KV fits beside the parameters."""
    model = step_model(config, spec, options)
    speculation = Speculation(options.num_drafts, tuple(options.acceptance))
    context = options.context or STEP_CONTEXT
    out: dict = {"decode": [], "prefill": []}
    if spec.cp == 1:
        room = report["hbm_usable_bytes"] - report["param_bytes_per_device"]
        per_request = context * report["kv_bytes_per_token_global"] + report["kv_fixed_bytes_per_sequence"]
        for batch in options.batch_per_device or (options.sequences_per_device,):
            point = decode(model, batch, context, speculation)
            out["decode"].append(point | {"kv_fits": batch * per_request <= room})
    for tokens in options.prefill_tokens_per_device:
        out["prefill"].append(prefill(model, tokens))
    return out


def compare(reports: list[dict], tpot_target_ms: float | None) -> dict:
    """Across studied meshes: the decode points on the throughput-latency front, and the best under a TPOT target."""
    points = [p | {"mesh": r["mesh"]} for r in reports for p in r["decode"] if p["kv_fits"]]
    out = {"front": [{k: p[k] for k in ("mesh", "batch_per_device", "tok_s_per_device", "tok_s_per_user")}
                     for p in front(points)]}
    if tpot_target_ms is not None:
        out["tpot_target_ms"] = tpot_target_ms
        out["best_under_tpot"] = best_under_tpot([(p["mesh"], p) for p in points], tpot_target_ms / 1e3)
    return out


def chart(reports: list[dict], path: str) -> None:
    """A PNG of memory per device for each studied mesh (stacked parameters and the KV that fits) and, when
    decode was timed, tokens/s per device against tokens/s per user, one curve per mesh."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("--chart needs matplotlib: pip install 'jaxseek[train]'") from None
    gib = 2 ** 30
    parts = (("backbone", "param_bytes_backbone_per_device"), ("experts", "param_bytes_experts_per_device"),
             ("Engram", "param_bytes_engram_per_device"), ("KV (fits)", "hbm_free_for_kv_bytes"))
    labels = [f"{r['config']}\n{r['mesh']}" for r in reports]
    timed = any(len(r.get("decode", ())) > 1 for r in reports)
    fig, axes = plt.subplots(1, 2 if timed else 1, figsize=(3 + 1.6 * len(reports) + (5 if timed else 0), 4.5),
                             squeeze=False)
    ax = axes[0][0]
    bottom = [0.0] * len(reports)
    for name, key in parts:
        values = [r[key] / gib for r in reports]
        ax.bar(labels, values, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, values)]
    for i, r in enumerate(reports):
        ax.hlines(r["hbm_bytes"] / gib, i - 0.4, i + 0.4, colors="black", linestyles="dashed")
    ax.set_ylabel("GiB per device")
    ax.set_title(f"memory per device ({reports[0]['device']}; dashed: HBM)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1, 1))
    if timed:
        ax = axes[0][1]
        for r in reports:
            points = sorted(r["decode"], key=lambda p: p["tok_s_per_user"])
            ax.plot([p["tok_s_per_user"] for p in points], [p["tok_s_per_device"] for p in points], "o-",
                    label=r["mesh"])
            for p in points:
                ax.annotate(str(p["batch_per_device"]), (p["tok_s_per_user"], p["tok_s_per_device"]), fontsize=7)
        ax.set_xlabel("tokens/s per user")
        ax.set_ylabel("tokens/s per device")
        ax.set_title("decode (labels: requests per device)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _human(value: float) -> str:
    for unit, size in (("TiB", 2 ** 40), ("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if abs(value) >= size:
            return f"{value / size:.2f} {unit}"
    return f"{value:.1f} B"


def print_table(reports: list[dict], out=None, comparison: dict | None = None) -> None:
    """The main figures, one column per studied mesh, then the timed decode and prefill steps and, across
    meshes, the throughput-latency front and the best layout under the TPOT target (`out`: a text stream,
    the current `sys.stdout` when None)."""
    out = sys.stdout if out is None else out
    rows = (("mesh", "mesh", str), ("devices", "devices", str), ("device", "device", str),
            ("params / device", "param_bytes_per_device", _human),
            ("  backbone", "param_bytes_backbone_per_device", _human),
            ("  experts", "param_bytes_experts_per_device", _human),
            ("  experts (slots)", "experts_per_device", str),
            ("  Engram", "param_bytes_engram_per_device", _human),
            ("KV global / token", "kv_bytes_per_token_global", lambda v: f"{v:,.1f} B"),
            ("KV SWA / window token", "kv_bytes_per_token_swa", lambda v: f"{v:,.0f} B"),
            ("KV fixed / sequence", "kv_fixed_bytes_per_sequence", _human),
            ("KV vs V3.2", "kv_ratio_to_v32", lambda v: f"{100 * v:.1f}%"),
            ("context tokens fit", "context_tokens_fit_per_device", lambda v: f"{v:,}" if v is not None else "-"),
            ("FLOPs / token (params)", "flops_per_token_params", lambda v: f"{v / 1e9:.1f} G"))
    for label, key, fmt in rows:
        print(f"{label:>24}: " + " | ".join(f"{fmt(r[key]):>16}" for r in reports), file=out)
    for r in reports:
        for step, figures in r["steps"].items():
            used = {k: v for k, v in figures["collectives"].items() if v}
            analytic = (f" ({figures['compiled_over_analytic']:.2f}x the {figures['flops_per_token_analytic'] / 1e9:.1f}"
                        " needed)" if "flops_per_token_analytic" in figures else "")
            print(f"{r['mesh']:>16} {step:>7}: {figures['flops_per_token'] / 1e9:.1f} GFLOP/token compiled{analytic}, "
                  f"collectives {used or 'none'}, XLA:CPU temp {_human(figures['xla_cpu_temp_bytes_per_device'])}, "
                  f"compile {figures['compile_s']} s ({figures['programs_compiled']} programs)", file=out)
    _print_times(reports, out, comparison)


def _print_times(reports: list[dict], out, comparison: dict | None) -> None:
    """The time predictions as tables (one row per mesh and batch or token count)."""
    if any(r["decode"] for r in reports):
        print(f"\n{'mesh':>16} {'batch':>6} {'step':>10} {'TPOT':>10} {'tok/s/device':>13} {'tok/s/user':>11} "
              f"{'bound':>13} {'KV fits':>7}  largest parts", file=out)
        for r in reports:
            for p in r["decode"]:
                print(f"{r['mesh']:>16} {p['batch_per_device']:>6} {p['step_s'] * 1e3:>7.2f} ms "
                      f"{p['tpot_s'] * 1e3:>7.2f} ms {p['tok_s_per_device']:>13,.0f} {p['tok_s_per_user']:>11,.1f} "
                      f"{p['bound']:>13} {'yes' if p['kv_fits'] else 'no':>7}  {_largest(p['parts_s'])}", file=out)
    if any(r["prefill"] for r in reports):
        print(f"\n{'mesh':>16} {'tokens':>8} {'step':>10} {'tok/s/device':>13} {'bound':>13}  largest parts",
              file=out)
        for r in reports:
            for p in r["prefill"]:
                print(f"{r['mesh']:>16} {p['tokens_per_device']:>8} {p['step_s'] * 1e3:>7.1f} ms "
                      f"{p['tok_s_per_device']:>13,.0f} {p['bound']:>13}  {_largest(p['parts_s'])}", file=out)
    if comparison and comparison["front"]:
        print("\nfront (tok/s/user -> tok/s/device): " + ", ".join(
            f"{p['mesh']} x{p['batch_per_device']}: {p['tok_s_per_user']:,.0f} -> {p['tok_s_per_device']:,.0f}"
            for p in comparison["front"]), file=out)
    if comparison and "best_under_tpot" in comparison:
        best = comparison["best_under_tpot"]
        print(f"best under TPOT {comparison['tpot_target_ms']} ms: " + (
            "none of the candidates meets it" if best is None else
            f"{best['mesh']} at {best['batch_per_device']} per device, TPOT {best['tpot_s'] * 1e3:.2f} ms, "
            f"{best['tok_s_per_device']:,.0f} tok/s/device"), file=out)


def _largest(parts: dict[str, float], n: int = 3) -> str:
    return ", ".join(f"{name} {s * 1e3:.2f}" for name, s in sorted(parts.items(), key=lambda kv: -kv[1])[:n])


def add_arguments(p) -> None:
    """The `jaxseek study` flags."""
    p.add_argument("--config", default="v41-flash", help="preset (tiny, small, v4-flash, v4-pro, tiny-v41, "
                   "v41-flash) or a checkpoint directory / config.json")
    p.add_argument("--mesh", action="append", metavar="SPEC",
                   help="role sizes like dp=64,ep=64 (ep shards inside dp; cp multiplies the devices); repeat "
                        "to compare meshes (default dp=64,ep=64)")
    p.add_argument("--device", default="sm100", help=f"device profile: {', '.join(PROFILES)} or an alias "
                   f"({', '.join(DEVICE_ALIASES)})")
    p.add_argument("--kv-format", choices=sorted(KV_FORMATS), help="cache storage (default: v41 for V4.1, v4 "
                   "otherwise: FP8 entries with BF16 RoPE dims, FP4 index keys)")
    p.add_argument("--param-format", choices=WEIGHTS, default="checkpoint",
                   help="weights as the engine would hold them (`load_model(weights=...)`); checkpoint: FP8 "
                        "linears and FP4 experts as DeepSeek ships them, BF16 elsewhere (default)")
    p.add_argument("--redundant-experts", type=int, default=0, metavar="N",
                   help="EPLB redundant expert slots per MoE layer (experts + N must divide by ep)")
    p.add_argument("--engram", choices=ENGRAM_PLACEMENTS, default="sharded",
                   help="Engram table placement (default: rows sharded over every device)")
    p.add_argument("--hbm-utilization", type=float, default=0.9,
                   help="fraction of HBM the engine may use (default 0.9)")
    p.add_argument("--sequences-per-device", type=int, default=1,
                   help="concurrent requests per attention rank: each holds its windows and open compressor "
                        "state (default 1)")
    p.add_argument("--context", type=int, help="context length for the amortised KV per token (default: the "
                   "model's maximum)")
    p.add_argument("--compile", default="decode", metavar="STEPS",
                   help="steps to compile on emulated CPU devices: decode, prefill, decode,prefill or none "
                        "(default decode; each distinct layer compiles once)")
    p.add_argument("--prefill-chunk", type=int, default=512, help="tokens per sequence of the compiled prefill "
                   "step (default 512)")
    p.add_argument("--batch-per-device", type=_ints, default=(), metavar="B[,B...]",
                   help="decode batches (requests per attention rank) to time (default: --sequences-per-device)")
    p.add_argument("--prefill-tokens-per-device", type=_ints, default=(), metavar="T[,T...]",
                   help="prefill steps to time: prompt tokens per device (one prompt over the cp ranks)")
    p.add_argument("--num-drafts", type=int, default=0, help="speculative drafts verified per decode step (0)")
    p.add_argument("--acceptance", type=_floats, default=(), metavar="P[,P...]",
                   help="acceptance rate of each draft position given the ones before it (one per draft)")
    p.add_argument("--tpot-target", type=float, metavar="MS", help="pick the mesh and batch with the most "
                   "tokens/s per device whose time per output token meets MS milliseconds")
    p.add_argument("--calibration", metavar="FILE", help="efficiencies measured on the device: the output of "
                   "`jaxseek bench kernels --json` there (default: the cited public measurements)")
    p.add_argument("--two-batch-overlap", action="store_true", help="time decode as two half batches, one's "
                   "all-to-alls under the other's compute")
    p.add_argument("--chart", metavar="PNG", help="write a chart of memory per device and, with several "
                   "decode batches, tokens/s per device against tokens/s per user (needs matplotlib)")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout ({'studies': [...]} when "
                   "comparing meshes)")


def _ints(text: str) -> tuple[int, ...]:
    """A comma-separated list of positive integers (an argparse type)."""
    import argparse

    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"values must be positive, got {text!r}")
    return values


def _floats(text: str) -> tuple[float, ...]:
    """A comma-separated list of numbers (an argparse type)."""
    import argparse

    try:
        return tuple(float(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def run(args) -> int:
    """`jaxseek study`: one report per mesh, as a table or JSON, and optionally a chart."""
    specs = [MeshSpec.parse(text) for text in (args.mesh or ["dp=64,ep=64"])]
    steps = () if args.compile == "none" else tuple(s.strip() for s in args.compile.split(",") if s.strip())
    options = StudyOptions(device=args.device, kv_format=args.kv_format, param_format=args.param_format,
                           redundant_experts=args.redundant_experts, engram=args.engram,
                           hbm_utilization=args.hbm_utilization, sequences_per_device=args.sequences_per_device,
                           context=args.context, compile_steps=steps, prefill_chunk=args.prefill_chunk,
                           batch_per_device=args.batch_per_device,
                           prefill_tokens_per_device=args.prefill_tokens_per_device, num_drafts=args.num_drafts,
                           acceptance=args.acceptance, tpot_target_ms=args.tpot_target,
                           calibration=args.calibration, two_batch_overlap=args.two_batch_overlap)
    reports = [study(args.config, spec, options) for spec in specs]
    comparison = compare(reports, args.tpot_target)
    if args.chart:
        chart(reports, args.chart)
    if args.json:
        print(json.dumps(reports[0] | comparison if len(reports) == 1 else {"studies": reports, **comparison}))
    else:
        print_table(reports, comparison=comparison)
    return 0



if __name__ == "__main__":  # the child process of _compile_in_child: JSON request on stdin, JSON figures out
    _request = json.loads(sys.stdin.read())
    _options = _request["options"]
    _options["compile_steps"] = tuple(_options["compile_steps"])
    print(json.dumps(compile_steps(_request["config"], MeshSpec(**_request["spec"]), StudyOptions(**_options),
                                   _request["max_len"])))
