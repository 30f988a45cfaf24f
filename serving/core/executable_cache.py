"""Compiled step executables kept on disk, so that a warm start loads each bucket's executable without tracing or
lowering its step (JAX's persistent compile cache is looked up only after both).

The entries live in `jaxseek-executables/` under JAX's compile-cache directory (`--compile-cache`), one file per
bucket, named by a hash of everything the step's trace and its executable depend on: JAX, the jaxlib build and
the backend, XLA flags, the host CPU's instruction-set features, the project's traced source, the kernel
implementation, the engine's model, layout and step options, the shapes, dtypes and shardings of its weights
and cache, and the bucket. An entry that cannot be read is compiled again and overwritten; one that loads but
fails when run is dropped by the engine (`drop`), which compiles the bucket again.

Only executables compiled afresh are stored: XLA:CPU cannot serialize again an executable it loaded from JAX's
persistent cache (the copy loads, then fails when a kernel it lacks is first reached). Such an executable
reaches a bucket in two ways: JAX's persistent cache serves one of the bucket's programs (a cache-hit event in
the compiling thread), or JAX's in-process cache hands back a program another bucket compiled before (no event
at all: e.g. a decode step's decide half, the same at every context bucket). `ExecutableCache` therefore
remembers, per executable, whether it was compiled afresh, and stores a bucket only when all of its are.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pathlib
import pickle
import platform
import tempfile
import threading
from collections.abc import Callable

import jax
import jaxlib
from jax.experimental.serialize_executable import deserialize_and_load, serialize

from model import registry
from pallas_kernels import tuning

LOG = logging.getLogger(__name__)

SUBDIR = "jaxseek-executables"
_JAX_CACHE_HITS = threading.local()  # per thread: compilations JAX's persistent cache served
TRACED_PACKAGES = ("model", "serving", "pallas_kernels", "sharding")  # the source a step's trace runs


def _count_hit(event: str, **_) -> None:
    if event == "/jax/compilation_cache/cache_hits":
        _JAX_CACHE_HITS.n = getattr(_JAX_CACHE_HITS, "n", 0) + 1


jax.monitoring.register_event_listener(_count_hit)


def _hits() -> int:
    """Compilations JAX's persistent cache has served in this thread."""
    return getattr(_JAX_CACHE_HITS, "n", 0)


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


@functools.cache
def cpu_features() -> str:
    """The host CPU's model and instruction-set flags (XLA:CPU compiles for the host's features: an executable
    built for AVX-512 dies with SIGILL on a host without it)."""
    try:
        lines = pathlib.Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return f"{platform.machine()}|{platform.processor()}"
    fields = {}
    for line in lines:
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    flags = " ".join(sorted(set(fields.get("flags", fields.get("Features", "")).split())))
    return f"{platform.machine()}|{fields.get('model name', '')}|{flags}"


@functools.cache
def jaxlib_build() -> tuple:
    """The jaxlib build: its version, commit, and the size and time of its native library."""
    native = pathlib.Path(jaxlib.__file__).parent / "_jax.so"
    stat = native.stat() if native.exists() else None
    return (jaxlib.__version__, getattr(jaxlib.version, "_git_hash", ""),
            None if stat is None else (stat.st_size, stat.st_mtime_ns))


def _environment() -> tuple:
    """What a trace and its executable depend on beyond their inputs: versions and the jaxlib build, backend and
    devices, XLA flags, the host CPU's features, source, kernels, host cores (one-row products split by them on
    the CPU: `xla_cpu.linear.gemv_groups`)."""
    return (jax.__version__, jaxlib_build(), jax.default_backend(), jax.devices()[0].client.platform_version,
            tuple(d.device_kind for d in jax.devices()), os.environ.get("XLA_FLAGS", ""), cpu_features(),
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
    both around a compilation, `drop(bucket)` deletes a bucket's entry (it failed when run). `parts` are the
    engine's inputs to every trace (model config, layout, step options, weights and cache as `describe` text);
    `loaded`, `stored` and `dropped` count buckets."""

    def __init__(self, root: pathlib.Path, *parts):
        self.root = root
        self.base = hashlib.sha256(repr((_environment(), parts)).encode()).hexdigest()
        self.loaded = self.stored = self.dropped = 0
        # per runtime executable this engine compiled: (it, compiled afresh, the bucket that first had it, the
        # count of buckets noted then); by id (not weakly referenceable), the executable held so that its id
        # is not reused
        self._fresh: dict[int, tuple[object, bool, tuple, int]] = {}
        self._lock, self._noted = threading.Lock(), 0

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

    def drop(self, bucket: tuple) -> None:
        """Delete the bucket's entry (it loaded but failed when run)."""
        self.path(bucket).unlink(missing_ok=True)
        self.dropped += 1

    def load_or_compile(self, bucket: tuple, compile_bucket: Callable[[], list], load: bool = True
                        ) -> list[jax.stages.Compiled]:
        """The bucket's stored executables (unless `load` is False), else `compile_bucket()`'s, stored when every
        one of them was compiled afresh (see the module's docstring). An executable this engine compiled for an
        earlier bucket (JAX's in-process cache hands it back) keeps the freshness it had then; one new to this
        bucket is fresh when JAX's persistent cache served nothing during the bucket's compilation."""
        executables = self.load(bucket) if load else None
        if executables is None:
            hits, since = _hits(), self._noted
            executables = compile_bucket()
            if self._note_fresh(bucket, [e.runtime_executable() for e in executables], _hits() == hits, since):
                self.store(bucket, executables)
        return executables

    def _note_fresh(self, bucket: tuple, runtimes: list, unserved: bool, since: int) -> bool:
        """Record the freshness of a bucket's executables (`unserved`: JAX's persistent cache served none of
        its compilations in this thread; `since`: the count of buckets noted when its compilation began);
        whether all of them are fresh. An executable that a bucket of another thread, noted while this one
        compiled, took for its own fresh one may be the one served here: that bucket's entry is dropped."""
        with self._lock:
            self._noted += 1
            fresh = []
            for runtime in runtimes:
                _, known, owner, noted = self._fresh.get(id(runtime), (runtime, unserved, bucket, self._noted))
                if known and not unserved and owner != bucket and noted > since:
                    self.drop(owner)
                    known = False
                self._fresh[id(runtime)] = (runtime, known, owner, noted)
                fresh.append(known)
            return all(fresh)
