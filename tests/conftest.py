"""Shared fixtures: emulate 8 CPU devices (before any JAX op) and keep fp32 matmuls exact."""

import jax

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_default_matmul_precision", "highest")

# Identical step executables are compiled by several engines in the suite: cache them on disk.
jax.config.update("jax_compilation_cache_dir", str(__import__("pathlib").Path(__file__).parent.parent
                                                   / ".pytest_cache" / "jax"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
