"""Training a DSpark drafter on its target's own generations, and measuring it the way a verifier would.

The target (frozen) continues prompts; the drafter then learns, at many anchors per generated sequence, to
predict the next gamma tokens from the target's features before the anchor. The loss is DSpark's:
per block position k (weight exp(-k / gamma), k = 0 for the first draft) 0.1 * cross-entropy of the generated
token + 0.9 * total variation between draft and target distributions + 1.0 * binary cross-entropy of the
confidence against the analytic acceptance probability 1 - TV = sum_v min(p_draft, p_target).

A run is a function of its settings: initial weights depend only on the seed, batches and anchors only on
(seed, step).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jaxtyping import Array, Float, Int

from model.api import Model
from model.dspark import Drafter, DSparkConfig, init_drafter, lm_head
from model.v41 import DeepseekV41
from model.sampling_keys import GREEDY_BELOW
from serving.speculation.speculative import admit
from serving.speculation.verify_plan import prefix_survival
from training.train import TrainSettings, make_optimizer

LOSS_WEIGHTS = {"ce": 0.1, "tv": 0.9, "bce": 1.0}


@dataclasses.dataclass(frozen=True)
class DrafterSettings:
    """Everything besides the target, the drafter config and the data that decides a run."""

    steps: int = 600
    batch: int = 16  # sequences per step
    anchors: int = 16  # blocks per sequence
    lr: float = 3e-3
    warmup: int = 20
    weight_decay: float = 0.01
    clip_norm: float = 1.0
    seed: int = 0

    def optimizer(self) -> optax.GradientTransformation:
        return make_optimizer(TrainSettings(steps=self.steps, lr=self.lr, warmup=self.warmup,
                                            weight_decay=self.weight_decay, clip_norm=self.clip_norm))


def position_weights(block: int) -> Float[np.ndarray, " g"]:
    """DSpark's per-position loss weights exp(-(k - 1) / gamma) for k = 1..gamma."""
    return np.exp(-np.arange(block) / block).astype(np.float32)


def drafter_loss(
    logits: Float[Array, "b a g V"], conf_logits: Float[Array, "b a g"], target_logits: Float[Array, "b a g V"],
    labels: Int[Array, "b a g"],
) -> tuple[Float[Array, ""], dict]:
    """(the weighted loss, per-position means of its terms and of the acceptance target)."""
    q, p = jax.nn.softmax(logits, axis=-1), jax.nn.softmax(target_logits, axis=-1)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    tv = 0.5 * jnp.sum(jnp.abs(q - p), axis=-1)
    accept = jax.lax.stop_gradient(1.0 - tv)
    bce = optax.sigmoid_binary_cross_entropy(conf_logits, accept)
    terms = LOSS_WEIGHTS["ce"] * ce + LOSS_WEIGHTS["tv"] * tv + LOSS_WEIGHTS["bce"] * bce
    loss = jnp.mean(jnp.sum(terms * position_weights(logits.shape[2]), axis=-1))
    means = lambda x: jnp.mean(x, axis=(0, 1))  # noqa: E731
    return loss, {"ce": means(ce), "tv": means(tv), "bce": means(bce), "accept": means(accept)}


def sample_anchors(lengths: tuple[int, int], batch: int, count: int, block: int, seed: int,
                   step: int) -> Int[np.ndarray, "b a"]:
    """`count` distinct anchor positions per sequence in [prompt_len, seq_len - 1 - block] (the anchor is a
    generated token and every block position has a following token), drawn from (seed, step) alone."""
    prompt_len, seq_len = lengths
    rng = np.random.default_rng(np.random.SeedSequence([seed, step, 1]))
    choices = np.arange(prompt_len, seq_len - block)
    return np.stack([np.sort(rng.choice(choices, count, replace=False)) for _ in range(batch)]).astype(np.int32)


class TargetPass:
    """The frozen target's jitted full-sequence forward: (features of the drafter's layers, logits)."""

    def __init__(self, target: Model, collect: tuple[int, ...]):
        self.target, graphdef = target, target.graphdef

        def forward(params, tokens, rows):
            module = nnx.merge(graphdef, params)
            engram = (rows,) if isinstance(module, DeepseekV41) else ()  # a V4 target has no Engram rows
            logits, _, taps = module(tokens, module.init_cache(*tokens.shape), *engram, collect=collect)
            return taps, logits

        self._forward = jax.jit(forward)
        shared = target.module()
        self.embed, self.head = shared.embed.weight[...], shared.head.weight[...]

    def rows(self, tokens: Int[np.ndarray, "b s"]) -> tuple:
        """Engram rows of whole sequences (looked up on the host)."""
        memory = self.target.engram
        return () if memory is None else memory.lookup(tokens, memory.empty_history(tokens.shape[0]))[0]

    def __call__(self, tokens: Int[np.ndarray, "b s"]):
        return self._forward(self.target.params, jnp.asarray(tokens, jnp.int32), self.rows(tokens))


