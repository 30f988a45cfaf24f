"""Test helpers: models whose every parameter is random (no zero sinks, biases or position biases), greedy
decoding by the full-sequence forward (the reference engines are checked against), and a converted checkpoint
with its BF16 tensors widened to F32."""

import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from model.api import Model
from model.initialize import init_model


def random_model(config, seed: int = 0, noise: float = 0.1, **init_kwargs) -> Model:
    """A model with every float parameter perturbed by `noise` (norms near 1), random hash-routing tables."""
    model = init_model(config, seed=seed, **init_kwargs)
    leaves, treedef = jax.tree.flatten(model.params)
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
    out = []
    for key, leaf in zip(keys, leaves):
        if jnp.issubdtype(leaf.dtype, jnp.integer):
            out.append(jax.random.randint(key, leaf.shape, 0, config.n_routed_experts, leaf.dtype))
        else:
            out.append(leaf + noise * jax.random.normal(key, leaf.shape, leaf.dtype))
    return Model(nnx.merge(model.graphdef, jax.tree.unflatten(treedef, out)), engram=model.engram)


def assert_views_alias_their_stacks(layer_plan, layered) -> None:
    """Every expert stack a layer-programs bucket passes as per-expert views (`LayeredForward.views`) is viewed
    in place: expert e's array starts e experts into the stack's buffer."""
    leaves, with_views = layered.views
    for stack, parts in ((leaves[i], with_views[i]) for i in layer_plan.experts):
        offsets = [part.unsafe_buffer_pointer() - stack.unsafe_buffer_pointer() for part in parts]
        assert offsets == [e * stack.nbytes // stack.shape[0] for e in range(stack.shape[0])]


def assert_full_forward_tokens(outputs, model: Model, prompts: list[list[int]], steps: int, atol: float = 2e-5
                               ) -> None:
    """The outputs' greedy tokens equal the full forward's (`greedy_full_forward`), their logits within `atol`."""
    for out, (tokens, logits) in zip(outputs, greedy_full_forward(model, prompts, steps), strict=True):
        assert out.token_ids == tokens
        np.testing.assert_allclose(np.stack(out.logits), logits, atol=atol, rtol=0)


def greedy_full_forward(model: Model, prompts: list[list[int]], steps: int, rows: int = 8, width: int = 64
                        ) -> list[tuple[list[int], np.ndarray]]:
    """Greedy tokens and their fp32 logits [steps, V] for every prompt, one full-sequence forward per token: all
    prompts advance together in one zero-padded [rows, width] batch (the model is causal), so a model compiles
    this once whatever the prompts; tests of the same config share it through the compile cache."""
    if len(prompts) > rows or max(len(p) for p in prompts) + steps > width:
        raise ValueError(f"{len(prompts)} prompts of up to {max(len(p) for p in prompts)} tokens + {steps} steps "
                         f"do not fit a [{rows}, {width}] batch")
    ids = [list(p) for p in prompts]
    logits: list[list[np.ndarray]] = [[] for _ in prompts]
    for _ in range(steps):
        padded = np.zeros((rows, width), np.int32)
        for i, seq in enumerate(ids):
            padded[i, :len(seq)] = seq
        out = np.asarray(model.logits(padded))
        for i, seq in enumerate(ids):
            logits[i].append(out[i, len(seq) - 1])
            seq.append(int(out[i, len(seq) - 1].argmax()))
    return [(seq[len(p):], np.stack(rows_)) for p, seq, rows_ in zip(prompts, ids, logits)]


def prompt_logprobs_by_forward(model: Model, prompt: list[int], width: int | None = None
                               ) -> tuple[np.ndarray, np.ndarray]:
    """(each prompt token's logprob given the ones before it, float64 [len - 1]; the most likely token at each of
    those positions) by the model's full forward, replay off (zero-padded to `width` tokens: the model is causal,
    so one compilation serves prompts of any length)."""
    padded = np.zeros((1, width or len(prompt)), np.int32)
    padded[0, :len(prompt)] = prompt
    logits = np.asarray(model.logits(padded), np.float64)[0, :len(prompt) - 1]
    top = logits.max(-1, keepdims=True)
    logprobs = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
    return logprobs[np.arange(len(prompt) - 1), prompt[1:]], logprobs.argmax(-1)


def widened_to_f32(src: Path, dst: Path) -> Path:
    """`src`, a one-file checkpoint, with its BF16 tensors stored as F32 (exactly): loaded as `checkpoint` it keeps
    its FP8 / FP4 tensors as stored and computes everything else in fp32, so that it can be compared tightly with
    an fp32 decoding or an fp32 reference."""
    from model.safetensors_io import read_tensors, write_tensors

    dst.mkdir(parents=True)
    shutil.copy2(src / "config.json", dst / "config.json")
    tensors = {n: v.astype(np.float32) if v.dtype == jnp.bfloat16 else v for n, v in read_tensors(src).items()}
    write_tensors(dst / "model.safetensors", tensors)
    return dst
