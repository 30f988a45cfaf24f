"""Shared fixtures: emulate 8 CPU devices (before any JAX op) and keep fp32 matmuls exact."""

import jax

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_default_matmul_precision", "highest")
