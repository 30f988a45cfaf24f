"""Reference oracle: Hugging Face `transformers`' DeepSeek-V4 in fp32 on CPU.

Run with the oracle interpreter (Python 3.11, torch + transformers >= 5.23), never
imported by the project. Tests talk to it through files only (see
`tests/oracle_client.py`): configs as HF-style config.json, weights as safetensors,
tokens and logits as .npy.

Subcommands:
  init         build a random model from a config.json and `save_pretrained` it
  logits       load a model directory and write fp32 logits, full or cached forward
  dump-native  rewrite a saved model in DeepSeek's native tensor naming and check
               that HF reads it back bit-identically

Loading fails loudly (exit status 1, message on stderr) on missing, unexpected or
mismatched tensors, since a silently re-initialised weight would make any parity
test meaningless. Only `mtp.*` (multi-token-prediction) tensors may be unused.
"""

from __future__ import annotations

import argparse
import inspect
import json
import re
import shutil
import sys
from pathlib import Path
from typing import NoReturn

import numpy as np
import torch
from safetensors.torch import save_file
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf_v4
from transformers.utils import logging as hf_logging

IGNORED_CHECKPOINT_KEYS = re.compile(r"(^|\.)mtp\.")

# In-memory HF parameter names -> DeepSeek-native names: the inverse of the
# "deepseek_v4" renames in transformers/conversion_mapping.py. Applied in order to
# names that already lost their `model.` prefix. Routed experts are split
# separately (see `native_state_dict`).
NATIVE_RENAMES: list[tuple[str, str]] = [
    (r"^lm_head\.", "head."),
    (r"^embed_tokens\.", "embed."),
    (r"^hc_head\.hc_(fn|base|scale)$", r"hc_head_\1"),
    (r"\.input_layernorm\.", ".attn_norm."),
    (r"\.post_attention_layernorm\.", ".ffn_norm."),
    (r"\.(attn|ffn)_hc\.(fn|base|scale)$", r".hc_\1_\2"),
    (r"\.self_attn\.compressor\.indexer\.scorer\.weights_proj\.", ".attn.indexer.weights_proj."),
    (r"\.self_attn\.compressor\.indexer\.q_b_proj\.", ".attn.indexer.wq_b."),
    (r"\.self_attn\.compressor\.indexer\.", ".attn.indexer.compressor."),
    (r"\.self_attn\.", ".attn."),
    (r"\.mlp\.", ".ffn."),
    (r"\.shared_experts\.gate_proj\.", ".shared_experts.w1."),
    (r"\.shared_experts\.down_proj\.", ".shared_experts.w2."),
    (r"\.shared_experts\.up_proj\.", ".shared_experts.w3."),
    (r"\.gate\.e_score_correction_bias$", ".gate.bias"),
    (r"\.sinks$", ".attn_sink"),
    (r"\.position_bias$", ".ape"),
    (r"\.compressor\.kv_norm\.", ".compressor.norm."),
    (r"\.q_a_proj\.", ".wq_a."),
    (r"\.q_a_norm\.", ".q_norm."),
    (r"\.q_b_proj\.", ".wq_b."),
    (r"\.kv_proj\.", ".wkv."),
    (r"\.gate_proj\.", ".wgate."),
    (r"\.o_a_proj\.", ".wo_a."),
    (r"\.o_b_proj\.", ".wo_b."),
]


def fail(message: str) -> NoReturn:
    """Print `message` on stderr and exit with status 1."""
    print(f"hf_oracle: error: {message}", file=sys.stderr)
    sys.exit(1)


# ---------------------------------------------------------------------------- init


def randomise_defaults(model: DeepseekV4ForCausalLM, config: DeepseekV4Config) -> None:
    """Give random values to every tensor `_init_weights` leaves constant.

    Zero/one initialisations (attention sinks, compressor position biases, mHC
    base/scale, router correction bias, RMSNorm weights) and the all-zero hash
    table would hide whole code paths from a parity test. Draws use the global
    torch generator, so the result is a function of the seed set by the caller.
    """
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, hf_v4.DeepseekV4RMSNorm):
                module.weight.copy_(1.0 + 0.1 * torch.randn_like(module.weight))
            elif isinstance(module, hf_v4.DeepseekV4Attention):
                module.sinks.normal_(0.0, 1.0)
            elif isinstance(
                module,
                (hf_v4.DeepseekV4HCACompressor, hf_v4.DeepseekV4CSACompressor, hf_v4.DeepseekV4Indexer),
            ):
                module.position_bias.normal_(0.0, 0.5)
            elif isinstance(module, hf_v4.DeepseekV4HyperConnection):
                module.base.normal_(0.0, 0.5)
                module.scale.copy_(1.0 + 0.1 * torch.randn_like(module.scale))
            elif isinstance(module, hf_v4.DeepseekV4HyperHead):
                module.hc_base.normal_(0.0, 0.5)
                module.hc_scale.copy_(1.0 + 0.1 * torch.randn_like(module.hc_scale))
            elif isinstance(module, hf_v4.DeepseekV4TopKRouter):
                module.e_score_correction_bias.normal_(0.0, 0.1)
            elif isinstance(module, hf_v4.DeepseekV4HashRouter):
                module.tid2eid.copy_(random_hash_table(config.vocab_size, config.n_routed_experts, module.top_k))


