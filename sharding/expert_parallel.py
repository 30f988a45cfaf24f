"""Expert parallelism: routed experts split over the mesh's `ep` axis, tokens sent to them by all-to-all.

`ExpertParallel(mesh)` has the signature of `pallas_kernels.moe.routed_experts_reference` (with
`op="routed_experts_fp4"`, of `routed_experts_fp4`: stored FP4 codes and scales split alike). Inside `jax.shard_map` every
device holds its own tokens and E/ep experts: each (token, expert) pair is written into the bucket of the
shard owning that expert (buckets sized for the worst case, so nothing is ever dropped), one all-to-all
over `ep` delivers the buckets, the shard runs its local experts (the kernel registry's `op`
with one expert per row), a second all-to-all returns the results, and each token sums its k results in
its own slot order, a fixed order whatever else is in the batch.

With an EPLB placement (`ExpertPlacement`, from `sharding.eplb.rebalance_experts`; in a model see
`sharding.expert_balance`), weights are stored per physical slot (redundant replicas included) and each pair
is sent to one replica of its expert chosen from its token's index, so replicas share the load; replicas
hold identical weights, so the choice never changes a result.

`expert_parallel(mesh)` routes every MoE layer traced inside it through this path.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int

from model import moe
from model import registry

TOKEN_AXES = ("dp", "ep")  # the mesh axes tokens are split over (sharding.mesh.RULES["batch"])


@dataclasses.dataclass(frozen=True)
class ExpertPlacement:
    """One MoE layer's EPLB maps: the logical expert in each physical slot, each expert's slots (-1 padded)
    and replica counts. Slot s lives on ep shard s // (slots / ep)."""

    phy2log: Int[np.ndarray, " slots"]
    log2phy: Int[np.ndarray, "experts replicas"]
    logcnt: Int[np.ndarray, " experts"]

    @classmethod
    def from_eplb(cls, phy2log, log2phy, logcnt, layer: int = 0) -> ExpertPlacement:
        """Layer `layer` of `rebalance_experts`' (phy2log, log2phy, logcnt)."""
        return cls(np.asarray(phy2log)[layer], np.asarray(log2phy)[layer], np.asarray(logcnt)[layer])

    @classmethod
    def identity(cls, n_experts: int) -> ExpertPlacement:
        """Each expert in its own slot, no replicas."""
        ids = np.arange(n_experts)
        return cls(ids, ids[:, None], np.ones(n_experts, np.int64))

    def physical(self, w: Float[Array, "e ..."]) -> Float[Array, "slots ..."]:
        """Stacked expert weights laid out by physical slot (moving them is how a rebalance takes effect)."""
        return w[jnp.asarray(self.phy2log)]

    def slots_of(self, ids: Int[Array, "t k"]) -> Int[Array, "t k"]:
        """The physical slot serving each (token, expert) pair (`model.moe.replica_slots`)."""
        return moe.replica_slots(ids, jnp.asarray(self.log2phy), jnp.asarray(self.logcnt))


def local_pairs(x: Float[Array, "t d"], ids: Int[Array, "t k"], weights: Float[Array, "t k"], *stacks: Array,
                limit: float, axis: str, n_shards: int, op: str = "routed_experts") -> Float[Array, "t d"]:
    """Inside a shard_map over `axis` (`n_shards` expert shards, `stacks` this shard's expert weights as the
    registry's `op` takes them: w1, w2, w3, or FP4 codes and scales): dispatch this device's pairs by
    all-to-all, run the local experts, combine each token's results in slot order."""
    t, k = ids.shape
    local = stacks[0].shape[0]
    dest, expert = ids // local, ids % local  # [t, k]
    flat_dest = dest.reshape(-1)
    # position of each pair inside its destination bucket (pairs in token-then-slot order)
    onehot = jax.nn.one_hot(flat_dest, n_shards, dtype=jnp.int32)
    pos = jnp.sum((jnp.cumsum(onehot, axis=0) - 1) * onehot, axis=1)
    cap = t * k
    send_x = jnp.zeros((n_shards, cap, x.shape[-1]), x.dtype).at[flat_dest, pos].set(jnp.repeat(x, k, axis=0))
    send_e = jnp.full((n_shards, cap), -1, jnp.int32).at[flat_dest, pos].set(expert.reshape(-1))  # -1: empty
    a2a = functools.partial(jax.lax.all_to_all, axis_name=axis, split_axis=0, concat_axis=0, tiled=True)
    recv_x, recv_e = a2a(send_x), a2a(send_e).reshape(-1, 1)
    # the buffer holds every pair that could come (n_shards * cap); about t * k do, the rest weigh 0
    y = registry.op(op)(recv_x.reshape(-1, x.shape[-1]), jnp.maximum(recv_e, 0), (recv_e >= 0).astype(jnp.float32),
                        *stacks, limit, pairs=t * k)
    back = a2a(y.reshape(n_shards, cap, -1))
    per_pair = back[flat_dest, pos].reshape(t, k, -1)
    out = weights[:, 0, None] * per_pair[:, 0]
    for slot in range(1, k):  # fixed summation order over each token's slots
        out = out + weights[:, slot, None] * per_pair[:, slot]
    return out


class ExpertParallel(moe.ExpertDispatch):
    """The registry's routed-experts op (`op`) with experts split over `mesh`'s `ep` axis (see the module
    docstring), called from outside a shard_map.

    Weights are stacked per expert, or per physical slot with ids already mapped to slots (EPLB)."""

    def __init__(self, mesh: Mesh):
        self.mesh = mesh
        self.n_shards = mesh.shape["ep"]
        self.n_token_shards = self.n_shards * mesh.shape["dp"]

    def __call__(self, x: Float[Array, "t d"], ids: Int[Array, "t k"], weights: Float[Array, "t k"],
                 *stacks_and_limit, op: str = "routed_experts") -> Float[Array, "t d"]:
        *stacks, limit = stacks_and_limit
        if stacks[0].shape[0] % self.n_shards:
            raise ValueError(f"{stacks[0].shape[0]} expert slots do not divide over ep={self.n_shards}")
        t = x.shape[0]
        pad = -t % self.n_token_shards  # padding pairs carry weight 0 and go to expert 0
        x, ids, weights = (jnp.pad(a, ((0, pad), (0, 0))) for a in (x, ids, weights))
        body = functools.partial(local_pairs, limit=limit, axis="ep", n_shards=self.n_shards, op=op)
        tokens, experts = P(TOKEN_AXES), P("ep")
        out = jax.shard_map(body, mesh=self.mesh, in_specs=(tokens, tokens, tokens) + (experts,) * len(stacks),
                            out_specs=tokens)(x, ids, weights.astype(jnp.float32), *stacks)
        return out[:t]


@contextlib.contextmanager
def expert_parallel(mesh: Mesh):
    """Run every MoE layer traced inside this block with its experts split over `mesh`'s `ep` axis."""
    with moe.expert_dispatch(ExpertParallel(mesh)):
        yield
