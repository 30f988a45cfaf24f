"""The sharded model across processes (`jax.distributed`): one leader decides each step, every process runs it.

`initialize` joins a process to the job (CPU processes talk through gloo). The leader (process 0) owns
the step's plan, here the token ids; `broadcast_plan` gives every process the leader's copy, then each
process runs the same program on its own devices of the global mesh (`sharding.mesh.logits_on_mesh`).
Run as `python -m sharding.multihost --process-id I --num-processes N --port P ...` it is one such
process: the leader writes the logits of a whole-sequence forward to `--out` (a .npy file).
"""

from __future__ import annotations

import argparse

import jax
import numpy as np
from jax.experimental import multihost_utils
from jaxtyping import Int


def initialize(coordinator: str, num_processes: int, process_id: int, local_devices: int | None = None) -> None:
    """Join a `jax.distributed` job before any JAX operation (on CPU: `local_devices` emulated devices)."""
    if jax.config.jax_platforms in (None, "", "cpu"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        if local_devices:
            jax.config.update("jax_num_cpu_devices", local_devices)
    jax.distributed.initialize(coordinator, num_processes=num_processes, process_id=process_id)


def broadcast_plan(plan: Int[np.ndarray, "..."]) -> Int[np.ndarray, "..."]:
    """The leader's plan on every process (the others pass an array of the same shape and dtype)."""
    return np.asarray(multihost_utils.broadcast_one_to_all(np.asarray(plan)))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--process-id", type=int, required=True)
    p.add_argument("--num-processes", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--local-devices", type=int, default=4)
    p.add_argument("--config", default="tiny")
    p.add_argument("--mesh", default="dp=8,ep=4")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=12)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="where the leader writes the logits (.npy)")
    args = p.parse_args(argv)
    initialize(f"localhost:{args.port}", args.num_processes, args.process_id, args.local_devices)
    jax.config.update("jax_default_matmul_precision", "highest")
    from model.initialize import init_model
    from model.config import preset
    from sharding.mesh import MeshSpec, logits_on_mesh, make_mesh

    config = preset(args.config)
    leader = jax.process_index() == 0
    tokens = (np.random.default_rng(args.seed).integers(0, config.vocab_size, (args.batch, args.seq))
              if leader else np.zeros((args.batch, args.seq), np.int64))
    tokens = broadcast_plan(tokens)
    logits = logits_on_mesh(init_model(config, seed=args.seed), tokens, make_mesh(MeshSpec.parse(args.mesh)))
    logits = np.asarray(multihost_utils.process_allgather(logits, tiled=True))
    if leader:
        np.save(args.out, logits)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
