"""Seconds to get six step buckets of `jaxseek serve --max-model-len 4096 --max-num-seqs 8` (the bundled model)
ready, by the way each is found: compiled cold, through JAX's persistent cache alone (traced, lowered, then
served), loaded from the executable cache, and, for the two prefill buckets, as a stored lowered program
(`jax.export`, needs `flatbuffers`) compiled on load through JAX's persistent cache. Each way runs in a fresh
process on one fresh cache directory; prints one JSON line.

    .venv/bin/python scripts/startup_paths.py [--cache DIR]
"""

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time

BUCKETS = [(1, 1, 1, 16), (2, 1, 1, 16), (1, 64, 1, 16), (2, 64, 1, 16), (1, 64, 1, 64), (8, 1, 1, 64)]
EXPORTED = BUCKETS[2:4]  # prefill buckets: one program each


def engine(cache: str):
    import jax

    jax.config.update("jax_compilation_cache_dir", cache)
    from jaxseek import cli
    from jaxseek.flags import engine_config
    from serving.core.engine import Engine

    args = cli.build_parser().parse_args(["serve", "--max-model-len", "4096", "--max-num-seqs", "8"])
    cli._setup_platform(args)
    return Engine(cli._load(args), engine_config(args, num_top_logprobs=args.max_logprobs))


def buckets(cache: str) -> dict:
    """Seconds of each bucket's `_executable` (compiled or loaded, whichever the cache allows)."""
    e = engine(cache)
    seconds = {}
    for bucket in BUCKETS:
        start = time.perf_counter()
        e._executable(bucket)
        seconds[str(bucket)] = round(time.perf_counter() - start, 2)
    return {"total_s": round(sum(seconds.values()), 2), "per_bucket_s": seconds, "loaded": e.executables.loaded}


def exported(cache: str) -> dict:
    """Per prefill bucket: seconds to export its step, to compile the exported program the first time, and to
    deserialize and compile it again (JAX's persistent cache serving it), and the serialized bytes."""
    import jax
    from jax import export

    from serving.base.sampling import SamplingBatch
    from serving.core.step import StepBatch, StepOutput, abstract_shapes, empty_batch

    for kind in (StepBatch, StepOutput, SamplingBatch):
        export.register_namedtuple_serialization(kind, serialized_name=kind.__name__)
    e = engine(cache)
    out = {}
    for rows, width, verify, pages in EXPORTED:
        shapes = abstract_shapes((e.weights, e.cache, empty_batch(e.layout, rows, width, e._engram_shapes(), verify,
                                                                  pages)))
        start = time.perf_counter()
        blob = export.export(jax.jit(e._halves.step, donate_argnums=1, static_argnums=3))(*shapes, verify).serialize()
        made = time.perf_counter() - start
        times = []
        for _ in range(2):
            jax.clear_caches()
            start = time.perf_counter()
            jax.jit(lambda *a: export.deserialize(blob).call(*a), donate_argnums=1).lower(*shapes).compile()
            times.append(time.perf_counter() - start)
        out[str((rows, width, verify, pages))] = {"export_s": round(made, 2), "first_compile_s": round(times[0], 2),
                                                   "load_s": round(times[1], 2), "bytes": len(blob)}
    return out


def run(way: str, cache: str) -> dict:
    result = subprocess.run([sys.executable, __file__, "--cache", cache, "--way", way], capture_output=True,
                            text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", help="the compile-cache directory (default: a fresh temporary one)")
    parser.add_argument("--way", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.way:
        print(json.dumps(exported(args.cache) if args.way == "exported" else buckets(args.cache)))
        return
    cache = args.cache or tempfile.mkdtemp(prefix="startup-paths-")
    figures = {"cold": run("cold", cache), "executable_cache": run("executable_cache", cache)}
    shutil.rmtree(f"{cache}/jaxseek-executables")
    figures["jax_cache_alone"] = run("jax_cache_alone", cache)
    figures["lowered_program"] = run("exported", cache)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
