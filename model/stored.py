"""DeepSeek's stored weight formats inside a model: which tensors a V4 checkpoint keeps as FP8 blocks or
packed FP4, encoding them (numpy, on the host), and giving a model's modules that form so they hold those
bytes and decode them inside their matmuls.

FP8 (E4M3 values, one UE8M0 scale per block, 128x128 in V4): the attention projections wq_a, wq_b, wkv, wo_b,
the indexer's wq_b, the shared experts, the MTP blocks' e_proj / h_proj. Packed FP4 (E2M1 codes two per byte,
one UE8M0 scale per 32 inputs of a row): the routed experts. Everything else (embedding, head, norms, mHC,
router, compressors, wo_a) stays as the checkpoint stores it (reference/v4-architecture.md, Flash's dtypes).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Set as AbstractSet

import jax
import ml_dtypes
import numpy as np
from flax import nnx

from model.axes import logical_axes, param
from model.linear import Fp8Linear, Linear
from model.moe import Experts, Fp4Experts
from model.quant import quantize_fp4_packed, quantize_fp8_blocks

FP8_LINEAR = re.compile(r"^(layers|mtp)\.\d+\.(attn\.(wq_a|wq_b|wkv|wo_b|indexer\.wq_b)|ffn\.shared_experts\.w[123]"
                        r"|e_proj|h_proj)\.weight$")
FP4_EXPERT = re.compile(r"\.experts\.\d+\.w[123]\.weight$")
FP4_GROUP = 32  # inputs per UE8M0 scale of a packed FP4 row
E4M3, E8M0 = np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e8m0fnu)


def quantize_tensors(tensors: dict[str, np.ndarray], block: tuple[int, int]) -> dict[str, np.ndarray]:
    """Native-named float tensors (experts per expert) in DeepSeek's layout: FP8 linears and FP4 experts
    gain a `.scale` beside their `.weight` (power-of-two UE8M0 scales, the smallest that fit each block's
    largest magnitude, as DeepSeek's conversions choose them); the rest are returned as they are."""
    out = {}
    for name, value in tensors.items():
        stem = name.removesuffix(".weight")
        try:
            if FP8_LINEAR.match(name):
                out[name], out[stem + ".scale"] = quantize_fp8_blocks(value, block)
            elif FP4_EXPERT.search(name):
                out[name], out[stem + ".scale"] = quantize_fp4_packed(value, FP4_GROUP)
            else:
                out[name] = value
        except ValueError as e:
            raise ValueError(f"cannot quantize {name} {list(np.shape(value))}: {e}") from None
    return out


def quantization_config(block: tuple[int, int], fp4_experts: bool) -> dict:
    """The config.json fields of a checkpoint in DeepSeek's layout (`quantization_config`, `expert_dtype`)."""
    return {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                    "scale_fmt": "ue8m0", "weight_block_size": list(block)},
            **({"expert_dtype": "fp4"} if fp4_experts else {})}


def stored_names(tensors: dict) -> tuple[set[str], set[str]]:
    """(FP8 linears, FP4 expert stacks) of a native-named checkpoint: module paths such as `layers.0.attn.wq_a`
    whose weight is E4M3 with a UE8M0 scale, and `layers.0.ffn.experts.w1` whose per-expert weights are
    packed bytes with UE8M0 scales."""
    fp8, fp4 = set(), set()
    for name, scale in tensors.items():
        if not name.endswith(".scale") or scale.dtype != E8M0:
            continue
        weight = tensors.get(name.removesuffix(".scale") + ".weight")
        if weight is None:
            continue
        if m := re.match(r"^(.*\.experts)\.\d+\.(w[123])\.scale$", name):
            if weight.dtype in (np.int8, np.uint8):
                fp4.add(f"{m[1]}.{m[2]}")
        elif weight.dtype == E4M3:
            fp8.add(name.removesuffix(".scale"))
    return fp8, fp4


def rule_names(module) -> tuple[set[str], set[str]]:
    """(FP8 linears, FP4 expert stacks) of a model by DeepSeek's rules (`FP8_LINEAR`, `FP4_EXPERT`)."""
    fp8, fp4 = set(), set()
    for path, sub in nnx.iter_modules(module):
        name = ".".join(map(str, path))
        if isinstance(sub, Linear) and FP8_LINEAR.match(name + ".weight"):
            fp8.add(name)
        elif isinstance(sub, Experts):
            fp4 |= {f"{name}.{w}" for w in ("w1", "w2", "w3")}
    return fp8, fp4


def as_stored(module, fp8: AbstractSet[str], fp4: AbstractSet[str], block: tuple[int, int]) -> None:
    """Give an abstract module's FP8 linears (`fp8`, module paths) E4M3 weights with UE8M0 `scale` [ceil(out /
    block[0]), ceil(in / block[1])], and its FP4 expert stacks (`fp4`, `....experts.wN`) packed int8 weights
    [E, out, in / 2] with UE8M0 `wN_scale` [E, out, ceil(in / 32)]. All three stacks of a layer go together."""
    def shaped(shape, dtype, like: nnx.Variable):
        """An abstract parameter with the logical axes of the float weight it stands for."""
        return param(jax.ShapeDtypeStruct(tuple(shape), dtype), *logical_axes(like))

    stored = []  # (path, the module in stored form), put in place after the walk
    for path, sub in nnx.iter_modules(module):
        name = ".".join(map(str, path))
        if isinstance(sub, Linear) and name in fp8:
            out_dim, in_dim = sub.weight.shape
            scale = shaped((-(-out_dim // block[0]), -(-in_dim // block[1])), E8M0, sub.weight)
            stored.append((path, Fp8Linear(shaped((out_dim, in_dim), E4M3, sub.weight), scale, block,
                                           sub.compute_dtype)))
        elif isinstance(sub, Experts) and f"{name}.w1" in fp4:
            stacks = {}
            for w in ("w1", "w2", "w3"):
                weight = getattr(sub, w)
                n_exp, out_dim, in_dim = weight.shape
                if in_dim % 2:
                    raise ValueError(f"{name}.{w}: packed FP4 needs an even number of inputs, got {in_dim}")
                stacks[w] = shaped((n_exp, out_dim, in_dim // 2), np.int8, weight)
                stacks[f"{w}_scale"] = shaped((n_exp, out_dim, -(-in_dim // FP4_GROUP)), E8M0, weight)
            stored.append((path, Fp4Experts(stacks, sub.limit)))
    for path, sub in stored:
        parent = functools.reduce(lambda node, key: node[key] if isinstance(key, int) else getattr(node, key),
                                  path[:-1], module)
        if isinstance(path[-1], int):
            parent[path[-1]] = sub
        else:
            setattr(parent, path[-1], sub)
