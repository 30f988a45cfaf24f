"""Mixture of experts: sqrt-softplus routing (bias for selection only), hash routing, clamped SwiGLU experts."""

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from model.axes import param
from model.config import ModelConfig
from model.config_v41 import V41Config
from model.linear import Linear, normal_init
from model import registry
from pallas_kernels.moe import clamped_swiglu


class ExpertDispatch:
    """How MoE layers traced inside `expert_dispatch(...)` run their routed experts in place of the local
    `routed_experts` op: called with that op's signature (`op="routed_experts_fp4"`: the FP4 op's), weights
    stacked per expert or per EPLB slot (e.g. split over a mesh's `ep` axis, `sharding.expert_parallel`). A
    dispatch running inside a data-parallel step overrides `first_token` and `any_rank` for its rank."""

    def __call__(self, x: Float[Array, "t d"], ids: Int[Array, "t k"], weights: Float[Array, "t k"],
                 *stacks_and_limit, op: str = "routed_experts") -> Float[Array, "t d"]:
        raise NotImplementedError

    def first_token(self, tokens: int) -> Int[Array, ""] | int:
        """The index in the whole batch of the first of these `tokens` (EPLB's replica choice): 0 on one rank."""
        return 0

    def any_rank(self, pred: Bool[Array, ""]) -> Bool[Array, ""]:
        """`pred` as one decision for every rank (`any_rank`): `pred` itself on one rank."""
        return pred


def expert_dispatch(routed: ExpertDispatch):
    """Run the MoE layers traced inside this block through `routed` (the registry's `TraceChoices.experts`)."""
    return registry.tracing(experts=routed)


def any_rank(pred: Bool[Array, ""]) -> Bool[Array, ""]:
    """`pred`, made one decision for every rank of an expert-parallel dispatch that runs inside a data-parallel
    step (True where any rank's `pred` is): a `lax.cond` whose branch runs MoE layers must be taken by all ranks
    at once, or the ranks that took it wait forever in its all-to-all."""
    routed = registry.choices().experts
    return pred if routed is None else routed.any_rank(pred)


def route_scores(logits: Float[Array, "t e"], scoring_func: str) -> Float[Array, "t e"]:
    """Router affinities from gate logits."""
    if scoring_func == "sqrtsoftplus":
        return jnp.sqrt(jax.nn.softplus(logits))
    if scoring_func == "sigmoid":
        return jax.nn.sigmoid(logits)
    return jax.nn.softmax(logits, axis=-1)


class SharedExpert(nnx.Module):
    """The always-on expert (w1 gate, w3 up, w2 down): matmuls accumulated in fp32 whatever the weights'
    storage, the SwiGLU in fp32 (as DeepSeek's reference computes it)."""

    def __init__(self, dim: int, inter: int, limit: float, dtype, rngs: nnx.Rngs):
        self.w1 = Linear(dim, inter, dtype, rngs)
        self.w2 = Linear(inter, dim, dtype, rngs)
        self.w3 = Linear(dim, inter, dtype, rngs)
        self.limit = limit

    def __call__(self, x: Float[Array, "t d"]) -> Float[Array, "t d"]:
        f32 = jnp.float32
        return self.w2(clamped_swiglu(self.w1(x).astype(f32), self.w3(x).astype(f32), self.limit))


class Gate(nnx.Module):
    """Router: scores from `weight`; experts chosen by top-k on scores + `bias`, or by the fixed `tid2eid`.

    V4.1 adds a logit temperature (`gate_temp`), a selection bias for image tokens (`bias_vl`, loaded; this
    text-only model never uses it) and skips the weight normalisation when a token picks one expert.
    """

    def __init__(self, config: ModelConfig | V41Config, hash_routed: bool, dtype, rngs: nnx.Rngs, v41: bool = False):
        e, k = config.n_routed_experts, config.num_experts_per_tok
        self.weight = param(normal_init(rngs, (e, config.hidden_size), dtype), "router", "embed")
        if hash_routed:
            self.tid2eid = param(jnp.arange(config.vocab_size * k, dtype=jnp.int32).reshape(-1, k) % e, "vocab", "topk")
        else:
            self.bias = param(jnp.zeros((e,), jnp.float32), "router")
        if v41:
            self.bias_vl = param(jnp.zeros((e,), jnp.float32), "router")
        self.hash_routed = hash_routed
        self.k, self.scale = k, config.routed_scaling_factor
        self.norm = config.norm_topk_prob and (k > 1 or not v41)
        self.temp = config.gate_temp if v41 else 1.0
        self.scoring_func = config.scoring_func

    def __call__(self, x: Float[Array, "t d"], token_ids: Int[Array, " t"]):
        """(expert ids [t, k], combine weights [t, k]) per token."""
        logits = jnp.einsum("td,ed->te", x.astype(jnp.float32), self.weight[...].astype(jnp.float32)) / self.temp
        scores = route_scores(logits, self.scoring_func)
        if self.hash_routed:
            ids = self.tid2eid[...][token_ids]
        else:
            _, ids = jax.lax.top_k(scores + self.bias[...], self.k)
        weights = jnp.take_along_axis(scores, ids, axis=-1)
        if self.norm:
            weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
        return ids, weights * self.scale


