"""Device meshes from specs like `dp=8,ep=4`, the one logical-axis rules table, and sharded parameters.

A spec names the size of each parallel role over the same devices (the SGLang / DeepInfer convention):
`dp` attention data-parallel ranks (requests), `cp` context-parallel ranks (long prefill, zigzag split),
`ep` expert shards. Devices = dp x cp; `ep` divides `dp` (expert shards sit inside one context rank's
data-parallel group and are replicated dp/ep times), so `dp=64,ep=64` is DeepInfer's DEP64: 64 devices, each
an attention rank holding 1/64 of the experts. The mesh has three axes `cp`, `dp`, `ep` of sizes
cp, dp/ep, ep: attention's batch is sharded over (`dp`, `ep`) together, experts over `ep` alone.

Every array carries logical axis names: a parameter in the NNX metadata the model gives it where it creates
it (`model.axes.param`), a cache or batch leaf by its layout (`model.axes.batch_axes`; an engine cache's pages
by `serving.base.kv_cache.EngineCache.axes`), an Engram table by `EngramTable.axes`. `RULES`, the one table, maps them
to mesh axes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re

import jax
import numpy as np
from flax import nnx
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from model.axes import batch_axes, logical_axes

class MeshSpecError(ValueError):
    """A mesh spec that names unknown axes, bad sizes, or a layout the devices cannot hold."""


AXES = ("cp", "dp", "ep")  # physical mesh axes, outermost first

# logical axis (model.axes names them) -> mesh axes, () replicated; one table for parameters, caches, activations
RULES: dict[str, tuple[str, ...]] = {
    "batch": ("dp", "ep"),           # requests: attention data parallel over every rank of a context group
    "pages": ("dp", "ep"),           # an engine's page pool: each attention rank owns a range of pages
    "seq": ("cp",),                  # sequence chunks of a long prefill (zigzag)
    "expert": ("ep",),               # routed experts (physical slots when EPLB adds replicas)
    "table_rows": ("cp", "dp", "ep"),  # Engram table rows: each device owns a contiguous range
    **dict.fromkeys(("vocab", "embed", "mlp", "out", "in", "router", "topk", "replica", "heads", "norm",
                     "window", "hc", "hc_scale"), ()),  # the backbone: replicated over every rank
}


@dataclasses.dataclass(frozen=True)
class MeshSpec:
    """Role sizes: `dp` attention data-parallel ranks, `cp` context-parallel ranks, `ep` expert shards."""

    dp: int = 1
    cp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for name in ("dp", "cp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise MeshSpecError(f"mesh axis {name} must be a positive integer, got {value!r}")
        if self.dp % self.ep:
            raise MeshSpecError(f"ep={self.ep} must divide dp={self.dp}: expert shards live inside one context "
                                f"rank's data-parallel group (e.g. dp=64,ep=64 or dp=8,ep=4)")

    @classmethod
    def parse(cls, text: str) -> MeshSpec:
        """`"dp=8,ep=4"` -> MeshSpec(dp=8, ep=4); `ep` alone implies dp = ep; empty means one device."""
        sizes: dict[str, int] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            match = re.fullmatch(r"(\w+)\s*=\s*(\d+)", part)
            if not match:
                raise MeshSpecError(f"mesh spec entry {part!r} is not AXIS=SIZE (in {text!r})")
            name, size = match.group(1), int(match.group(2))
            if name not in ("dp", "cp", "ep"):
                raise MeshSpecError(f"unknown mesh axis {name!r} in {text!r}; axes are dp, cp, ep")
            if name in sizes:
                raise MeshSpecError(f"mesh axis {name!r} given twice in {text!r}")
            sizes[name] = size
        if "ep" in sizes and "dp" not in sizes:
            sizes["dp"] = sizes["ep"]
        return cls(**sizes)

    @property
    def num_devices(self) -> int:
        return self.dp * self.cp

    @property
    def axis_sizes(self) -> tuple[int, int, int]:
        """Sizes of the mesh axes `AXES` (cp, dp / ep, ep)."""
        return self.cp, self.dp // self.ep, self.ep

    def __str__(self) -> str:
        return ",".join(f"{n}={getattr(self, n)}" for n in ("dp", "cp", "ep") if getattr(self, n) > 1) or "dp=1"


def make_mesh(spec: MeshSpec, devices=None) -> Mesh:
    """A mesh of `spec` over the first dp x cp devices (Auto axes: XLA propagates the shardings)."""
    devices = jax.devices() if devices is None else list(devices)
    if len(devices) < spec.num_devices:
        raise MeshSpecError(f"mesh {spec} needs {spec.num_devices} devices, only {len(devices)} are available "
                            f"(on CPU set jax_num_cpu_devices before any JAX operation)")
    grid = np.asarray(devices[: spec.num_devices], dtype=object).reshape(spec.axis_sizes)
    return Mesh(grid, AXES, axis_types=(AxisType.Auto,) * len(AXES))


def abstract_mesh(spec: MeshSpec) -> AbstractMesh:
    """The same mesh without devices, for lowering studies of layouts larger than this machine."""
    return AbstractMesh(spec.axis_sizes, AXES, axis_types=(AxisType.Auto,) * len(AXES))


def logical_spec(*names: str | None) -> P:
    """The PartitionSpec of logical axis names under `RULES` (None, or a name ruled (): replicated dimension)."""
    out = []
    for name in names:
        if name is None:
            out.append(None)
        elif name not in RULES:
            raise KeyError(f"no sharding rule for logical axis {name!r}; rules: {sorted(RULES)}")
        else:
            axes = RULES[name]
            out.append(axes[0] if len(axes) == 1 else axes or None)
    return P(*out)


def _path_name(path) -> str:
    """`layers.0.ffn.experts.w1` for a state leaf's key path (the Variable's `.value` dropped)."""
    parts = [str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path]
    return ".".join(parts[:-1] if parts and parts[-1] == "value" else parts)


def param_shardings(params, mesh: Mesh | AbstractMesh):
    """NamedShardings for every Variable of a parameter state (concrete or abstract), by the logical axes it
    was created with (`model.axes.logical_axes`) under `RULES`."""
    def one(variable):
        return variable.replace(NamedSharding(mesh, logical_spec(*logical_axes(variable))))

    return jax.tree.map(one, params, is_leaf=lambda x: isinstance(x, nnx.Variable))


def check_divisible(tree, shardings) -> None:
    """Refuse a layout whose sharded dimensions do not divide evenly (e.g. 384 experts over ep=256)."""
    mesh_sizes = None
    for (path, leaf), sharding in zip(jax.tree.leaves_with_path(tree), jax.tree.leaves(shardings)):
        mesh_sizes = mesh_sizes or dict(zip(sharding.mesh.axis_names, sharding.mesh.axis_sizes))
        for dim, axes in zip(leaf.shape, sharding.spec):
            parts = math.prod(mesh_sizes[a] for a in ((axes,) if isinstance(axes, str) else axes or ()))
            if dim % parts:
                raise MeshSpecError(f"{_path_name(path)} has a dimension of {dim}, which {parts} shards "
                                    f"({axes}) do not divide")


def place(tree, shardings):
    """Arrays of `tree` (host or device values, equal in every process) laid out by `shardings`; each
    process fills only its own devices' shards, so this also builds arrays spanning several hosts."""
    def one(leaf, sharding):
        host = np.asarray(leaf)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    return jax.tree.map(one, tree, shardings)