class DrafterTrainer:
    """One run's target pass, drafter graph, optimizer and jitted step. State: {"params", "opt"}."""

    def __init__(self, target: Model, config: DSparkConfig, settings: DrafterSettings):
        drafter = init_drafter(target.config, config, seed=settings.seed)
        self.config, self.settings, self.graphdef = config, settings, drafter.graphdef
        self.target = TargetPass(target, config.target_layer_ids)
        self.optimizer = settings.optimizer()
        params = nnx.to_pure_dict(drafter.params)
        self.initial = {"params": params, "opt": self.optimizer.init(params)}
        self._step = jax.jit(self._train_step, donate_argnums=0)
        self._loss = jax.jit(self.loss)

    def loss(self, params: dict, taps, target_logits, tokens, anchors):
        module = nnx.merge(self.graphdef, params)
        logits, conf = module.teacher_forced(self.target.embed, self.target.head, taps, tokens, anchors)
        (b, a), g = anchors.shape, self.config.block_size
        at = (anchors[..., None] + jnp.arange(g)).reshape(b, a * g)  # the positions whose next token is drafted
        picked = jnp.take_along_axis(target_logits, at[..., None], axis=1).reshape(b, a, g, -1)
        labels = jnp.take_along_axis(tokens, at + 1, axis=1).reshape(b, a, g)
        return drafter_loss(logits, conf, picked, labels)

    def _train_step(self, state: dict, taps, target_logits, tokens, anchors):
        (loss, metrics), grads = jax.value_and_grad(self.loss, has_aux=True)(
            state["params"], taps, target_logits, tokens, anchors)
        updates, opt = self.optimizer.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, loss, metrics

    def step(self, state: dict, tokens: Int[np.ndarray, "b s"], anchors: Int[np.ndarray, "b a"]):
        """(new state, loss, metrics) after one optimizer step; the state is donated."""
        taps, logits = self.target(tokens)
        return self._step(state, taps, logits, jnp.asarray(tokens, jnp.int32), jnp.asarray(anchors))

    def evaluate(self, state: dict, tokens: Int[np.ndarray, "b s"], anchors: Int[np.ndarray, "b a"]) -> dict:
        """The loss terms (per position) on held-out sequences, without updating."""
        taps, logits = self.target(tokens)
        loss, metrics = self._loss(state["params"], taps, logits, jnp.asarray(tokens, jnp.int32), jnp.asarray(anchors))
        return {"loss": float(loss), **{k: np.asarray(v).tolist() for k, v in metrics.items()}}

    def drafter(self, state: dict, config: DSparkConfig | None = None) -> Drafter:
        """The trained drafter (with another config's STS temperatures if given)."""
        module = nnx.merge(self.graphdef, state["params"])
        module.config = config or self.config
        return Drafter(module)


def train_drafter(trainer: DrafterTrainer, sequences: Int[np.ndarray, "n s"], prompt_len: int,
                  log=None) -> tuple[dict, list]:
    """Run `settings.steps` steps over `sequences` (batches drawn from (seed, step)); returns (state, losses)."""
    s, state, losses = trainer.settings, jax.tree.map(jnp.array, trainer.initial), []  # steps donate the state
    for step in range(s.steps):
        rng = np.random.default_rng(np.random.SeedSequence([s.seed, step]))
        batch = sequences[rng.choice(len(sequences), s.batch, replace=False)]
        anchors = sample_anchors((prompt_len, sequences.shape[1]), s.batch, s.anchors, trainer.config.block_size,
                                 s.seed, step)
        state, loss, _ = trainer.step(state, batch, anchors)
        losses.append(loss)
        if log is not None and (step + 1) % 25 == 0:
            log(step + 1, float(np.mean(np.asarray(losses[-25:]))))
    return state, [float(x) for x in losses]


# ---- data ----------------------------------------------------------------------------------------------------
def generate(target: Model, prompts: Int[np.ndarray, "n p"], new_tokens: int, temperature: float, seed: int,
             batch: int = 64) -> Int[np.ndarray, "n t"]:
    """The target's own continuations of `prompts` through its cached path (`Model.step`): greedy below
    temperature 1e-5, else sampled from softmax(logits / T) with noise drawn from (seed, batch index)."""
    out = []
    for i in range(0, len(prompts), batch):
        chunk = np.asarray(prompts[i:i + batch], np.int32)
        rng = np.random.default_rng(np.random.SeedSequence([seed, i]))
        cache = target.init_cache(chunk.shape[0], chunk.shape[1] + new_tokens)
        logits, cache = target.step(chunk, cache)
        tokens = [chunk]
        for t in range(new_tokens):
            last = np.asarray(logits[:, -1], np.float64)
            if temperature >= GREEDY_BELOW:
                last = last / temperature + rng.gumbel(size=last.shape)
            tokens.append(np.argmax(last, axis=-1).astype(np.int32)[:, None])
            if t + 1 < new_tokens:
                logits, cache = target.step(tokens[-1], cache)
        out.append(np.concatenate(tokens, axis=1))
    return np.concatenate(out)


