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
# dtypes, and plain annotations by beartype (an int passes for a float, as PEP 484 says). Modules imported after
# this line are instrumented; JAXSEEK_TYPECHECK=0 turns it off.
if os.environ.get("JAXSEEK_TYPECHECK", "1") != "0":
    from jaxtyping import install_import_hook

    install_import_hook(["pallas_kernels", "model", "sharding", "serving", "training", "benchmarks", "jaxseek"],
                        "beartype.beartype(conf=beartype.BeartypeConf(is_pep484_tower=True))")