def shard_model(model, mesh: Mesh):
    """The same Model with its parameters placed by the rules (experts split over `ep`, the rest replicated)."""
    from model.api import Model

    shardings = param_shardings(model.params, mesh)
    check_divisible(model.params, shardings)
    params = place(model.params, shardings)
    return Model(nnx.merge(model.graphdef, params), tokenizer=model.tokenizer, engram=model.engram,
                 drafter=model.drafter)


def model_forward(model, layers=None):
    """`(params, tokens, cache, *engram_rows) -> (logits, cache)` of a Model, for jit / lowering.

    `layers(module.layers)`, when given, replaces the layer list before the call (layout studies trace the
    layers one by one, or run without them)."""
    graphdef, has_engram = model.graphdef, bool(getattr(model.config, "engram_layer_ids", ()))

    def forward(params, tokens, cache, *rows):
        module = nnx.merge(graphdef, params)
        if layers is not None:
            module.layers = nnx.List(layers(list(module.layers)))
        return module(tokens, cache, *([tuple(rows)] if has_engram else []))

    return forward


def batch_sharded(mesh: Mesh | AbstractMesh, tree):
    """Shardings for a tree of batch-first arrays (cache leaves, tokens): leading axis over `batch`,
    scalars replicated."""
    return jax.tree.map(lambda leaf: NamedSharding(mesh, logical_spec(*batch_axes(leaf))), tree)


def logits_on_mesh(model, tokens, mesh: Mesh):
    """fp32 logits of a whole-sequence forward with requests split over the attention ranks (`batch`), the
    sequence over `cp` (`seq`; attention split zigzag, `sharding.context_parallel`) and, when `ep` > 1, the
    experts over `ep` (all-to-all dispatch). The batch must divide the ranks, the sequence 2·cp. The mesh
    may span processes (`jax.distributed`): every process then passes the same model and tokens."""
    from sharding.context_parallel import context_parallel
    from sharding.expert_parallel import expert_parallel

    tokens = np.asarray(tokens, np.int32)
    ranks, cp = mesh.shape["dp"] * mesh.shape["ep"], mesh.shape["cp"]
    chunks = 2 * cp if cp > 1 else 1
    if tokens.ndim != 2 or tokens.shape[0] % ranks or tokens.shape[1] % chunks:
        raise ValueError(f"tokens must be [batch, seq] with batch a multiple of the {ranks} attention ranks and "
                         f"seq a multiple of 2·cp={chunks} (zigzag chunks), got shape {tokens.shape}")
    sharded = shard_model(model, mesh)
    cache = sharded.module().init_cache(*tokens.shape)
    rows = ()
    if model.engram is not None:
        rows, _ = model.engram.lookup(tokens, model.engram.empty_history(tokens.shape[0]))
    by_token = lambda x: NamedSharding(mesh, logical_spec("batch", "seq", *[None] * (x.ndim - 2)))  # noqa: E731
    tokens, rows = place((tokens, tuple(rows)), jax.tree.map(by_token, (tokens, tuple(rows))))
    cache = place(cache, batch_sharded(mesh, cache))
    with contextlib.ExitStack() as stack:
        if mesh.shape["ep"] > 1:
            stack.enter_context(expert_parallel(mesh))
        if cp > 1:
            stack.enter_context(context_parallel(mesh))
        return jax.jit(model_forward(sharded))(sharded.params, tokens, cache, *rows)[0]