# ---- offline verification ------------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnums=0)
def _draft_blocks(graphdef, params, embed, head, taps, tokens, anchors, seeds, temperature):
    module = nnx.merge(graphdef, params)
    h = module.anchored_hidden(embed, taps, tokens, anchors)
    flat = anchors.reshape(-1)
    return module.sample_block(lm_head(head, module.norm(h)), h, tokens[jnp.arange(tokens.shape[0])[:, None],
                                                                      anchors].reshape(-1), flat, seeds, temperature)


def verify_offline(target: TargetPass, drafter: Drafter, tokens: Int[np.ndarray, "b s"],
                   anchors: Int[np.ndarray, "b a"], temperature: float, seed: int) -> dict:
    """Draft a block at each anchor as serving would (each row's features before the anchor as context,
    drafts sampled left to right with the Markov head), then score each draft as the verifier does: the target
    distribution after the anchor and the drafts before it, at `temperature` (one-hot argmax when greedy), and
    accept_prob = sum_v min(p_target, q_draft). Returns per block [b * a, gamma]: accept_prob, raw confidence
    logits, drafts."""
    (b, a), g = anchors.shape, drafter.config.block_size
    taps, _ = target(tokens)
    rows = np.arange(b * a, dtype=np.uint32)
    seeds = np.stack([np.full_like(rows, seed), rows], axis=1)
    temps = np.full(b * a, temperature, np.float32)
    drafts, q, conf_logits = _draft_blocks(drafter.graphdef, drafter.params, target.embed, target.head, taps,
                                           jnp.asarray(tokens, jnp.int32), jnp.asarray(anchors), jnp.asarray(seeds),
                                           jnp.asarray(temps))
    drafts = np.asarray(drafts)
    substituted = np.repeat(np.asarray(tokens), a, axis=0)
    flat = anchors.reshape(-1)
    for k in range(g - 1):  # the target sees the anchor's prefix followed by the drafts
        substituted[np.arange(b * a), flat + 1 + k] = drafts[:, k]
    accept = []
    for i in range(0, b * a, 32):
        _, logits = target(substituted[i:i + 32])
        at = flat[i:i + 32, None] + np.arange(g)
        picked = np.take_along_axis(np.asarray(logits), at[..., None], axis=1)  # [n, g, V]
        if temperature < GREEDY_BELOW:
            p = np.eye(picked.shape[-1], dtype=np.float32)[np.argmax(picked, axis=-1)]
        else:
            p = np.asarray(jax.nn.softmax(picked / temperature, axis=-1))
        accept.append(np.minimum(p, np.asarray(q[i:i + 32])).sum(-1))
    return {"accept_prob": np.concatenate(accept), "conf_logits": np.asarray(conf_logits), "drafts": drafts}


def expected_accepted(accept_prob: Float[np.ndarray, "n g"]) -> float:
    """Mean expected number of accepted drafts per block, sum_k prod_{i<=k} accept_prob_i (the verifier's
    bonus token comes on top)."""
    return float(np.mean(np.sum(prefix_survival(accept_prob), axis=1)))


def kept_at_budget(accept_prob: Float[np.ndarray, "s r g"], survival: Float[np.ndarray, "s r g"],
                   reduction: float) -> float:
    """The share of fixed-length verification's expected accepted drafts that a smaller verify budget keeps.
    Each of `s` steps holds `r` blocks of `g` drafts; fixed verifies all r * g, the budget round((1 - reduction)
    * r * g) pairs admitted by descending `survival` (the engine's `admit`: equal values in row order). A draft's
    expected acceptance is the product of the accept_prob up to it (`expected_accepted`)."""
    _, r, g = accept_prob.shape
    reach = prefix_survival(accept_prob)  # P(draft j accepted)
    budget = jnp.asarray(round((1 - reduction) * r * g), jnp.int32)
    lengths = np.asarray(jax.vmap(admit, in_axes=(0, None, None))(jnp.asarray(survival, jnp.float32),
                                                                   jnp.full(r, g, jnp.int32), budget))
    kept = np.where(np.arange(g) < lengths[..., None], reach, 0.0).sum()
    return float(kept / reach.sum())