def random_hash_table(vocab_size: int, n_experts: int, top_k: int) -> torch.Tensor:
    """Return an int64 [vocab_size, top_k] table of distinct expert ids per row."""
    return torch.rand(vocab_size, n_experts).argsort(dim=-1)[:, :top_k].contiguous()


def check_no_constant_tensors(model: DeepseekV4ForCausalLM) -> None:
    """Fail if any saved tensor with more than one element is constant."""
    constant = [
        name
        for name, tensor in model.state_dict().items()
        if tensor.numel() > 1 and bool((tensor == tensor.reshape(-1)[0]).all())
    ]
    if constant:
        fail(f"tensors still constant after randomisation: {constant}")


def cmd_init(args: argparse.Namespace) -> None:
    """`init`: random fp32 model from --config, saved with save_pretrained to --out."""
    config = DeepseekV4Config.from_json_file(args.config)
    torch.manual_seed(args.seed)
    model = DeepseekV4ForCausalLM(config).to(torch.float32).eval()
    randomise_defaults(model, config)
    check_no_constant_tensors(model)
    model.save_pretrained(args.out, safe_serialization=True)


# -------------------------------------------------------------------------- logits


def load_model(model_dir: Path) -> DeepseekV4ForCausalLM:
    """from_pretrained in fp32; fail on any missing/unexpected/mismatched tensor."""
    if not (model_dir / "config.json").is_file():
        fail(f"{model_dir} is not a model directory (no config.json)")
    model, info = DeepseekV4ForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, output_loading_info=True
    )
    problems = {
        "missing": sorted(info["missing_keys"]),
        "unexpected": sorted(k for k in info["unexpected_keys"] if not IGNORED_CHECKPOINT_KEYS.search(k)),
        "mismatched": sorted(str(k) for k in info["mismatched_keys"]),
        "errors": list(info["error_msgs"]),
    }
    problems = {kind: keys for kind, keys in problems.items() if keys}
    if problems:
        fail(f"loading {model_dir} did not match the model exactly: {json.dumps(problems, indent=1)}")
    return model.eval()


