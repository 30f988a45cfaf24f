"""Shared fixtures: emulate 8 CPU devices (before any JAX op) and keep fp32 matmuls exact."""

import os

import jax

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
