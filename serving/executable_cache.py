"""Compiled step executables kept on disk, so that a warm start loads each bucket's executable without tracing or
lowering its step (JAX's persistent compile cache is looked up only after both).

The entries live in `jaxseek-executables/` under JAX's compile-cache directory (`--compile-cache`), one file per
bucket, named by a hash of everything the step's trace depends on: JAX and the backend, the project's traced
source, the kernel implementation, the engine's model, layout and step options, the shapes, dtypes and
shardings of its weights and cache, and the bucket. An entry that cannot be read is compiled again and
overwritten.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pathlib
import pickle
import tempfile
import threading
from collections.abc import Callable

import jax
import jaxlib
from jax.experimental.serialize_executable import deserialize_and_load, serialize

from pallas_kernels import registry, tuning

LOG = logging.getLogger(__name__)

SUBDIR = "jaxseek-executables"
_JAX_CACHE_HITS = threading.local()  # per thread: compilations JAX's persistent cache served
TRACED_PACKAGES = ("model", "serving", "pallas_kernels", "sharding")  # the source a step's trace runs


def _count_hit(event: str, **_) -> None:
    if event == "/jax/compilation_cache/cache_hits":
        _JAX_CACHE_HITS.n = getattr(_JAX_CACHE_HITS, "n", 0) + 1


jax.monitoring.register_event_listener(_count_hit)


def directory() -> pathlib.Path | None:
    """Where executables are kept: under JAX's compile-cache directory (None when that cache is off)."""
    root = jax.config.jax_compilation_cache_dir
    return pathlib.Path(root).expanduser() / SUBDIR if root else None


@functools.cache
def _source_digest() -> str:
    """A hash of the traced packages' Python source."""
    root = pathlib.Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for package in TRACED_PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def _environment() -> tuple:
    """What a trace depends on beyond its inputs: versions, backend and devices, flags, source, kernels, host cores
    (one-row products split by them on the CPU: `quant_linear.gemv_groups`)."""
    return (jax.__version__, jaxlib.__version__, jax.default_backend(), jax.devices()[0].client.platform_version,
            tuple(d.device_kind for d in jax.devices()), os.environ.get("XLA_FLAGS", ""),
            jax.config.jax_enable_x64, str(jax.config.jax_default_matmul_precision), _source_digest(),
            registry.implementation(), tuning.host_cores())


def describe(tree) -> str:
    """A pytree's structure and each leaf's shape, dtype and sharding, as text."""
    leaves, structure = jax.tree.flatten(tree)
    return repr(structure) + "".join(
        f"|{getattr(x, 'shape', ())}:{getattr(x, 'dtype', type(x).__name__)}:{getattr(x, 'sharding', None)}"
        for x in leaves)


class ExecutableCache:
    """One engine's compiled buckets on disk (`directory()`): `load(bucket)` gives the executables stored for a
    bucket (None when absent or unreadable), `store(bucket, executables)` keeps them, `load_or_compile` does
    both around a compilation. `parts` are the engine's inputs to every trace (model config, layout, step
    options, weights and cache as `describe` text); `loaded` and `stored` count buckets."""

    def __init__(self, root: pathlib.Path, *parts):
        self.root = root
        self.base = hashlib.sha256(repr((_environment(), parts)).encode()).hexdigest()
        self.loaded = self.stored = 0

    def path(self, bucket: tuple) -> pathlib.Path:
        return self.root / hashlib.sha256(f"{self.base}{bucket}".encode()).hexdigest()

    def load(self, bucket: tuple) -> list[jax.stages.Compiled] | None:
        path = self.path(bucket)
        try:
            devices = {d.id: d for d in jax.devices()}
            executables = [deserialize_and_load(*entry, execution_devices=[devices[i] for i in ids])
                           for *entry, ids in pickle.loads(path.read_bytes())]
        except FileNotFoundError:
            return None
        except Exception as e:  # noqa: BLE001  (a truncated, corrupt or incompatible entry is compiled again)
            LOG.warning("compiled step %s unreadable (%s: %s); compiling it again", path, type(e).__name__, e)
            return None
        self.loaded += 1
        return executables

    def store(self, bucket: tuple, executables: list[jax.stages.Compiled]) -> None:
        temporary = None
        try:
            data = pickle.dumps([(*serialize(e), [d.id for d in e.runtime_executable().local_devices()])
                                 for e in executables])
            self.root.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=self.root, delete=False) as f:  # written whole, then renamed
                temporary = f.name
                f.write(data)
            os.replace(temporary, self.path(bucket))
        except Exception as e:  # noqa: BLE001  (the cache is an optimisation: the bucket is compiled anyway)
            LOG.warning("cannot store compiled step %s (%s: %s)", bucket, type(e).__name__, e)
            if temporary is not None and os.path.exists(temporary):
                os.unlink(temporary)
            return
        self.stored += 1

    def load_or_compile(self, bucket: tuple, compile_bucket: Callable[[], list]) -> list[jax.stages.Compiled]:
        """The bucket's stored executables, else `compile_bucket()`'s, stored unless JAX's persistent cache
        served them: XLA:CPU cannot serialize again an executable it loaded from there (it would fail when
        run), so such a bucket is stored once it is compiled afresh."""
        executables = self.load(bucket)
        if executables is None:
            hits = getattr(_JAX_CACHE_HITS, "n", 0)
            executables = compile_bucket()
            if getattr(_JAX_CACHE_HITS, "n", 0) == hits:
                self.store(bucket, executables)
        return executables
