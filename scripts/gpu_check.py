"""The GPU check (issue: kernels equal their references on an NVIDIA GPU; sparse decode near the HBM roofline;
the serving benchmarks' GPU figures), in phases under one deadline.

Each phase runs as a subprocess with its own time limit, cut so that the whole check ends before the deadline,
and writes `OUT/gpu_<phase>.json` as soon as it ends ({"phase", "rc", "seconds", "timed_out", "result": the
last JSON line the phase printed, "stderr_tail"}), so a time-out still returns what finished. The last file,
`gpu_summary.json`, gathers the figures the issue asks for. At most 8 files: the device tool returns no more.

    python scripts/gpu_check.py OUT_DIR [--deadline SECONDS]     # scripts/gpu_check.sh wraps it
"""

import argparse
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
ENV_PROBE = """
import json, jax, flax, jaxtyping, llguidance
from pallas_kernels.tuning import compute_capability
from sharding.platform import profile_for
dev = jax.devices()[0]
assert jax.default_backend() == "gpu", f"no GPU backend: {jax.devices()}"
print(json.dumps({"jax": jax.__version__, "flax": flax.__version__, "device": dev.device_kind,
                  "capability": compute_capability(), "profile": getattr(profile_for(dev.device_kind), "name", None)}))
"""
# (phase, command, seconds it may take at most), most important first; a missing script skips its phase
BENCHMARKS = (
    ("dspark", ["scripts/bench_dspark.py", "--modes", "dspark,fixed,none", "--skip-sts"], 150),
    ("context", ["scripts/bench_context.py", "--quick"], 75),
    ("engine", ["scripts/bench_engine.py", "--quick", "--skip-hf"], 75),
    ("quant", ["scripts/bench_quant.py", "--quick"], 60),
)
KERNEL_CASE_SECONDS = 30


def last_json(text: str):
    """The last line of `text` that parses as a JSON object, or None."""
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    return None


