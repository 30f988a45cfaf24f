"""`jaxseek` command line: model facts (`info`) and a forward pass over a prompt (`forward`)."""

import argparse
import json
import sys
import time

import numpy as np


def _load(args):
    from model.api import init_model
    from model.checkpoint import load_model
    from model.config import preset

    if args.model:
        return load_model(args.model, dtype=args.dtype)
    return init_model(preset(args.config), seed=args.seed, dtype=args.dtype)


def cmd_info(args) -> int:
    """Print parameter and KV-cache figures of a preset or a checkpoint's config."""
    from model.config import load_config, preset
    from model.config_v41 import V41Config
    from model.stats import model_stats, v41_stats

    if args.engram_vocab:
        from model.engram import canonical_vocab

        token_map = canonical_vocab(args.engram_vocab)
        stats = {"tokenizer": args.engram_vocab, "vocab_size": len(token_map),
                 "canonical_vocab_size": int(token_map.max()) + 1}
    else:
        config = load_config(args.model) if args.model else preset(args.config)
        figures = v41_stats(config) if isinstance(config, V41Config) else model_stats(config, args.dtype)
        stats = {"config": args.model or args.config, **figures}
    if args.json:
        print(json.dumps(stats))
    else:
        for key, value in stats.items():
            print(f"{key:>30}: {value:,}" if isinstance(value, (int, float)) else f"{key:>30}: {value}")
    return 0


def cmd_forward(args) -> int:
    """Run the full-sequence forward on token ids and print the greedy next token of each position."""
    model = _load(args)
    tokens = np.array([[int(t) for t in args.tokens.split(",")]], np.int32)
    start = time.perf_counter()
    logits = np.asarray(model.logits(tokens))
    elapsed = time.perf_counter() - start
    print(json.dumps({"tokens": tokens[0].tolist(), "argmax": logits[0].argmax(-1).tolist(),
                      "logits_shape": list(logits.shape), "seconds_incl_compile": round(elapsed, 3)}))
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="jaxseek", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, fn in (("info", cmd_info), ("forward", cmd_forward)):
        p = sub.add_parser(name, help=fn.__doc__)
        p.set_defaults(fn=fn)
        p.add_argument("--config", default="tiny",
                       help="preset name (tiny, small, v4-flash, v4-pro, tiny-v41, v41-flash)")
        p.add_argument("--model", help="checkpoint directory (overrides --config)")
        p.add_argument("--dtype", default="bfloat16" if name == "info" else "float32",
                       choices=["float32", "bfloat16"])
    sub.choices["info"].add_argument("--json", action="store_true", help="one JSON object on stdout")
    sub.choices["info"].add_argument("--engram-vocab", metavar="TOKENIZER_JSON",
                                     help="print the Engram canonical vocabulary size of a tokenizer.json")
    sub.choices["forward"].add_argument("--tokens", default="0,5,17,42,7,99,3,12", help="comma-separated ids")
    sub.choices["forward"].add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        return args.fn(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"jaxseek {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
