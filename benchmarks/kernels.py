"""Microbenchmark: each Pallas kernel against its reference at V4-Flash-like shapes.

For every case: median seconds of the kernel and of the reference, the bytes a kernel must move at least
(inputs it needs plus outputs) and its FLOPs, the achieved bytes/s and FLOP/s, and the fraction of the device
profile's peak (HBM bandwidth, or dense bf16 FLOP/s for the matmul-bound cases). One JSON object per case,
then a summary line whose `sparse_decode_hbm_fraction` is the figure the GPU check reports. Off GPU the
kernels run in interpret mode: use `--small` there (shapes scaled down; timings say nothing about a GPU).

    jaxseek bench kernels --json                # V4-Flash shapes on a GPU
    jaxseek bench kernels --small --json        # a CPU smoke run
"""

import argparse
import statistics
import sys


import jax
import jax.numpy as jnp
import numpy as np

from model import registry
from sharding.platform import PROFILES, profile_for
from benchmarks.bench_json import json_line
from benchmarks.roofline import call_seconds

# V4-Flash: 64 heads x 512, window 128, top-512 CSA picks, 64 x 128 indexer, 256 experts top-6, D 4096, I 2048;
# compression ratios 4 (CSA entries, index keys) and 128 (HCA); pages of 128 tokens' entries (the engine's layout)
FLASH = dict(rows=32, heads=64, head_dim=512, window=128, topk=512, context=65536, hca_context=1048576,
             prefill=1024, index_heads=64, index_dim=128, experts=256, top=6, hidden=4096, inter=2048,
             decode_tokens=256, prefill_tokens=4096, hc=4, csa_ratio=4, hca_ratio=128, page_tokens=128)
SMALL = dict(rows=2, heads=16, head_dim=64, window=16, topk=32, context=1024, hca_context=8192, prefill=16,
             index_heads=16, index_dim=32, experts=8, top=2, hidden=128, inter=64, decode_tokens=8,
             prefill_tokens=32, hc=4, csa_ratio=4, hca_ratio=128, page_tokens=128)
DENSE_REFERENCE_LIMIT = 2 ** 31  # bytes of the reference MoE's per-pair expert weights we are willing to gather


