"""Layer-programs benchmark: the two ways the engine can run a model's layers, compile time against depth and
decode speed, on this machine.

    jaxseek bench layer-programs                # 4, 8 and 16 layers, decode at 8 (~10 min on 2 idle cores)
    jaxseek bench layer-programs --layers 4 8   # fewer
    XLA_FLAGS=--xla_force_host_platform_device_count=2 jaxseek bench layer-programs --mesh dp=2,ep=2

Prints ONE JSON line on stdout (progress on stderr). Never run by the test suite.

The model: `small` widths with V4-Flash's layer pattern (two sliding layers, (CSA, HCA) pairs, one sliding layer;
`benchmarks.startup.flash_pattern`), random weights, fp32. The forms:

- `one_program`: the whole step as one program, every layer unrolled in it (`--no-layer-programs`);
- `layer_programs`: one program per kind of layer, launched per layer (`serving.core.layer_programs`, the default);
- `mesh_one_program` and `mesh_layer_programs` (with `--mesh SPEC`): the mesh engine's step as one `shard_map`
  program over the mesh, and as layer programs, each a `shard_map` program; one slot per attention rank for the
  compile figure.

Figures per form:

- `compile_s_by_layers_{form}`: seconds per step bucket to compile a one-slot batch-invariant engine's two buckets
  (decode and a 16-token prefill), persistent compile cache off (`benchmarks.startup.compile_seconds`), and
  `compile_ratio_{last}_over_{first}_{form}`, the most layers' figure over the fewest's;
- `decode_tok_s_b1_{form}` / `_b16_{form}`: greedy decode tokens per second of an engine with 16 slots
  (`--decode-layers` layers, 16-token prompts, 64 new tokens per row), median of `--repeats` runs alternating the
  forms; `{form}_over_one_program_decode_b1` / `_b16` (and `mesh_layer_programs_over_mesh_one_program_decode_b1` /
  `_b16`); `outputs_match`: every form gave the same tokens.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from benchmarks.bench_json import json_line
from benchmarks.startup import compile_seconds, flash_pattern
from sharding.mesh import MeshSpec


def log(message: str) -> None:
    print(f"bench layer-programs: {message}", file=sys.stderr, flush=True)


FORMS = {"one_program": {"layer_programs": False}, "layer_programs": {}}  # form -> engine settings


def forms(mesh: str | None) -> dict[str, dict]:
    """The forms measured: `FORMS`, and with a mesh spec the mesh engine's one program."""
    if mesh is None:
        return FORMS
    return FORMS | {"mesh_one_program": {"mesh": mesh, "layer_programs": False},
                    "mesh_layer_programs": {"mesh": mesh, "layer_programs": True}}


def decode_rates(layers: int, repeats: int, mesh: str | None = None) -> tuple[dict, bool]:
    """({form: {rows: median tok/s}} at 1 and 16 rows, whether every form gave the same tokens)."""
    import numpy as np

    from model.config import preset
    from model.initialize import init_model
    from serving.core.engine import Engine
    from serving.base.sampling import SamplingParams

    model = init_model(flash_pattern(preset("small"), layers), seed=0)
    engines = {name: Engine(model, max_slots=16, max_len=1024, prefill_chunk=16, **settings)
               for name, settings in forms(mesh).items()}
    greedy = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    rng = np.random.default_rng(0)
    rates, tokens = {name: {} for name in engines}, {name: [] for name in engines}
    for rows in (1, 16):
        prompts = [rng.integers(0, model.config.vocab_size, 16).tolist() for _ in range(rows)]
        times = {name: [] for name in engines}
        for name, engine in engines.items():  # compiles the buckets
            tokens[name] += [out.token_ids for out in engine.generate(prompts, greedy)]
        for _ in range(repeats):
            for name, engine in engines.items():
                start = time.perf_counter()
                engine.generate(prompts, greedy)
                times[name].append(time.perf_counter() - start)
        for name in engines:
            rates[name][rows] = rows * greedy.max_tokens / statistics.median(times[name])
    return rates, all(out == tokens["one_program"] for out in tokens.values())


def summary(compile_s: dict[str, dict[int, float]], rates: dict, match: bool) -> dict:
    """The JSON line's figures: `compile_s` {form: {layers: seconds}}, `rates` {form: {rows: tok/s}}."""
    out = {"benchmark": "layer_programs"}
    for name, by in compile_s.items():
        first, last = min(by), max(by)
        out[f"compile_s_by_layers_{name}"] = {str(n): round(s, 2) for n, s in by.items()}
        out[f"compile_ratio_{last}_over_{first}_{name}"] = round(by[last] / by[first], 3)
    for name, by in rates.items():
        out |= {f"decode_tok_s_b{rows}_{name}": round(rate, 1) for rows, rate in by.items()}
    out |= {f"{name}_over_one_program_decode_b{rows}": round(by[rows] / rates["one_program"][rows], 3)
            for name, by in rates.items() if name != "one_program" for rows in by}
    if "mesh_layer_programs" in rates:
        out |= {f"mesh_layer_programs_over_mesh_one_program_decode_b{rows}":
                round(rate / rates["mesh_one_program"][rows], 3) for rows, rate in rates["mesh_layer_programs"].items()}
    return out | {"outputs_match": match}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 8, 16], help="main layer counts to compile "
                        "(even, >= 4)")
    parser.add_argument("--decode-layers", type=int, default=8, help="main layers of the decode model (default 8)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per form and batch (default 3)")
    parser.add_argument("--mesh", help="also the mesh engine on this mesh (e.g. dp=2,ep=2; on CPU emulate its "
                        "devices with XLA_FLAGS=--xla_force_host_platform_device_count=N)")
    args = parser.parse_args(argv)
    if min(args.layers + [args.decode_layers]) < 4 or any(n % 2 for n in args.layers + [args.decode_layers]):
        parser.error("--layers / --decode-layers: each count must be even and at least 4")
    import jax

    jax.config.update("jax_compilation_cache_dir", None)  # compile for real
    result = {"load_avg_1m_start": round(os.getloadavg()[0], 2)}
    measured = forms(args.mesh)
    ranks = 1 if args.mesh is None else MeshSpec.parse(args.mesh).dp
    compile_s = {name: {} for name in measured}
    for layers in sorted(set(args.layers)):
        for name, settings in measured.items():
            log(f"compiling {layers} layers, {name}")
            compile_s[name][layers] = compile_seconds(layers, ranks if "mesh" in settings else 1, **settings)
    log(f"decoding at {args.decode_layers} layers")
    rates, match = decode_rates(args.decode_layers, args.repeats, args.mesh)
    result |= summary(compile_s, rates, match) | {"load_avg_1m_end": round(os.getloadavg()[0], 2),
                                                  "device": str(jax.devices()[0])}
    print(json_line(result))
    return result


if __name__ == "__main__":
    main()
