"""Checkpoint I/O: DeepSeek-V4 safetensors (native or HF `model.`-prefixed names; fp32 / bf16 / FP8 / FP4).

Our parameter paths are the native tensor names (`layers.3.attn.wq_a.weight`, `.scale`), except two spellings:
mHC sites are modules (`hc_attn.fn` is stored as `hc_attn_fn`) and routed experts are stacked
(`ffn.experts.w1` [E, I, D] is stored per expert as `ffn.experts.{e}.w1.weight`, and a packed FP4 stack's
`ffn.experts.w1_scale` as `ffn.experts.{e}.w1.scale`).

Weights in memory (`WEIGHTS`): `checkpoint` keeps FP8 linears and packed FP4 experts as stored (decoded inside
their matmuls, `model.stored`) and every other tensor in the checkpoint's own float type; `bfloat16` and
`float32` decode them at load (exactly, for bf16: an E4M3 or E2M1 value times a power of two is a bf16 number).
"""

from __future__ import annotations

import dataclasses
import json
import re
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from model.api import Model, abstract_model, engram_table, resolve_dtype
from model.config import ModelConfig, config_from_dict, read_config_json
from model.config_v41 import V41Config
from model.dspark import DSparkConfig, DSparkDrafter, Drafter, checkpoint_name
from model.engram import EngramMemory, canonical_vocab, table_names
from model.host_layout import checkpoint_layout
from model.linear import Fp8Linear
from model.moe import Fp4Experts
from model.quant import dequant_fp4_packed, dequant_fp8_blocks
from model.safetensors_io import INDEX_NAME, read_tensors, write_sharded, write_tensors
from model.stored import E4M3, E8M0, as_stored, quantization_config, quantize_tensors, rule_names, stored_names
from model.tokenizer import TextTokenizer

BUNDLED = Path(__file__).with_name("bundled")  # the bundled default model's checkpoint directory
DSPARK_CONFIG, DSPARK_FILE = "dspark.json", "dspark.safetensors"  # a drafter saved beside a checkpoint

_HC_SITE = re.compile(r"(hc_attn|hc_ffn|hc_head)\.(fn|base|scale)$")
_EXPERTS = re.compile(r"^(.*\.experts)\.(w[123])(_scale)?$")
_EXPERT_FILE = re.compile(r"^(.*\.experts)\.(\d+)\.(w[123])\.(weight|scale)$")
WEIGHTS = ("checkpoint", "bfloat16", "float32")  # resident formats of a loaded model
PARTS = ("all", "prefill")  # what of a model `load_model` loads
_LAYER = re.compile(r"^layers\.(\d+)\.")
# transformers' save_pretrained keeps a few of its own spellings (checked with transformers 5.24)
_HF_RENAMES = {"embed_tokens.weight": "embed.weight", "lm_head.weight": "head.weight",
               "hc_head.hc_fn": "hc_head_fn", "hc_head.hc_base": "hc_head_base", "hc_head.hc_scale": "hc_head_scale"}
_HF_KV_NORM = re.compile(r"^((?:mtp|layers)\.\d+)\.attn\.norm\.weight$")
_NATIVE_KV_NORM = re.compile(r"^((?:mtp|layers)\.\d+)\.attn\.kv_norm\.weight$")
_SHARED_COPY = re.compile(r"mtp\.\d+\.(embed|head)\.weight")
_DSPARK_PART = re.compile(r"^mtp\.\d+\.(main_proj|main_norm|markov_head|confidence_head)\.")


class CheckpointError(ValueError):
    """A checkpoint that does not match the model its config.json describes."""


def native_name(path: tuple) -> str:
    """The checkpoint name of a parameter path (stacked experts keep the `experts.w1` form)."""
    return _HC_SITE.sub(r"\1_\2", ".".join(str(p) for p in path))


