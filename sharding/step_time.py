"""How long one device's decode and prefill steps take on a mesh: the layout study's time predictions.

Each op class (`sharding.efficiency`) takes max(FLOPs / (peak x compute fraction), bytes / (HBM bandwidth x
memory fraction)) plus a fixed cost per kernel; FLOPs and bytes come from `model.step_cost` with the weights in
their held format and the cache rows in their storage format. Every MoE layer adds DeepEP's dispatch (FP8 rows
with their scales) and combine (BF16 rows): a latency intercept plus the remote pairs' bytes over the scale-up
link (ranks of one NVLink domain) or the scale-out NIC (ranks beyond it), the slower path setting the time.
The hottest expert shard sets the expert GEMM and all-to-all time: the pairs it gets over the mean
(`routing_skew`). Speculation verifies k drafts a step and emits 1 + sum_i prod_{j<=i} p_j tokens; its drafter
costs DSpark's 3 layers at the drafted rows. Two-batch overlap runs two half batches, one's all-to-alls under
the other's compute. Prefill runs V4.1's bounded replay (layers after the last KV source over each prompt's
last `keep` tokens only) and, on a `cp` mesh, each prompt split over the cp ranks with the cache all-gathered.

Not counted: norms, activations and the other elementwise ops, sampling, host scheduling, the KV writes.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from model.replay import DEFAULT_KEEP
from model.step_cost import RowBytes, attention_parts, compressed_reads, weight_table
from sharding.efficiency import ALL_TO_ALL, EFFICIENCY, LAUNCH_S, Efficiency
from sharding.mesh import MeshSpec
from sharding.platform import DeviceProfile
from sharding.storage import KV_FORMATS, default_kv_format

DRAFTER_LAYERS = 3  # DSpark's production drafter: 3 MoE layers (DSpark paper section 5.1)
SKEW_ALPHA = 1.01  # AIConfigurator's power-law routing skew for DeepSeek (docs/DEEPEP_LL_MODELING.md)
SKEW_TRIALS = 4096  # its Monte Carlo trials, of which it takes the median
COMM = ("dispatch", "combine", "cp_all_gather")


@dataclasses.dataclass(frozen=True)
class Speculation:
    """Drafts verified per step and the acceptance rate of each draft position given the ones before it."""

    num_drafts: int = 0
    acceptance: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if self.num_drafts < 0:
            raise ValueError(f"--num-drafts must be >= 0, got {self.num_drafts}")
        if len(self.acceptance) != self.num_drafts:
            raise ValueError(f"--acceptance needs one rate per draft position ({self.num_drafts}), got "
                             f"{len(self.acceptance)}: {list(self.acceptance)}")
        bad = [p for p in self.acceptance if not 0 <= p <= 1]
        if bad:
            raise ValueError(f"--acceptance rates must lie in [0, 1], got {bad}")

    @property
    def emitted(self) -> float:
        """Expected tokens a step emits per request: the bonus token plus each draft accepted with all before it."""
        return 1 + float(np.sum(np.cumprod(self.acceptance))) if self.acceptance else 1.0


@dataclasses.dataclass(frozen=True)
class StepModel:
    """What a prediction assumes: the config, mesh and device, the held formats, EPLB's redundant slots, the
    efficiency table, two-batch overlap and the replay keep."""

    config: object
    spec: MeshSpec
    profile: DeviceProfile
    param_format: str = "checkpoint"
    kv_format: str | None = None
    redundant_experts: int = 0
    efficiency: dict[str, Efficiency] = dataclasses.field(default_factory=lambda: dict(EFFICIENCY))
    two_batch_overlap: bool = False
    replay_keep: int = DEFAULT_KEEP

    @property
    def rows(self) -> RowBytes:
        """Bytes of a stored window key, compressed entry and index key."""
        storage = KV_FORMATS[self.kv_format or default_kv_format(self.config)]
        if storage is None:
            return RowBytes.fp32(self.config)
        c = self.config
        return RowBytes(storage["window"].row_bytes(c.head_dim, c.qk_rope_head_dim),
                        storage["latent"].row_bytes(c.head_dim, c.qk_rope_head_dim),
                        storage["index_key"].row_bytes(c.index_head_dim, 0))


def routing_skew(experts: int, ep: int, pairs: float, balanced: bool, seed: int = 0) -> float:
    """Pairs the busiest of `ep` expert shards gets over the mean, the median of `SKEW_TRIALS` draws of
    `pairs` (token, expert) pairs: expert popularity falls as a power law of its rank (`SKEW_ALPHA`) and the
    experts sit on shards in a random order; `balanced` (EPLB's redundant slots) makes every shard's expected
    load equal, leaving the sampling noise."""
    if ep == 1 or pairs <= 0:
        return 1.0
    rng = np.random.default_rng(seed)
    n = max(int(round(pairs)), 1)
    if balanced:
        counts = rng.multinomial(n, np.full(ep, 1 / ep), size=SKEW_TRIALS)
    else:
        popularity = np.arange(1, experts + 1, dtype=np.float64) ** -SKEW_ALPHA
        per_expert = rng.multinomial(n, popularity / popularity.sum(), size=SKEW_TRIALS)
        order = np.argsort(rng.random((SKEW_TRIALS, experts)), axis=1)
        counts = np.take_along_axis(per_expert, order, axis=1).reshape(SKEW_TRIALS, ep, -1).sum(-1)
    return float(np.median(counts.max(1) / (n / ep)))


def _op(eff: Efficiency, profile: DeviceProfile, flops_fp8: float, flops_bf16: float, nbytes: float,
        kernels: float) -> tuple[float, str]:
    """(seconds, "compute" or "memory") of one op class's work on `profile`."""
    compute = 0.0 if eff.compute is None else \
        (flops_fp8 / profile.fp8_flops + flops_bf16 / profile.bf16_flops) / eff.compute
    memory = nbytes / (profile.hbm_bytes_per_s * eff.memory)
    return max(compute, memory) + kernels * LAUNCH_S, "compute" if compute > memory else "memory"


def _all_to_all(model: StepModel, pairs: float, mode: str, layers: int) -> dict[str, float]:
    """Seconds of `layers` MoE layers' dispatch and combine when a device sends `pairs` pairs a layer."""
    c, spec, profile = model.config, model.spec, model.profile
    if spec.ep == 1 or layers == 0:
        return {"dispatch": 0.0, "combine": 0.0}
    h = c.hidden_size
    row = {"dispatch": h + 4 * h / 128 + 16, "combine": 2 * h}  # FP8 + fp32 scales per 128 + routing; BF16
    local = min(spec.ep, profile.scale_up_domain)
    near, far = pairs * (local - 1) / spec.ep, pairs * (spec.ep - local) / spec.ep
    out = {}
    for name, size in row.items():
        a2a = ALL_TO_ALL[mode][name]
        out[name] = layers * (a2a.latency_s + max(near * size / (profile.scale_up_bytes_per_s * a2a.scale_up),
                                                   far * size / (profile.scale_out_bytes_per_s * a2a.scale_out)))
    return out


def _weights(model: StepModel, layer_rows: np.ndarray, head_rows: float, tokens: float, mode: str
             ) -> tuple[dict[str, tuple[float, str]], dict[str, float]]:
    """(per op class (seconds, bound), all-to-all seconds) of the weights' products with `layer_rows` rows
    through each main layer (0: the layer is skipped), `head_rows` through the head, `tokens` looked up."""
    c, spec, profile, eff = model.config, model.spec, model.profile, model.efficiency
    t = weight_table(c, model.param_format)
    run = layer_rows > 0
    e, k = c.n_routed_experts, c.num_experts_per_tok
    slots = (e + model.redundant_experts) / spec.ep
    rows = float(layer_rows[run].max()) if run.any() else 0.0
    skew = routing_skew(e, spec.ep, rows * spec.ep * k, model.redundant_experts > 0)
    hit = 1 - (1 - k / e) ** (layer_rows * spec.ep)  # an expert some row of its EP group chose
    parts = {
        "dense_gemm": _op(eff["dense_gemm"], profile, float(layer_rows @ t.dense_flops_fp8) + head_rows * t.head_flops_fp8,
                          float(layer_rows @ t.dense_flops_bf16) + head_rows * t.head_flops_bf16,
                          float(t.dense_bytes[run].sum()) + t.head_bytes,
                          float(t.dense_matrices[run].sum()) + t.head_matrices),
        # the FP4 experts multiply FP8 activations, at the FP8 rate; gate-up and down: 2 grouped GEMMs a layer
        "expert_gemm": _op(eff["expert_gemm"], profile, skew * float(layer_rows @ t.expert_flops), 0.0,
                           float(np.sum(hit * t.expert_bytes)) * min(slots, e), 2 * int(run.sum())),
        "lookup": _op(eff["lookup"], profile, 0.0, 0.0, tokens * t.lookup_bytes_per_token, 0),
    }
    return parts, _all_to_all(model, skew * rows * k, mode, int(run.sum()))


def _attention(model: StepModel, positions: np.ndarray, layers: range, queries: float, prefill: bool
               ) -> dict[str, tuple[float, str]]:
    """Seconds of `layers`' attention and index scoring for `queries` queries at each of `positions`."""
    parts = attention_parts(model.config, positions, layers, model.rows)
    kernels = {"attention": len(layers),
               "indexer": sum(1 for layer in layers if compressed_reads(model.config, layer, positions[-1])[1])}
    name = "prefill_attention" if prefill else "attention"
    return {part: _op(model.efficiency[name if part == "attention" else "indexer"], model.profile, 0.0,
                      queries * parts[part]["flops"], queries * parts[part]["bytes"], kernels[part])
            for part in ("attention", "indexer")}


def _step(parts: dict[str, tuple[float, str]], comm: dict[str, float]) -> tuple[float, str, dict[str, float]]:
    """(seconds, what bounds it, seconds per part) of a step's parts run one after another."""
    seconds = {name: s for name, (s, _) in parts.items()} | comm
    by_bound = {"compute": 0.0, "memory": 0.0, "communication": sum(comm.values())}
    for s, bound in parts.values():
        by_bound[bound] += s
    return sum(seconds.values()), max(by_bound, key=by_bound.get), seconds


def _decode_parts(model: StepModel, rows: float, context: int, positions: int
                  ) -> tuple[dict[str, tuple[float, str]], dict[str, float]]:
    """Op classes and all-to-alls of a decode (or verify) step of `rows` rows a device, each query at
    `positions` consecutive positions from `context`."""
    c = model.config
    parts, comm = _weights(model, np.full(c.num_hidden_layers, rows), rows, rows, "low_latency")
    parts |= _attention(model, np.arange(context, context + positions), range(c.num_hidden_layers),
                        rows / positions, prefill=False)
    return parts, comm


def decode(model: StepModel, batch: int, context: int, speculation: Speculation = Speculation()) -> dict:
    """The decode step of `batch` requests a device at `context` tokens: its seconds, TPOT, tokens/s per device
    and per user, what bounds it and the seconds of each part."""
    if model.spec.cp > 1:
        raise ValueError(f"decode is predicted on cp=1 meshes only (the engine decodes without context "
                         f"parallelism); {model.spec} has cp={model.spec.cp}")
    k = speculation.num_drafts

    def timed(rows: float, positions: int) -> tuple[float, str, dict[str, float]]:
        if not model.two_batch_overlap:
            return _step(*_decode_parts(model, rows, context, positions))
        parts, comm = _decode_parts(model, rows / 2, context, positions)
        _, bound, seconds = _step(parts, comm)
        work, talk = sum(s for s, _ in parts.values()), sum(comm.values())
        return 2 * max(work, talk), bound, {name: 2 * s for name, s in seconds.items()}

    step, bound, seconds = timed(batch * (1 + k), 1 + k)
    if k:
        draft, _, _ = timed(batch * k, k)
        seconds["drafter"] = draft * DRAFTER_LAYERS / model.config.num_hidden_layers
        step += seconds["drafter"]
    tpot = step / speculation.emitted
    return {"batch_per_device": batch, "context": context, "step_s": step, "tpot_s": tpot,
            "tok_s_per_device": batch / tpot, "tok_s_per_user": 1 / tpot, "bound": bound,
            "emitted_per_step": speculation.emitted, "parts_s": seconds}


def prefill(model: StepModel, tokens: int, prompt: int | None = None) -> dict:
    """The prefill step of `tokens` prompt tokens a device (prompts of `prompt` tokens, default one prompt of
    `tokens` x cp over the cp ranks): its seconds, tokens/s per device, bound and parts."""
    c, cp = model.config, model.spec.cp
    prompt = prompt or tokens * cp
    if prompt > tokens * cp:
        raise ValueError(f"a prompt of {prompt} tokens does not fit {tokens} tokens on each of {cp} cp rank(s)")
    prompts = tokens * cp / prompt  # per cp group, each split over its cp ranks
    split = getattr(c, "n_prefill_layer", c.num_hidden_layers)
    keep = min(model.replay_keep, prompt)
    layer_rows = np.array([tokens if layer < split else prompts * keep / cp for layer in range(c.num_hidden_layers)])
    parts, comm = _weights(model, layer_rows, prompts / cp, tokens, "normal")
    full = _attention(model, np.arange(prompt), range(split), prompts / cp, prefill=True)
    tail = _attention(model, np.arange(prompt - keep, prompt), range(split, c.num_hidden_layers), prompts / cp,
                      prefill=True)
    parts |= {name: (full[name][0] + tail[name][0], full[name][1]) for name in full}
    if cp > 1:  # each rank gathers the other ranks' compressed entries and index keys of every layer it runs
        rows = model.rows
        pool = sum(prompt // r * (rows.latent + rows.index_key) for r in c.compress_ratios[:split] if r)
        a2a = ALL_TO_ALL["normal"]["combine"]
        comm["cp_all_gather"] = prompts * pool * (cp - 1) / cp / (model.profile.scale_up_bytes_per_s * a2a.scale_up)
    step, bound, seconds = _step(parts, comm)
    return {"tokens_per_device": tokens, "prompt_tokens": prompt, "step_s": step, "tok_s_per_device": tokens / step,
            "bound": bound, "parts_s": seconds}


def front(points: list[dict]) -> list[dict]:
    """The points no other point beats on both tokens/s per device and tokens/s per user, fastest user first."""
    best = []
    for p in sorted(points, key=lambda p: (-p["tok_s_per_user"], -p["tok_s_per_device"])):
        if not best or p["tok_s_per_device"] > best[-1]["tok_s_per_device"]:
            best.append(p)
    return best


def best_under_tpot(candidates: list[tuple[str, dict]], target_s: float) -> dict | None:
    """Of (mesh, decode point) candidates, the one with the most tokens/s per device whose TPOT meets
    `target_s` and whose KV fits (None when none does)."""
    ok = [(mesh, p) for mesh, p in candidates if p["tpot_s"] <= target_s and p.get("kv_fits", True)]
    if not ok:
        return None
    mesh, p = max(ok, key=lambda mp: mp[1]["tok_s_per_device"])
    return {"mesh": mesh, **{k: p[k] for k in ("batch_per_device", "tpot_s", "tok_s_per_device", "tok_s_per_user")}}