class Check:
    """Runs phases against one deadline and writes each phase's JSON file as it ends."""

    def __init__(self, out: Path, deadline: float):
        self.out, self.end = out, time.monotonic() + deadline
        self.results: dict[str, dict] = {}

    def left(self) -> float:
        return self.end - time.monotonic()

    def run(self, argv: list[str], limit: float, env: dict | None = None) -> dict:
        """One subprocess under min(limit, time left): rc, seconds, timed_out, stdout, stderr."""
        limit = max(1.0, min(limit, self.left()))
        start = time.monotonic()
        try:
            done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=limit,
                                  env={**os.environ, **(env or {})})
            rc, stdout, stderr, timed_out = done.returncode, done.stdout, done.stderr, False
        except subprocess.TimeoutExpired as e:
            decode = lambda b: b.decode(errors="replace") if isinstance(b, bytes) else (b or "")  # noqa: E731
            rc, stdout, stderr, timed_out = 124, decode(e.stdout), decode(e.stderr), True
        return {"rc": rc, "seconds": round(time.monotonic() - start, 2), "timed_out": timed_out,
                "stdout": stdout, "stderr": stderr}

    def record(self, phase: str, ran: dict, result) -> dict:
        entry = {"phase": phase, "rc": ran["rc"], "seconds": ran["seconds"], "timed_out": ran["timed_out"],
                 "result": result, "stderr_tail": ran["stderr"][-1500:]}
        self.results[phase] = entry
        (self.out / f"gpu_{phase}.json").write_text(json.dumps(entry) + "\n")
        print(json.dumps({k: v for k, v in entry.items() if k != "stderr_tail"})[:2000], flush=True)
        return entry

    def env(self) -> bool:
        ran = self.run([PY, "-c", ENV_PROBE], 60)
        return self.record("env", ran, last_json(ran["stdout"]))["rc"] == 0

    def kernel_tests(self) -> None:
        """Every test marked `kernels`, compiled for the GPU (no interpret mode there); per-test outcomes."""
        xml = self.out / "kernel_tests.xml"
        ran = self.run([PY, "-m", "pytest", "-q", "-m", "kernels", "tests", "-p", "no:cacheprovider",
                        f"--junitxml={xml}"], 150)
        outcomes = {}
        if xml.exists():
            for case in ElementTree.parse(xml).iter("testcase"):
                failed = case.find("failure") is not None or case.find("error") is not None
                outcomes[f"{case.get('classname')}::{case.get('name')}"] = (
                    "failed" if failed else "skipped" if case.find("skipped") is not None else "passed")
            xml.unlink()
        counts = {k: list(outcomes.values()).count(k) for k in ("passed", "failed", "skipped")}
        failed = [name for name, outcome in outcomes.items() if outcome == "failed"]
        self.record("kernel_tests", ran, {"counts": counts, "failed": failed, "tail": ran["stdout"][-1200:]})

    def kernel_bench(self) -> None:
        """`bench_kernels.py` at V4-Flash shapes, one case per subprocess under its own time limit."""
        listed = self.run([PY, "scripts/bench_kernels.py", "--list"], 30)
        rows, skipped = [], []
        for case in listed["stdout"].split():
            if self.left() < 200:  # leave the serving benchmarks their turn
                skipped.append(case)
                continue
            ran = self.run([PY, "scripts/bench_kernels.py", "--json", "--repeats", "20", "--only", case],
                           KERNEL_CASE_SECONDS)
            row = next((json.loads(line) for line in ran["stdout"].splitlines()
                        if line.startswith("{") and '"case"' in line), None)
            rows.append(row or {"case": case, "rc": ran["rc"], "timed_out": ran["timed_out"],
                                "stderr_tail": ran["stderr"][-400:]})
        decode = next((r for r in rows if r.get("case") == "sparse_attention_decode"), {})
        self.record("kernels", {**listed, "stderr": ""}, {
            "cases": rows, "not_run": skipped, "sparse_decode_hbm_fraction": decode.get("peak_fraction")})

    def benchmarks(self) -> None:
        for phase, argv, limit in BENCHMARKS:
            if not (ROOT / argv[0]).exists():
                continue
            ran = self.run([PY, *argv], limit, {"JAXSEEK_KERNELS": "reference"} if phase == "dspark" else None)
            self.record(phase, ran, last_json(ran["stdout"]))

    def summary(self) -> dict:
        """The issue's figures, read from the phases' results (None where a phase did not produce them)."""
        get = lambda phase: (self.results.get(phase) or {}).get("result") or {}  # noqa: E731
        dspark, context, quant = get("dspark"), get("context"), get("quant")
        tok = lambda mode: ((dspark.get(mode) or {}).get("tok_s_b1"))  # noqa: E731
        verified = lambda mode: ((dspark.get(mode) or {}).get("verified_per_step"))  # noqa: E731
        accepted = lambda mode: ((dspark.get(mode) or {}).get("accepted_per_step"))  # noqa: E731
        ratio = lambda a, b: None if a is None or not b else a / b  # noqa: E731
        figures = {
            "kernel_tests": get("kernel_tests").get("counts"),
            "kernel_tests_failed": get("kernel_tests").get("failed"),
            "sparse_decode_hbm_fraction": get("kernels").get("sparse_decode_hbm_fraction"),
            "dspark_tok_s_b1_over_none": ratio(tok("dspark"), tok("none")),
            "dspark_verified_over_fixed": ratio(verified("dspark"), verified("fixed")),
            "dspark_accepted_over_fixed": ratio(accepted("dspark"), accepted("fixed")),
            "maxlen_flatness_b1": context.get("maxlen_flatness_b1"),
            "maxlen_flatness_b8": context.get("maxlen_flatness_b8"),
            "quant_speedup_b1": quant.get("quant_speedup_b1"),
            "phases": {name: {"rc": r["rc"], "seconds": r["seconds"], "timed_out": r["timed_out"]}
                       for name, r in self.results.items()},
        }
        (self.out / "gpu_summary.json").write_text(json.dumps(figures) + "\n")
        print(json.dumps(figures), flush=True)
        return figures


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--deadline", type=float, default=470.0, help="seconds for the whole check")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    check = Check(args.out, args.deadline)
    if not check.env():
        return 1
    check.kernel_tests()
    check.kernel_bench()
    check.benchmarks()
    figures = check.summary()
    failed = figures["kernel_tests"] is None or figures["kernel_tests"]["failed"] > 0
    return int(failed or any(r["rc"] != 0 for r in check.results.values()))


if __name__ == "__main__":
    sys.exit(main())
