#!/usr/bin/env bash
# GPU check on a CUDA machine (jax 0.11+ with the CUDA 13 plugin, Python 3.12, the project's dependencies; it
# installs nothing, so bring what the image lacks, e.g. llguidance and flax as wheels on PYTHONPATH):
#   1. the serving benchmarks on the bundled model, with the reference kernels (XLA-fused jnp):
#      bench_dspark.py (speculation modes) and bench_grammar.py --engine (structured-output mask overhead),
#   2. the `kernels` tests, compiled for the GPU (Pallas lowers through Triton; no interpret mode there), the
#      FP8-weight GEMM and the FP4-weight grouped expert GEMM (weights as stored) among them,
#   3. the kernel microbenchmark at V4-Flash shapes,
# then one JSON line: {"gpu_check": ..., "tests": ..., "sparse_decode_hbm_fraction": ...}. Budget: < 10 minutes
# (a session's device time is 15 minutes: run it once, as `run` with timeout_s 590, and give the machine back).
# Usage: scripts/gpu_check.sh [OUT_DIR]   (PYTHON=... to pick the interpreter; logs go to OUT_DIR, default $OUT or /tmp)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT_DIR=${1:-${OUT:-/tmp}}
mkdir -p "$OUT_DIR"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if ! "$PY" - > "$OUT_DIR/gpu_env.json" 2>&1 <<'EOF'
import json, jax, flax, jaxtyping, numpy, pytest
from sharding.platform import compute_capability, profile_for
dev = jax.devices()[0]
assert jax.default_backend() == "gpu", f"no GPU backend: {jax.devices()}"
print(json.dumps({"jax": jax.__version__, "device": dev.device_kind, "capability": compute_capability(),
                  "profile": getattr(profile_for(dev.device_kind), "name", None)}))
EOF
then
    echo "{\"gpu_check\": \"no usable GPU stack\", \"detail\": $(tail -c 600 "$OUT_DIR/gpu_env.json" | "$PY" -c 'import json,sys; print(json.dumps(sys.stdin.read()))')}"
    exit 1
fi
cat "$OUT_DIR/gpu_env.json"

# Identical step programs of the benchmarks' engines compile once.
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jaxseek_xla} JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
# On an H200 the 16-slot engines compile in about 60 s (none), 80 s (fixed) and 230 s (dspark, 34 buckets).
JAXSEEK_KERNELS=reference timeout 330 "$PY" scripts/bench_dspark.py --modes dspark,fixed,none --skip-sts \
    > "$OUT_DIR/gpu_dspark.json" 2> "$OUT_DIR/gpu_dspark.err"
echo "bench_dspark rc=$?"; tail -n 6 "$OUT_DIR/gpu_dspark.err"
JAXSEEK_KERNELS=reference timeout 90 "$PY" scripts/bench_grammar.py --engine --repeats 3 \
    > "$OUT_DIR/gpu_grammar.json" 2> "$OUT_DIR/gpu_grammar.err"
echo "bench_grammar rc=$?"; tail -n 3 "$OUT_DIR/gpu_grammar.err"

timeout 150 "$PY" -m pytest -q -m kernels tests/test_kernels.py -p no:cacheprovider > "$OUT_DIR/gpu_kernel_tests.log" 2>&1
tests_rc=$?
tail -n 15 "$OUT_DIR/gpu_kernel_tests.log"

timeout 40 "$PY" scripts/bench_kernels.py --json --repeats 20 > "$OUT_DIR/gpu_bench.jsonl" 2> "$OUT_DIR/gpu_bench.err"
bench_rc=$?
cat "$OUT_DIR/gpu_bench.jsonl"
tail -n 5 "$OUT_DIR/gpu_bench.err"

"$PY" - "$OUT_DIR" "$tests_rc" "$bench_rc" <<'EOF'
import json, pathlib, re, sys
out, tests_rc, bench_rc = pathlib.Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
log = (out / "gpu_kernel_tests.log").read_text()
counts = dict((k, int(v)) for v, k in re.findall(r"(\d+) (passed|failed|skipped|error)", log.splitlines()[-1] if log else ""))
rows = [json.loads(line) for line in (out / "gpu_bench.jsonl").read_text().splitlines() if line.startswith("{")]
summary = next((r for r in rows if r.get("summary")), {})
print(json.dumps({"gpu_check": "ok" if tests_rc == 0 and bench_rc == 0 else "failed", "tests_rc": tests_rc,
                  "tests": counts, "bench_rc": bench_rc, "device": summary.get("device"),
                  "sparse_decode_hbm_fraction": summary.get("sparse_decode_hbm_fraction"),
                  "cases": {r["case"]: {"ms": round(r["seconds"] * 1e3, 4), "peak_fraction": r["peak_fraction"],
                                        "speedup": r["speedup"]} for r in rows if "case" in r}}))
EOF
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
