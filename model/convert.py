"""`jaxseek convert`: a checkpoint rewritten in DeepSeek's FP8 / FP4 layout or in bf16, tensor by tensor.

`fp8`: the FP8 linears and packed FP4 experts of `model.stored`'s rules, power-of-two UE8M0 scales, and every
other float matrix named `*.weight` (embedding, head, compressor and indexer projections, the router) in bf16,
as DeepSeek's checkpoints hold them and as a model loaded `checkpoint` holds them (`model.checkpoint.layout_for`,
what `jaxseek study --param-format checkpoint` counts). `bf16`: stored pairs decoded, and every float matrix
named `*.weight` in bf16 (exact for FP8 / FP4 values). Both keep mHC, `ape`, norms, sinks and biases in their
type, as DeepSeek's do.
Sources may be float or already quantized (decoded first: re-encoding a decoded FP8 / FP4 tensor with its
own block gives it back). The output is written one shard at a time (at most `max_shard_bytes` of tensors in
memory), with `model.safetensors.index.json` when it takes more than one; config.json's
`quantization_config` follows the output, and every other file of the source (tokenizer, drafter config) is
copied.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
from tqdm import tqdm

from model.checkpoint import _HC_SITE, _canonical_names, _dequantize, fp8_block_size, hf_name
from model.config import read_config_json
from model.safetensors_io import INDEX_NAME, SINGLE_NAME, read_tensors, write_tensors
from model.stored import quantization_config, quantize_tensors


def convert(src: str | Path, dst: str | Path, weights: str = "fp8", names: str = "native", force: bool = False,
            max_shard_bytes: int = 4 << 30, progress: bool = True) -> list[Path]:
    """Write the checkpoint at `src` to `dst` with `weights` `fp8` or `bf16` and `native` or `hf` tensor names;
    returns the safetensors files written. A non-empty `dst` is refused unless `force`."""
    src, dst = Path(src), Path(dst)
    if weights not in ("fp8", "bf16") or names not in ("native", "hf"):
        raise ValueError(f"weights must be fp8 or bf16 and names native or hf, got {weights!r}, {names!r}")
    if dst.exists() and any(dst.iterdir()):
        if not force:
            raise ValueError(f"{dst} exists and is not empty; pass --force to overwrite it")
        if dst.resolve() == src.resolve():
            raise ValueError("cannot convert a checkpoint onto itself")
        shutil.rmtree(dst)
    raw_config = read_config_json(src)
    block = fp8_block_size(raw_config)
    tensors = _canonical_names(read_tensors(src))
    dst.mkdir(parents=True, exist_ok=True)
    for file in src.iterdir():
        if file.is_file() and file.suffix != ".safetensors" and file.name not in (INDEX_NAME, "config.json"):
            shutil.copy2(file, dst / file.name)
    rename = hf_name if names == "hf" else (lambda name: name)
    shards, pending, pending_bytes = [], {}, 0
    for name in tqdm(sorted(tensors), desc=f"convert to {weights}", unit="tensor", file=sys.stderr,
                     disable=not progress):
        for out_name, value in _convert_one(name, tensors, weights, block).items():
            if pending and pending_bytes + value.nbytes > max_shard_bytes:
                shards.append(_write_part(dst, len(shards), pending))
                pending, pending_bytes = {}, 0
            pending[rename(out_name)] = value
            pending_bytes += value.nbytes
    if pending or not shards:
        shards.append(_write_part(dst, len(shards), pending))
    _write_config(dst, raw_config, weights, block)
    return _name_shards(dst, shards)


def _convert_one(name: str, tensors: dict[str, np.ndarray], weights: str, block) -> dict[str, np.ndarray]:
    """The output tensors of source tensor `name` (none for a scale: it goes with its weight)."""
    stem = name.removesuffix(".weight")
    if name.endswith(".scale") and not _HC_SITE.search(name) and name.removesuffix(".scale") + ".weight" in tensors:
        return {}
    pair = {name: tensors[name]}
    if name.endswith(".weight") and stem + ".scale" in tensors:
        pair[stem + ".scale"] = tensors[stem + ".scale"]
    value = _dequantize(pair, block)[name]
    if weights == "fp8":
        out = quantize_tensors({name: value}, block)
        if len(out) > 1:  # an FP8 linear or an FP4 expert, with its scale
            return out
    if name.endswith(".weight") and value.ndim >= 2 and np.issubdtype(value.dtype, np.floating):
        return {name: np.asarray(value, np.float32).astype(ml_dtypes.bfloat16)}
    return {name: np.asarray(value)}


def _write_part(dst: Path, index: int, tensors: dict[str, np.ndarray]) -> tuple[Path, list[str]]:
    path = dst / f"part-{index:05d}.safetensors"
    write_tensors(path, tensors)
    return path, sorted(tensors)


def _name_shards(dst: Path, shards: list[tuple[Path, list[str]]]) -> list[Path]:
    """Rename the written parts `model.safetensors`, or `model-0000i-of-0000N.safetensors` plus an index."""
    if len(shards) == 1:
        shards[0][0].rename(dst / SINGLE_NAME)
        return [dst / SINGLE_NAME]
    paths, weight_map = [], {}
    for i, (part, names) in enumerate(shards, 1):
        path = part.rename(dst / f"model-{i:05d}-of-{len(shards):05d}.safetensors")
        weight_map.update(dict.fromkeys(names, path.name))
        paths.append(path)
    total = sum(p.stat().st_size for p in paths)
    (dst / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                             indent=2) + "\n")
    return paths


def _write_config(dst: Path, raw_config: dict, weights: str, block: tuple[int, int]) -> None:
    """config.json of the output: DeepSeek's `quantization_config` and `expert_dtype` for fp8, none for bf16."""
    raw = {k: v for k, v in raw_config.items() if k not in ("quantization_config", "expert_dtype")}
    if weights == "fp8":
        raw |= quantization_config(block, fp4_experts=True)
    (dst / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
