"""What start-up compiles, shown while it happens: a progress bar over an engine's step buckets (the one being
compiled, then how long it took), how many buckets the executable cache served whole (`serving.core.executable_cache`)
and how many of the compilations the persistent compile cache served."""

from __future__ import annotations

import sys
import time

import jax

_EVENTS = {"/jax/compilation_cache/cache_hits": 0, "/jax/compilation_cache/cache_misses": 0}


def _count(event: str, **_) -> None:
    if event in _EVENTS:
        _EVENTS[event] += 1


jax.monitoring.register_event_listener(_count)


def describe(bucket: tuple[int, int, int, int]) -> str:
    """A step bucket (rows, tokens, verify length, context pages) in words."""
    rows, tokens, verify, pages = bucket
    if tokens == 1:
        return f"decode {rows} row{'s' if rows > 1 else ''}, {pages} pages"
    return f"{'verify' if tokens == verify else 'prefill'} {rows}x{tokens}, {pages} pages"


class CompileProgress:
    """Set as `engine.on_compile`: a tqdm bar over the engine's buckets; `summary()` tells what was compiled,
    in how many seconds, how many buckets came whole from the executable cache and how many compilations from
    the persistent cache."""

    def __init__(self, engine, file=None, disable: bool | None = None):
        from tqdm import tqdm

        self.bar = tqdm(total=len(engine.buckets()), desc="compile", unit="step", file=file or sys.stderr,
                        disable=disable, leave=True)
        self.seconds, self.compiled, self.started = 0.0, [], time.perf_counter()
        self.events = dict(_EVENTS)
        self.executables = engine.executables
        self.loaded_before = 0 if engine.executables is None else engine.executables.loaded
        engine.on_compile = self

    def __call__(self, bucket: tuple[int, int, int, int], seconds: float | None) -> None:
        if seconds is None:
            self.bar.set_postfix_str(describe(bucket) + " ...")
            return
        self.seconds += seconds
        self.compiled.append(bucket)
        self.bar.set_postfix_str(f"{describe(bucket)} {seconds:.1f} s")
        self.bar.update(1)

    def cache_counts(self) -> tuple[int, int]:
        """(hits, misses) of the persistent compile cache since this progress began."""
        return tuple(_EVENTS[k] - self.events[k] for k in ("/jax/compilation_cache/cache_hits",
                                                           "/jax/compilation_cache/cache_misses"))

    def summary(self) -> str:
        self.bar.close()
        hits, misses = self.cache_counts()
        where = jax.config.jax_compilation_cache_dir
        whole = ("" if self.executables is None else
                 f"{self.executables.loaded - self.loaded_before} buckets loaded without tracing, ")
        cache = (f"compile cache {where}: {whole}{hits} compilations loaded, {misses} compiled and stored" if where
                 else "compile cache off")
        return f"compiled {len(self.compiled)} step buckets in {self.seconds:.2f} s ({cache})"