class ExpertMap(nnx.Variable):
    """An MoE layer's EPLB tables (`sharding.expert_balance`): integers that place experts, never trained."""


def replica_slots(ids: Int[Array, "t k"], log2phy: Int[Array, "e r"], logcnt: Int[Array, " e"],
                  first=0) -> Int[Array, "t k"]:
    """The physical slot serving each (token, expert) pair: the expert's replica (token index mod its replica
    count), so replicas share a busy expert's tokens deterministically. `first`: the index of the first of
    these tokens in the whole batch (a data-parallel rank's share starts past the ranks before it)."""
    replica = (first + jnp.arange(ids.shape[0]))[:, None] % logcnt[ids]
    return log2phy[ids, replica]


class ExpertReplicas(nnx.Module):
    """An MoE layer's EPLB placement (set by `sharding.expert_balance`): per logical expert the physical slots
    that hold it (`log2phy` [E, R], -1 past its count) and how many do (`logcnt` [E])."""

    def __init__(self, log2phy: ExpertMap, logcnt: ExpertMap):
        self.log2phy, self.logcnt = log2phy, logcnt

    def slots(self, ids: Int[Array, "t k"], first=0) -> Int[Array, "t k"]:
        """The physical slot serving each (token, expert) pair (`replica_slots`)."""
        return replica_slots(ids, self.log2phy[...], self.logcnt[...], first)


class Experts(nnx.Module):
    """Routed experts stacked on a leading expert axis: w1, w3 [E, I, D], w2 [E, D, I] (stored FP4:
    `Fp4Experts`).

    Placed by EPLB (`replicas`, an `ExpertReplicas`) the weights are stacked per physical slot instead
    (redundant replicas included) and each pair goes to one replica of its expert; a data-parallel rank's
    dispatch offsets the replica choice by its `first_token`."""

    def __init__(self, config: ModelConfig | V41Config, dtype, rngs: nnx.Rngs):
        e, d, i = config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
        self.w1 = param(normal_init(rngs, (e, i, d), dtype), "expert", "mlp", "embed")
        self.w2 = param(normal_init(rngs, (e, d, i), dtype), "expert", "embed", "mlp")
        self.w3 = param(normal_init(rngs, (e, i, d), dtype), "expert", "mlp", "embed")
        self.limit = config.swiglu_limit
        self.replicas: ExpertReplicas | None = nnx.data(None)  # None: one slot per expert

    def stacked(self) -> tuple[str, tuple[str, ...]]:
        """(the kernel registry's op for these experts, the names of their expert-stacked tensors in the order it
        takes them): float w1, w2, w3."""
        return "routed_experts", ("w1", "w2", "w3")

    def __call__(self, x: Float[Array, "t d"], ids: Int[Array, "t k"], weights: Float[Array, "t k"]):
        """Sum over each token's chosen experts of weight * expert(x) (the kernel registry's `routed_experts`,
        or `routed_experts_fp4` for stored experts; an expert-parallel dispatch takes either, by `op`)."""
        op, names = self.stacked()
        stacks = tuple(getattr(self, name)[...] for name in names)
        routed = registry.choices().experts
        if self.replicas is not None:
            ids = self.replicas.slots(ids, 0 if routed is None else routed.first_token(ids.shape[0]))
        if routed is None:
            return registry.op(op)(x, ids, weights, *stacks, self.limit)
        return routed(x, ids, weights, *stacks, self.limit, op=op)


class Fp4Experts(Experts):
    """Routed experts as DeepSeek stores them (`model.stored`): packed FP4 codes w1, w3 [E, I, D/2], w2
    [E, D, I/2], each with its UE8M0 scales `w1_scale`, `w3_scale` [E, I, D/32], `w2_scale` [E, D, I/32] (the
    kernel registry's `routed_experts_fp4`)."""

    def __init__(self, stacks: dict[str, nnx.Param], limit: float):
        for name, stack in stacks.items():
            setattr(self, name, stack)
        self.limit = limit
        self.replicas: ExpertReplicas | None = nnx.data(None)

    def stacked(self) -> tuple[str, tuple[str, ...]]:
        """The FP4 op and each packed stack followed by its scales."""
        return "routed_experts_fp4", ("w1", "w1_scale", "w2", "w2_scale", "w3", "w3_scale")


class MoE(nnx.Module):
    """Routed experts plus the shared expert."""

    def __init__(self, config: ModelConfig | V41Config, hash_routed: bool, dtype, rngs: nnx.Rngs, v41: bool = False):
        self.gate = Gate(config, hash_routed, dtype, rngs, v41)
        self.experts = Experts(config, dtype, rngs)
        if config.n_shared_experts:
            self.shared_experts = SharedExpert(config.hidden_size, config.moe_intermediate_size,
                                               config.swiglu_limit, dtype, rngs)
        self.has_shared = bool(config.n_shared_experts)

    def __call__(self, x: Float[Array, "b s d"], token_ids: Int[Array, "b s"]) -> Float[Array, "b s d"]:
        flat = x.reshape(-1, x.shape[-1])
        ids, weights = self.gate(flat, token_ids.reshape(-1))
        out = self.experts(flat, ids, weights)
        if self.has_shared:
            out = out + self.shared_experts(flat).astype(jnp.float32)
        return out.reshape(x.shape).astype(x.dtype)