def cases(s: dict, rng: np.random.Generator):
    """(name, op, args, min bytes, flops, bound) per benchmark case."""
    bf16, f32 = jnp.bfloat16, jnp.float32
    r, h, d, w, k = s["rows"], s["heads"], s["head_dim"], s["window"], s["topk"]

    def normal(shape, dtype):
        return jnp.asarray(rng.standard_normal(shape, np.float32), dtype)

    def attention(c, n_entries, picks):
        q = normal((r, c, h, d), bf16)
        pool = normal((r, w + c + n_entries, d), bf16)
        win = np.broadcast_to(np.arange(w), (r, c, w))
        chosen = w + c + rng.integers(0, n_entries, (r, c, picks))
        ids = jnp.asarray(np.concatenate([win, chosen], -1), jnp.int32)
        return q, pool, ids, jnp.ones(ids.shape, bool), normal((h,), f32)

    out = []
    for name, c in (("sparse_attention_decode", 1), ("sparse_attention_prefill", s["prefill"])):
        rows = 1 if c > 1 else r
        q, pool, ids, valid, sink = attention(c, s["context"] // 4, k)
        q, pool, ids, valid = q[:rows], pool[:rows], ids[:rows], valid[:rows]
        keys = rows * c * (w + k)
        nbytes = 2 * q.size * 2 + keys * (d * 2 + 4 + 1)
        out.append((name, "sink_attention", (q, pool, ids, valid, sink), nbytes, 4 * keys * h * d, "hbm"))

    def paged(n_entries, ratio, dim, dtype):
        """A pool of r rows' pages of `page_tokens // ratio` entries each (shuffled) and the rows' block tables."""
        per_page = s["page_tokens"] // ratio
        p = -(-n_entries // per_page)
        table = jnp.asarray(rng.permutation(r * p).reshape(r, p), jnp.int32)
        return normal((r * p, per_page, dim), dtype), table

    q, window, ids, valid, sink = attention(1, 0, 0)  # decode: the window ring plus the new token's key
    n_csa = s["context"] // s["csa_ratio"]
    pages, table = paged(n_csa, s["csa_ratio"], d, bf16)
    picks = jnp.asarray(rng.integers(0, n_csa, (r, 1, k)), jnp.int32)
    out.append(("paged_sink_attention_decode", "paged_sink_attention",
                (q, window, ids, valid, sink, pages, table, picks),
                2 * q.size * 2 + r * w * (d * 2 + 4 + 1) + r * k * (d * 2 + 4) + table.size * 4,
                4 * r * (w + k) * h * d, "hbm"))

    n_hca = s["hca_context"] // s["hca_ratio"]
    pages, table = paged(n_hca, s["hca_ratio"], d, bf16)
    keys = r * (w + n_hca)
    out.append(("paged_hca_attention_decode", "paged_hca_attention",
                (q, window, ids, valid, sink, pages, table, jnp.full((1,), n_hca, jnp.int32)),
                2 * q.size * 2 + keys * d * 2 + r * w * 5 + table.size * 4, 4 * keys * h * d, "hbm"))

    ih, idim = s["index_heads"], s["index_dim"]
    pages, table = paged(n_csa, s["csa_ratio"], idim, f32)
    iq, iw = normal((r, 1, ih, idim), f32), normal((r, 1, ih), f32)
    out.append(("paged_index_scores_decode", "paged_index_scores",
                (iq, pages, table, iw, jnp.full((1,), n_csa, jnp.int32)),
                r * n_csa * idim * 4 + r * n_csa * 4 + table.size * 4, 2 * r * n_csa * ih * idim, "hbm"))

    e, top, dim, inter = s["experts"], s["top"], s["hidden"], s["inter"]
    weights = [normal(shape, bf16) * 0.02 for shape in ((e, inter, dim), (e, dim, inter), (e, inter, dim))]
    for name, tokens in (("routed_experts_decode", s["decode_tokens"]), ("routed_experts_prefill", s["prefill_tokens"])):
        x = normal((tokens, dim), bf16)
        ids = jnp.asarray(np.stack([rng.choice(e, top, replace=False) for _ in range(tokens)]), jnp.int32)
        gate = jnp.asarray(rng.random((tokens, top)), f32)
        touched = len(np.unique(np.asarray(ids)))
        nbytes = touched * 3 * inter * dim * 2 + tokens * dim * (2 + 4)
        bound = "hbm" if tokens * top < 4 * e else "flops"
        out.append((name, "routed_experts", (x, ids, gate, *weights, 10.0), nbytes, 6 * tokens * top * dim * inter,
                    bound))

    n = s["hc"]
    streams = normal((1, s["prefill_tokens"], n, dim), bf16)
    fn = normal(((2 + n) * n, n * dim), f32) * 0.01
    tokens = s["prefill_tokens"]
    out.append(("hc_site_prefill", "hc_site",
                (streams, fn, normal(((2 + n) * n,), f32), jnp.ones((3,), f32), None, 20, 1e-6, 1e-6),
                streams.size * 2 + fn.size * 4 + tokens * (dim * 2 + 4 * (2 * n + n * n)),
                tokens * 2 * (2 + n) * n * n * dim, "hbm"))
    return out


def timed(fn, args, repeats: int) -> float:
    """Median seconds of a jitted call (after one compile-and-run)."""
    static = tuple(i for i, a in enumerate(args) if not isinstance(a, jax.Array))
    dynamic = [a for a in args if isinstance(a, jax.Array)]

    def call(*arrays):
        it = iter(arrays)
        return fn(*(a if i in static else next(it) for i, a in enumerate(args)))

    return statistics.median(call_seconds(jax.jit(call), *dynamic, repeats=repeats))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", action="store_true", help="scaled-down shapes (interpret mode on CPU)")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--profile", choices=sorted(PROFILES), help="device profile for the fractions "
                   "(default: the attached GPU's)")
    p.add_argument("--only", help="comma-separated case names")
    p.add_argument("--json", action="store_true", help="JSON lines only")
    p.add_argument("--list", action="store_true", help="print the case names and exit")
    args = p.parse_args(argv)
    if args.list:
        print(" ".join(case[0] for case in cases(SMALL, np.random.default_rng(0))))
        return 0

    device = jax.devices()[0]
    profile = PROFILES[args.profile] if args.profile else profile_for(device.device_kind)
    shapes = SMALL if args.small else FLASH
    ops = registry.ops()
    rows = []
    for name, op, op_args, nbytes, flops, bound in cases(shapes, np.random.default_rng(0)):
        if args.only and name not in args.only.split(","):
            continue
        reference, kernel, _ = ops[op]
        seconds = timed(kernel, op_args, args.repeats)
        ref_seconds = None
        if not (op == "routed_experts" and op_args[1].size * 3 * shapes["inter"] * shapes["hidden"] * 4
                > DENSE_REFERENCE_LIMIT):
            ref_seconds = timed(reference, op_args, args.repeats)
        row = {"case": name, "op": op, "seconds": seconds, "reference_seconds": ref_seconds,
               "speedup": None if ref_seconds is None else ref_seconds / seconds,
               "bytes": nbytes, "flops": flops, "bytes_per_s": nbytes / seconds, "flops_per_s": flops / seconds,
               "bound": bound, "peak_fraction": None}
        if profile is not None:
            peak = profile.hbm_bytes_per_s if bound == "hbm" else profile.bf16_flops
            row["peak_fraction"] = (row["bytes_per_s"] if bound == "hbm" else row["flops_per_s"]) / peak
        rows.append(row)
        print(json_line(row) if args.json else
              f"{name:>26}: {seconds * 1e3:9.3f} ms (reference "
              f"{'-' if ref_seconds is None else f'{ref_seconds * 1e3:.3f} ms'}), {row['bytes_per_s'] / 1e9:8.1f} GB/s, "
              f"{row['flops_per_s'] / 1e12:7.2f} TFLOP/s, peak fraction {row['peak_fraction']}", flush=True)
    decode = next((r for r in rows if r["case"] == "sparse_attention_decode"), None)
    print(json_line({"summary": True, "device": device.device_kind, "platform": device.platform,
                      "profile": profile and profile.name, "small": args.small, "cases": len(rows),
                      "sparse_decode_hbm_fraction": decode and decode["peak_fraction"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
