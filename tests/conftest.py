"""Shared fixtures: emulate 8 CPU devices (before any JAX op) and keep fp32 matmuls exact."""

import os

# The suite's programs are tiny, so compiling them is most of its time: LLVM at -O0 compiles them faster (a sixth
# off the time of test_spec_engine and test_engine_mesh on 2 cores). Set before JAX starts a backend; the suite's
# subprocesses inherit it.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0".strip()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_default_matmul_precision", "highest")

# Identical step executables are compiled by several engines in the suite: cache them on disk.
jax.config.update("jax_compilation_cache_dir", str(__import__("pathlib").Path(__file__).parent.parent
                                                   / ".pytest_cache" / "jax"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)

# Every annotated function and dataclass of the project's packages is checked when called: jaxtyping shapes and
# dtypes, and plain annotations, by beartype (tests/typecheck.py). JAXSEEK_TYPECHECK=strict (the default) fails a
# call that violates its annotations, =warn reports it as an AnnotationViolation warning in the session's summary,
# =0 checks nothing.
# Modules imported after this line are instrumented.
TYPECHECK = os.environ.get("JAXSEEK_TYPECHECK", "strict")
if TYPECHECK not in ("warn", "strict", "0"):
    raise ValueError(f"JAXSEEK_TYPECHECK must be warn, strict or 0, got {TYPECHECK!r}")
if TYPECHECK != "0":
    import tests.typecheck  # noqa: F401  (the hook's checker)
    from jaxtyping import install_import_hook

    install_import_hook(["pallas_kernels", "model", "sharding", "serving", "training", "benchmarks", "jaxseek"],
                        f"tests.typecheck.{TYPECHECK}")

# The longest test files (minutes each, measured on 2 cores) run first: with `-n 2` each worker takes whole files
# in collection order, so a long file collected last would leave one worker alone at the end.
LONGEST_FIRST = ("test_engine", "test_v41", "test_cached", "test_spec_engine", "test_dspark_v4", "test_server",
                 "test_context", "test_multiprocess", "test_engine_mesh", "test_prefix_engine", "test_engine_dp", "test_mesh_layer_programs",
                 "test_executable_cache_faults", "test_kernels", "test_bundled", "test_train", "test_replay",
                 "test_dspark", "test_study", "test_server_faults", "test_generate", "test_layer_programs",
                 "test_real_clients", "test_structured_engine", "test_parity", "test_step", "test_packaging")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable: file order kept within a file