def cache_kwarg_name(model: DeepseekV4ForCausalLM) -> str:
    """Name of the forward's cache argument: `cache` (>= 5.24) or `past_key_values`."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def returned_cache(output):
    """The cache object of a forward output, under either field name."""
    cache = getattr(output, "cache", None)
    return cache if cache is not None else output.past_key_values


def full_logits(model: DeepseekV4ForCausalLM, tokens: torch.Tensor) -> torch.Tensor:
    """Logits [B, S, V] of one uncached forward."""
    with torch.no_grad():
        return model(input_ids=tokens, use_cache=False).logits


def cached_logits(model: DeepseekV4ForCausalLM, tokens: torch.Tensor, chunks: list[int]) -> torch.Tensor:
    """Logits [B, S, V] from prefill in `chunks`, then one token per step, via the HF cache."""
    seq_len = tokens.shape[1]
    if any(c <= 0 for c in chunks) or sum(chunks) > seq_len:
        fail(f"--cached-chunks {chunks} must be positive and sum to at most S={seq_len}")
    steps = chunks + [1] * (seq_len - sum(chunks))
    cache_name = cache_kwarg_name(model)
    cache, pieces, start = None, [], 0
    with torch.no_grad():
        for size in steps:
            output = model(
                input_ids=tokens[:, start : start + size],
                position_ids=torch.arange(start, start + size).unsqueeze(0),
                use_cache=True,
                **{cache_name: cache},
            )
            cache = returned_cache(output)
            pieces.append(output.logits)
            start += size
    return torch.cat(pieces, dim=1)


def parse_chunks(text: str) -> list[int]:
    """Parse '5,3,1' into [5, 3, 1]."""
    return [int(part) for part in text.split(",") if part.strip()]


def cmd_logits(args: argparse.Namespace) -> None:
    """`logits`: fp32 logits for --tokens ([B, S] ints), saved as float32 .npy."""
    tokens = np.load(args.tokens)
    if tokens.ndim != 2 or not np.issubdtype(tokens.dtype, np.integer):
        fail(f"--tokens must be an integer array [B, S], got {tokens.dtype} {tokens.shape}")
    tokens = torch.from_numpy(tokens.astype(np.int64))
    model = load_model(args.model)
    if args.cached_chunks is None:
        logits = full_logits(model, tokens)
    else:
        logits = cached_logits(model, tokens, args.cached_chunks)
    np.save(args.out, logits.to(torch.float32).numpy())


# --------------------------------------------------------------------- dump-native


def native_name(hf_name: str) -> str:
    """DeepSeek-native name of one in-memory HF parameter/buffer name."""
    name = re.sub(r"^model\.", "", hf_name)
    for pattern, replacement in NATIVE_RENAMES:
        name = re.sub(pattern, replacement, name)
    return name


def native_state_dict(model: DeepseekV4ForCausalLM) -> dict[str, torch.Tensor]:
    """The model's weights in DeepSeek-native naming, routed experts split per expert.

    `experts.gate_up_proj` [E, 2I, D] is cat(w1, w3) along dim 1 and
    `experts.down_proj` [E, D, I] stacks w2, as in conversion_mapping.
    """
    native: dict[str, torch.Tensor] = {}
    for hf_name, tensor in model.state_dict().items():
        name = native_name(hf_name)
        match = re.fullmatch(r"(.*\.experts)\.(gate_up_proj|down_proj)", name)
        if match is None:
            native[name] = tensor.contiguous()
            continue
        experts, fused = match.groups()
        for expert, weight in enumerate(tensor):
            if fused == "gate_up_proj":
                w1, w3 = weight.chunk(2, dim=0)
                native[f"{experts}.{expert}.w1.weight"] = w1.contiguous()
                native[f"{experts}.{expert}.w3.weight"] = w3.contiguous()
            else:
                native[f"{experts}.{expert}.w2.weight"] = weight.contiguous()
    return native


def check_same_logits(model: DeepseekV4ForCausalLM, model_dir: Path) -> None:
    """Fail unless `model_dir` loads to bit-identical full-forward logits as `model`."""
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model.config.vocab_size, (2, 40), generator=generator)
    expected = full_logits(model, tokens)
    reloaded = full_logits(load_model(model_dir), tokens)
    if not torch.equal(expected, reloaded):
        diff = (expected - reloaded).abs().max().item()
        fail(f"{model_dir} loads differently from the source model: max |logit diff| = {diff}")


def cmd_dump_native(args: argparse.Namespace) -> None:
    """`dump-native`: --model rewritten in native naming to --out, checked by reloading."""
    model = load_model(args.model)
    args.out.mkdir(parents=True, exist_ok=True)
    save_file(native_state_dict(model), str(args.out / "model.safetensors"), metadata={"format": "pt"})
    shutil.copyfile(args.model / "config.json", args.out / "config.json")
    check_same_logits(model, args.out)


# ---------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    """Command-line interface."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    init = sub.add_parser("init", help="random model from a config.json, saved with save_pretrained")
    init.add_argument("--config", type=Path, required=True, help="HF-style config.json")
    init.add_argument("--out", type=Path, required=True, help="output model directory")
    init.add_argument("--seed", type=int, required=True)
    init.set_defaults(func=cmd_init)

    logits = sub.add_parser("logits", help="fp32 logits of a saved model")
    logits.add_argument("--model", type=Path, required=True, help="model directory (HF or native names)")
    logits.add_argument("--tokens", type=Path, required=True, help=".npy int array [B, S]")
    logits.add_argument("--out", type=Path, required=True, help=".npy float32 logits [B, S, V]")
    logits.add_argument(
        "--cached-chunks",
        type=parse_chunks,
        default=None,
        help="comma-separated prefill chunk sizes; remaining tokens are decoded one at a time",
    )
    logits.set_defaults(func=cmd_logits)

    native = sub.add_parser("dump-native", help="rewrite a saved model in DeepSeek-native naming")
    native.add_argument("--model", type=Path, required=True, help="model directory saved by `init`")
    native.add_argument("--out", type=Path, required=True, help="output directory")
    native.set_defaults(func=cmd_dump_native)
    return parser


def main() -> None:
    """Entry point."""
    args = build_parser().parse_args()
    hf_logging.disable_progress_bar()
    args.func(args)


if __name__ == "__main__":
    main()