def _expected(params, rename=lambda name: name) -> dict[str, tuple[tuple, tuple[int, ...], np.dtype]]:
    """name -> (param path, shape, dtype) for every parameter of an (abstract) parameter state; `rename` maps
    native names to the checkpoint's (a drafter's `mtp.*`)."""
    return {rename(native_name(path)): (path, tuple(v.shape), v.dtype) for path, v in nnx.to_flat_state(params)}


def to_native(model: Model | Drafter) -> dict[str, np.ndarray]:
    """The parameters as a dict of checkpoint tensor names to host arrays (experts split per expert)."""
    rename = lambda name: name  # noqa: E731
    if isinstance(model, Model):
        model = checkpoint_layout(model)  # weights an engine holds transposed (`model.host_layout`)
    if isinstance(model, Drafter):
        rename = _drafter_name(model.config, model.module().single_pass)
    out = {}
    for path, var in nnx.to_flat_state(model.params):
        name, value = rename(native_name(path)), np.asarray(var.get_value())
        if m := _EXPERTS.match(name):
            for e in range(value.shape[0]):
                out[f"{m[1]}.{e}.{m[2]}.{'scale' if m[3] else 'weight'}"] = value[e]
        else:
            out[name] = value
    return out


def _canonical_names(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Strip the HF `model.` prefix and map the names transformers writes differently onto native ones."""
    out = {}
    for name, value in tensors.items():
        name = name.removeprefix("model.")
        name = _HF_RENAMES.get(name, name)
        name = _HF_KV_NORM.sub(r"\1.attn.kv_norm.weight", name)
        if name in out:
            raise CheckpointError(f"tensor {name} appears twice (with and without the `model.` prefix)")
        out[name] = value
    return out


def hf_name(name: str) -> str:
    """The name transformers' `save_pretrained` gives a native tensor (the inverse of `_canonical_names`)."""
    name = {native: hf for hf, native in _HF_RENAMES.items()}.get(name, name)
    name = _NATIVE_KV_NORM.sub(r"\1.attn.norm.weight", name)
    return name if name == "lm_head.weight" else "model." + name


def fp8_block_size(raw_config: dict) -> tuple[int, int]:
    """`quantization_config.weight_block_size` of a checkpoint's config.json (V4: 128x128, V4.1: 32x32)."""
    quant = raw_config.get("quantization_config") or {}
    block = quant.get("weight_block_size", (128, 128))
    if len(block) != 2 or min(block) <= 0:
        raise CheckpointError(f"quantization_config.weight_block_size must be two positive ints, got {block}")
    return int(block[0]), int(block[1])


def _dequantize(tensors: dict[str, np.ndarray], block: tuple[int, int], keep=frozenset()
                ) -> dict[str, np.ndarray]:
    """Replace every `X.weight` + `X.scale` pair (FP8 blocks or packed FP4) by a float32 `X.weight`, except the
    pairs of the FP8 linears and expert stacks named in `keep` (module paths, `stored_names`)."""
    out = dict(tensors)
    for scale_name in [n for n in tensors if n.endswith(".scale") and not _HC_SITE.search(n)]:
        if _module_path(scale_name) in keep:
            continue
        weight_name = scale_name.removesuffix(".scale") + ".weight"
        if weight_name not in tensors:
            raise CheckpointError(f"{scale_name} has no matching {weight_name}")
        w, scale = tensors[weight_name], out.pop(scale_name)
        try:
            if w.dtype == ml_dtypes.float8_e4m3fn:
                out[weight_name] = dequant_fp8_blocks(w, scale, block)
            elif w.dtype in (np.int8, np.uint8):
                out[weight_name] = dequant_fp4_packed(w, scale, block=2 * w.shape[1] // scale.shape[1])
            else:
                raise CheckpointError(f"{weight_name} has a scale but dtype {w.dtype} (expected FP8 or packed FP4)")
        except (TypeError, ValueError, ZeroDivisionError) as e:
            raise CheckpointError(f"cannot dequantize {weight_name} {w.dtype}{list(w.shape)} with scale "
                                  f"{list(scale.shape)}: {e}") from None
    return out


def _module_path(name: str) -> str:
    """The module path a `.weight` / `.scale` tensor belongs to; per-expert tensors name their stack."""
    if m := _EXPERT_FILE.match(name):
        return f"{m[1]}.{m[3]}"
    return name.rsplit(".", 1)[0]


def _stack_experts(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Gather per-expert `experts.{e}.wN.weight` (and `.scale`) tensors into stacked `experts.wN` (and
    `experts.wN_scale`) arrays."""
    groups: dict[str, dict[int, np.ndarray]] = {}
    out = {}
    for name, value in tensors.items():
        if m := _EXPERT_FILE.match(name):
            groups.setdefault(f"{m[1]}.{m[3]}" + ("_scale" if m[4] == "scale" else ""), {})[int(m[2])] = value
        else:
            out[name] = value
    for name, per_expert in groups.items():
        ids = sorted(per_expert)
        if ids != list(range(len(ids))):
            missing = sorted(set(range(max(ids) + 1)) - set(ids))
            raise CheckpointError(f"{name}: expert tensors {missing} are missing")
        odd = [e for e in ids if per_expert[e].shape != per_expert[0].shape]
        if odd:
            shown, _ = _per_expert(name, ())
            raise CheckpointError(f"tensor {shown.replace('.0.', f'.{odd[0]}.')} has shape "
                                  f"{list(per_expert[odd[0]].shape)}; expert 0's has {list(per_expert[0].shape)}")
        out[name] = np.stack([np.asarray(per_expert[e]) for e in ids])
    return out


def _drop_missing_mtp(config: ModelConfig, tensors: dict, drafter: bool) -> ModelConfig:
    """The V4 config without MTP blocks when the checkpoint has no `mtp.*` block tensors: HF-saved checkpoints
    carry none (a warning says so), and V4-Flash-0731's `mtp.*` are a DSpark drafter (`drafter`: loaded
    apart, its tensors already taken out of `tensors`)."""
    if config.num_nextn_predict_layers and not any(n.startswith("mtp.") for n in tensors):
        if not drafter:
            warnings.warn("checkpoint has no mtp.* tensors; loading without MTP blocks", stacklevel=3)
        n = config.num_hidden_layers
        return dataclasses.replace(config, num_nextn_predict_layers=0, compress_ratios=config.compress_ratios[:n])
    return config


def default_weights(quantized: bool) -> str:
    """The resident format of a checkpoint loaded without `weights`: a quantized one stays as stored on GPUs
    (FP8 / FP4 matmuls pay there) and becomes bf16 on other platforms (XLA:CPU decodes FP8 and FP4 inside a
    matmul ten times slower than it reads bf16; reference/quantized-weights.md (d)); float ones load as fp32."""
    if not quantized:
        return "float32"
    return "checkpoint" if jax.default_backend() == "gpu" else "bfloat16"


def load_model(path: str | Path | None = None, weights: str | None = None, engram_placement: str = "host",
               dtype: str | None = None, part: str = "all") -> Model:
    """Load a DeepSeek-V4 or V4.1 checkpoint directory (config.json + safetensors) into a Model; without a path,
    the bundled default model (`model/bundled/`: a toy V4.1 trained on Shakespeare, see its README).

    `weights`: the resident format (`WEIGHTS`; default `default_weights`); `dtype` is its other name (the
    CLI's `--dtype`, vLLM's), `auto` the default. The directory's tokenizer.json, when there is one, becomes
    `model.tokenizer`. V4.1 Engram tables stay in their stored format (FP8 rows + scales) in host memory or on
    the device; their canonical token ids come from the tokenizer.json.

    `part`: `all`, or `prefill` for a V4.1 model's first `n_prefill_layer` layers alone
    (`V41Config.prefill_part`: the layers a prefill side of an asymmetric P/D split runs; no drafter), whose
    other tensors are never read.
    """
    weights = _weights_or_dtype(weights, dtype)
    path = BUNDLED if path is None else Path(path)
    plan = _plan(path, weights, part)
    layout, config = plan.layout, plan.config
    drafter = None
    if plan.drafter_tensors is not None:
        drafter = _load_drafter(config, plan.raw_config, path,
                                _stack_experts(_dequantize(plan.drafter_tensors, layout.block)),
                                layout.dtype)
    model = layout.model(config)
    tensors = _stack_experts(_dequantize(plan.tensors, layout.block, layout.fp8 | layout.fp4))
    _fill(model.params, _expected(model.params), tensors, path)
    engram = _engram_memory(config, path, plan.tables, engram_placement) if plan.tables else None
    tokenizer = TextTokenizer.from_file(path / "tokenizer.json") if (path / "tokenizer.json").exists() else None
    if tokenizer is not None and tokenizer.vocab_size > config.vocab_size:
        raise CheckpointError(f"{path / 'tokenizer.json'} has {tokenizer.vocab_size} ids; the model's vocabulary "
                              f"has {config.vocab_size}")
    return Model(nnx.merge(model.graphdef, model.params), tokenizer=tokenizer, engram=engram, drafter=drafter)


def _weights_or_dtype(weights: str | None, dtype: str | None) -> str | None:
    """`load_model`'s resident format from `weights` and its alias `dtype` (None or `auto`: the default)."""
    if dtype is None:
        return weights
    if dtype != "auto" and dtype not in WEIGHTS:
        raise ValueError(f"dtype must be auto or one of {WEIGHTS}, got {dtype!r}")
    dtype = None if dtype == "auto" else dtype
    if weights is not None and weights != dtype:
        raise ValueError(f"weights={weights!r} and dtype={dtype or 'auto'!r} disagree: dtype is weights' other "
                         "name, give one of them")
    return dtype


def checkpoint_model(path: str | Path, weights: str | None = None) -> Model:
    """The abstract model (shapes and dtypes, nothing read but headers) `load_model(path, weights)` fills."""
    plan = _plan(Path(path), weights)
    return plan.layout.model(plan.config)


@dataclasses.dataclass(frozen=True)
class Layout:
    """How a model holds its weights: the float type of its float tensors and, in the stored form, its FP8
    linears and FP4 expert stacks (module paths, `model.stored`); `block`: the checkpoint's FP8 block."""

    dtype: str
    fp8: frozenset = frozenset()
    fp4: frozenset = frozenset()
    block: tuple[int, int] = (128, 128)

    def model(self, config) -> Model:
        """The abstract model (shapes and dtypes, nothing allocated) of `config` in this layout."""
        model = abstract_model(config, self.dtype)
        if not (self.fp8 or self.fp4):
            return model
        module = model.module()
        as_stored(module, self.fp8, self.fp4, self.block)
        return Model(module)


def layout_for(config, weights: str) -> Layout:
    """The layout of a model of `config` in format `weights` (`WEIGHTS`) as DeepSeek ships it: `checkpoint`
    holds the FP8 linears and FP4 experts of `model.stored`'s rules (FP8 blocks 128x128, V4.1's 32x32) and
    bf16 elsewhere."""
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {WEIGHTS}, got {weights!r}")
    if weights != "checkpoint":
        return Layout(weights)
    block = (32, 32) if isinstance(config, V41Config) else (128, 128)
    return Layout("bfloat16", *map(frozenset, rule_names(abstract_model(config, "bfloat16").module())), block)


@dataclasses.dataclass
class _Plan:
    config: object
    raw_config: dict
    tensors: dict  # canonical names, memory-mapped, as stored
    drafter_tensors: dict | None  # the `mtp.*` tensors of a DSpark drafter, when the checkpoint has one
    tables: dict  # V4.1 Engram tables
    layout: Layout


def _plan(path: Path, weights: str | None, part: str = "all") -> _Plan:
    """What a checkpoint directory loads into, read off its config.json and safetensors headers (`part`: see
    `load_model`)."""
    raw_config = read_config_json(path)
    config = config_from_dict(raw_config)
    tensors = _canonical_names(read_tensors(path))
    if part not in PARTS:
        raise ValueError(f"part must be one of {PARTS}, got {part!r}")
    if part == "prefill":
        if not isinstance(config, V41Config):
            raise ValueError("part='prefill' needs a causal encoder-decoder (V4.1) model; this one is V4")
        config = config.prefill_part()
        tensors = {n: t for n, t in tensors.items() if not n.startswith("mtp.") and not (
            (m := _LAYER.match(n)) and int(m.group(1)) >= config.num_hidden_layers)}
    tables = {}
    if isinstance(config, V41Config):
        tensors = _drop_unsupported_v41(tensors)
        for layer in config.engram_layer_ids:
            names = table_names(layer)
            if names[0] not in tensors:
                raise CheckpointError(f"checkpoint {path} lacks the Engram table {names[0]} with shape "
                                      f"[{config.engram_num_embeddings[config.engram_layer_ids.index(layer)]}, "
                                      f"{config.engram_head_dim}]")
            tables[layer] = (tensors.pop(names[0]), tensors.pop(names[1], None))
    quantized = any(n.endswith(".scale") and not _HC_SITE.search(n) for n in tensors)
    weights = weights or default_weights(quantized)
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {WEIGHTS}, got {weights!r}")
    drafter_tensors = None
    if isinstance(config, V41Config) or any(_DSPARK_PART.match(n) for n in tensors):
        drafter_tensors = {n: tensors.pop(n) for n in list(tensors) if n.startswith("mtp.")}
    if isinstance(config, ModelConfig):
        config = _drop_missing_mtp(config, tensors, drafter_tensors is not None)
    layout = Layout(weights if weights != "checkpoint" else _stored_float_type(tensors),
                    block=fp8_block_size(raw_config))
    if weights == "checkpoint":
        layout = dataclasses.replace(layout, **dict(zip(("fp8", "fp4"), map(frozenset, stored_names(tensors)))))
    return _Plan(config, raw_config, tensors, drafter_tensors, tables, layout)


def _stored_float_type(tensors: dict[str, np.ndarray]) -> str:
    """The float type a checkpoint's unquantized matrices load in, as stored: bf16 when its embedding is."""
    embed = tensors.get("embed.weight")
    return "bfloat16" if embed is not None and embed.dtype == ml_dtypes.bfloat16 else "float32"


def _fill(params, expected: dict, tensors: dict[str, np.ndarray], path: Path) -> None:
    """Set every parameter of an abstract parameter state from `tensors`, which must hold exactly `expected`."""
    missing = sorted(set(expected) - set(tensors))
    if missing:
        name = missing[0]
        raise CheckpointError(f"checkpoint {path} lacks {len(missing)} tensor(s), e.g. {_show(name, expected)}")
    unexpected = sorted(set(tensors) - set(expected))
    if unexpected:
        raise CheckpointError(f"checkpoint {path} has {len(unexpected)} unexpected tensor(s): {unexpected[:5]}")
    pure = nnx.to_pure_dict(params)
    for name, (param_path, shape, dtype_) in expected.items():
        value = tensors[name]
        if tuple(value.shape) != shape:
            shown, expected_shape = _per_expert(name, shape)
            raise CheckpointError(f"tensor {shown} has shape {list(value.shape[len(shape) - len(expected_shape):])}"
                                  f"; expected {list(expected_shape)}")
        node = pure
        for key in param_path[:-1]:
            node = node[key]
        node[param_path[-1]] = _as_param(name, np.asarray(value), np.dtype(dtype_))
    nnx.replace_by_pure_dict(params, pure)


def _as_param(name: str, value: np.ndarray, dtype: np.dtype) -> jax.Array:
    """A tensor as the parameter's dtype: floats through float32 (exact for the float types checkpoints hold),
    integers converted, stored formats (E4M3, UE8M0, packed FP4 bytes) only as themselves."""
    if dtype in (np.float32, ml_dtypes.bfloat16):
        return jnp.asarray(value.astype(np.float32), dtype)
    if dtype == np.int8 and value.dtype == np.uint8:  # packed FP4 stored as unsigned bytes
        value = value.view(np.int8)
    if dtype in (E4M3, E8M0, np.int8) and value.dtype != dtype:
        raise CheckpointError(f"tensor {name} has dtype {value.dtype}; expected {dtype}")
    return jnp.asarray(value, dtype)


def _drop_unsupported_v41(tensors: dict) -> dict:
    """V4.1 checkpoints also carry vision weights, which this text model does not run."""
    skipped = [n for n in tensors if n.split(".")[0] in ("vision", "aligner") or n.startswith("image_")]
    if skipped:
        warnings.warn(f"skipping {len(skipped)} vision tensors (e.g. {skipped[0]})", stacklevel=3)
    return {n: v for n, v in tensors.items() if n not in set(skipped)}


def _drafter_name(config: DSparkConfig, v41: bool):
    return lambda name: checkpoint_name(name, config.num_layers, v41)


def _load_drafter(config: V41Config | ModelConfig, raw_config: dict, path: Path, tensors: dict[str, np.ndarray],
                  dtype: str) -> Drafter | None:
    """The checkpoint's DSpark drafter from its `mtp.*` tensors, sized by a `dspark.json` beside config.json
    (a drafter added to a checkpoint, or STS temperatures) or else by config.json's `dspark_*` fields (a V4
    checkpoint's stages counted from its tensors)."""
    if not tensors:
        return None
    if (path / DSPARK_CONFIG).exists():
        dspark = DSparkConfig.from_json(path / DSPARK_CONFIG)
    elif isinstance(config, ModelConfig):
        dspark = DSparkConfig.from_v4(raw_config, config, len({n.split(".")[1] for n in tensors}))
    elif config.num_nextn_predict_layers and config.dspark_target_layer_ids:
        dspark = DSparkConfig.from_v41(config)
    else:
        warnings.warn(f"skipping {len(tensors)} DSpark tensors: config.json describes no drafter "
                      "(num_nextn_predict_layers, dspark_target_layer_ids)", stacklevel=3)
        return None
    # some exports repeat the shared embedding and head under mtp.*: the drafter uses the target's own
    tensors = {n: v for n, v in tensors.items() if not _SHARED_COPY.fullmatch(n)}
    module = nnx.eval_shape(lambda: DSparkDrafter(config, dspark, nnx.Rngs(0), resolve_dtype(dtype)))
    graphdef, params = nnx.split(module)
    _fill(params, _expected(params, _drafter_name(dspark, isinstance(config, V41Config))), tensors, path)
    return Drafter(nnx.merge(graphdef, params))


def save_drafter(drafter: Drafter, path: str | Path) -> None:
    """Write a drafter beside a checkpoint: dspark.json (its config) and dspark.safetensors (`mtp.*` names)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    drafter.config.save_json(path / DSPARK_CONFIG)
    tensors = to_native(drafter)
    write_tensors(path / DSPARK_FILE, tensors)
    index = path / INDEX_NAME
    if index.exists():  # a sharded checkpoint reads only the files its index names
        raw = json.loads(index.read_text())
        raw["weight_map"] = {**raw["weight_map"], **dict.fromkeys(tensors, DSPARK_FILE)}
        index.write_text(json.dumps(raw, indent=2) + "\n")


def _engram_memory(config, path: Path, tables: dict, placement: str):
    """The Engram lookup of a loaded V4.1 model: canonical ids from tokenizer.json, the loaded tables."""
    if (path / "tokenizer.json").exists():
        token_map = canonical_vocab(path / "tokenizer.json")
    else:
        token_map = EngramMemory.identity_map(config)
    for layer, (weight, scale) in tables.items():
        rows = config.engram_num_embeddings[config.engram_layer_ids.index(layer)]
        if tuple(weight.shape) != (rows, config.engram_head_dim):
            raise CheckpointError(f"Engram table {table_names(layer)[0]} has shape {list(weight.shape)}; "
                                  f"expected {[rows, config.engram_head_dim]}")
    return EngramMemory(config, token_map, [engram_table(weight, scale, placement)
                                            for weight, scale in tables.values()])


def _per_expert(name: str, shape: tuple) -> tuple[str, tuple]:
    """A parameter's checkpoint tensor name and shape: an expert stack's first expert's."""
    if m := _EXPERTS.match(name):
        return f"{m[1]}.0.{m[2]}.{'scale' if m[3] else 'weight'}", shape[1:]
    return name, shape


def _show(name: str, expected: dict) -> str:
    _, shape, dtype = expected[name]
    name, shape = _per_expert(name, shape)
    return f"{name} with shape {list(shape)} ({np.dtype(dtype).name})"


def to_stored(model: Model, block: tuple[int, int] = (128, 128)) -> Model:
    """The model with its linears and experts in DeepSeek's stored form (`model.stored`: FP8 blocks of
    `block`, packed FP4 experts, UE8M0 scales), the rest as it is."""
    if model.drafter is not None or model.engram is not None:
        raise ValueError("only V4 models without a drafter convert to the stored form in memory")
    tensors = _stack_experts(quantize_tensors(to_native(model), block))
    layout = Layout(str(model.module().embed.weight.dtype), *map(frozenset, rule_names(model.module())), block)
    stored = layout.model(model.config)
    _fill(stored.params, _expected(stored.params), tensors, Path("(in memory)"))
    return Model(nnx.merge(stored.graphdef, stored.params), tokenizer=model.tokenizer)


def _describe_quantization(path: Path, model: Model) -> None:
    """Add DeepSeek's `quantization_config` (and `expert_dtype`) to a saved config.json when the model holds
    FP8 linears (or packed FP4 experts)."""
    module = model.module()
    blocks = {sub.block for _, sub in nnx.iter_modules(module) if isinstance(sub, Fp8Linear)}
    fp4 = any(isinstance(sub, Fp4Experts) for _, sub in nnx.iter_modules(module))
    if not blocks and not fp4:
        return
    if len(blocks) > 1:
        raise CheckpointError(f"the model's FP8 linears use different blocks {sorted(blocks)}; a checkpoint has one")
    raw = json.loads((path / "config.json").read_text())
    raw |= quantization_config(blocks.pop() if blocks else (128, 128), fp4)
    (path / "config.json").write_text(json.dumps(raw, indent=2) + "\n")


def save_checkpoint(model: Model, path: str | Path, max_shard_bytes: int = 4 << 30) -> None:
    """Write config.json and the native-layout safetensors (sharded above `max_shard_bytes`), and the model's
    drafter, if any, beside them (`save_drafter`)."""
    if model.drafter is not None and isinstance(model.config, ModelConfig) and model.config.num_nextn_predict_layers:
        raise CheckpointError("a V4 checkpoint names both MTP blocks and a DSpark drafter mtp.*, so it can hold only "
                              "one of them; this model has both (set model.drafter = None, or load the target "
                              "without its MTP block)")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.config.save_json(path)
    tensors = to_native(model)
    _describe_quantization(path, model)
    if model.engram is not None:
        for layer, table in zip(model.config.engram_layer_ids, model.engram.tables):
            weight_name, scale_name = table_names(layer)
            tensors[weight_name] = np.asarray(table.weight)
            if table.scale is not None:
                tensors[scale_name] = np.asarray(table.scale)
    write_sharded(path, tensors, max_shard_bytes)
    if model.drafter is not None:
        save_drafter(model.drafter, path)
