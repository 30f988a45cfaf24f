"""Every Pallas kernel equals its reference (interpret mode on CPU; compiled on a GPU by scripts/gpu_check.sh).

Unused pool rows, unchosen experts and unread pages hold NaN, so a kernel that reads past what it may use
shows NaN in its output; the references see zeros there. What interpret mode cannot show is checked apart:
`triton_problems` (traced for the GPU tiles, on any machine) finds arrays Triton rejects (not powers of two) and
blocks that run past their arrays; the `in_bounds` fixture finds gathers and slices outside an array.
"""

import contextlib
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify
from jax.experimental import pallas as pl
from jax.extend import core as jax_core

from model.quant import dequant_fp4_packed, dequant_fp8_blocks, quantize_fp4_packed, quantize_fp8_blocks
from model import registry
from pallas_kernels import fp4_experts, hyper, moe, paged_attention, quant_linear, sparse_attention, tuning
from xla_cpu import fp4_experts as cpu_fp4_experts, linear as cpu_linear, moe as cpu_moe
from xla_cpu.expert_views import ExpertViews, expert_views
from xla_cpu.transposed_weights import TransposedWeight, logical, transposed

pytestmark = pytest.mark.kernels
ON_GPU = jax.default_backend() == "gpu"
TOL = 2e-2 if ON_GPU else 1e-5  # compiled GPU kernels use tensor-core (tf32 / bf16) matmuls


@contextlib.contextmanager
def out_of_bounds_indexing():
    """Inside: each `pallas_call` (interpret mode) runs under `checkify` index checks and appends to the yielded
    list every gather or slice its kernel makes outside an array. Interpret mode clamps such an index silently;
    a GPU reads or writes another buffer, or faults. JAX has no checkify rule for `pallas_call`: the one set here
    checks the interpreter's own evaluation of the kernel (private JAX modules, test-only)."""
    from jax._src import checkify as checkify_rules
    from jax._src.pallas import hlo_interpreter
    from jax._src.pallas.pallas_call import pallas_call_p

    def rule(ctx, error, enabled_errors, *args, interpret, **params):
        del interpret  # the interpreter is called directly
        interpreted = jax.make_jaxpr(functools.partial(hlo_interpreter.pallas_call_hlo_interpret, **params))(*args)
        return checkify_rules.checkify_jaxpr(ctx, interpreted, enabled_errors, error, *args)

    errors = []
    pallas_call = pl.pallas_call

    def checked_pallas_call(*args, **kwargs):
        call = pallas_call(*args, **kwargs)

        def run(*operands):
            error, out = checkify.checkify(call, errors=checkify.index_checks)(*operands)
            jax.debug.callback(lambda e: errors.append(f"{kwargs.get('name')}: {e.get()}") if e.get() else None,
                               error)
            return out

        return run

    checkify_rules.error_checks[pallas_call_p] = rule
    pl.pallas_call = checked_pallas_call
    try:
        yield errors
    finally:
        pl.pallas_call = pallas_call
        del checkify_rules.error_checks[pallas_call_p]


@pytest.fixture
def in_bounds():
    """Fails the test if a kernel it runs indexes outside an array (`out_of_bounds_indexing`); on a GPU, where
    the kernels are compiled, a no-op."""
    if ON_GPU:
        yield
        return
    with out_of_bounds_indexing() as errors:
        yield
    assert not errors, errors


def _inner_jaxprs(eqn):
    for param in eqn.params.values():
        for sub in param if isinstance(param, (tuple, list)) else (param,):
            if isinstance(sub, (jax_core.Jaxpr, jax_core.ClosedJaxpr)):
                yield getattr(sub, "jaxpr", sub)


def _kernel_calls(jaxpr):
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            yield eqn.params
        else:
            for inner in _inner_jaxprs(eqn):
                yield from _kernel_calls(inner)


def _values(jaxpr):
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            yield eqn.primitive.name, var.aval
        for inner in _inner_jaxprs(eqn):
            yield from _values(inner)


def triton_problems(variant: str, fn, *args) -> list[tuple]:
    """What stops `fn`'s kernels, traced for GPU variant `variant`, from lowering to Triton or from staying in
    their arrays: every array a kernel body computes (loads, gathers, intermediates, at any depth of control
    flow) whose dimensions are not all powers of two (Pallas' Triton lowering rejects such loads and stores,
    Triton any such tensor), and every block that does not divide its array (JAX before 0.12 lowers its loads
    and stores unmasked, past the array; interpret mode pads such blocks, so interpreted tests never see it)."""
    with tuning.target(variant):
        traced = jax.make_jaxpr(fn)(*args)
    problems = []
    for call in _kernel_calls(traced.jaxpr):
        problems += [(call["name"], prim, aval.shape) for prim, aval in _values(call["jaxpr"])
                     if isinstance(aval, jax.core.ShapedArray) and any(d & (d - 1) for d in aval.shape)]
        for mapping in call["grid_mapping"].block_mappings:
            block = tuple(getattr(dim, "block_size", 1) for dim in mapping.block_shape)
            if any(size % b for size, b in zip(mapping.array_aval.shape, block)):
                problems.append((call["name"], "block", block, mapping.array_aval.shape))
    return problems


def close(actual, expected, tol=TOL):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert actual.shape == expected.shape
    assert np.isfinite(actual).all() == np.isfinite(expected).all() or np.isfinite(actual[np.isfinite(expected)]).all()
    np.testing.assert_allclose(actual, expected, rtol=tol, atol=tol)


def attention_case(rng, b, c, h, d, n_window, n_entries, k_picks, nan=True):
    """q, pools (NaN-filled where unused, zero-filled), ids, valid, sink for window + picked entries.

    Pool rows: [window slots | entries]; only valid ids point at finite rows."""
    n = n_window + n_entries
    q = rng.normal(size=(b, c, h, d)).astype(np.float32)
    pool = rng.normal(size=(b, n, d)).astype(np.float32)
    win = rng.integers(0, n_window, size=(b, c, n_window))
    win_ok = rng.random((b, c, n_window)) < 0.7
    win_ok[:, :, 0] = True
    picks = rng.integers(0, max(n_entries, 1), size=(b, c, k_picks)) + n_window
    picks_ok = rng.random((b, c, k_picks)) < 0.6
    picks = np.where(picks_ok, picks, -1)  # invalid picks are -1, as the indexer emits them
    ids = np.concatenate([win, picks], -1).astype(np.int32)
    valid = np.concatenate([win_ok, picks_ok], -1)
    used = np.zeros((b, n), bool)
    for row in range(b):
        used[row, ids[row][valid[row]]] = True
    unused_nan = np.where(used[..., None], pool, np.nan if nan else 0.0).astype(np.float32)
    unused_zero = np.where(used[..., None], pool, 0.0).astype(np.float32)
    sink = rng.normal(size=(h,)).astype(np.float32)
    return tuple(map(jnp.asarray, (q, unused_nan, unused_zero, ids, valid, sink)))


@pytest.mark.parametrize("c", [1, 3, 12])  # decode, decode with MTP (gamma + 1 = 3), prefill
def test_sparse_attention_equals_reference(c):
    rng = np.random.default_rng(c)
    q, pool_nan, pool, ids, valid, sink = attention_case(rng, 2, c, 4, 16, 9, 14, 7)
    expected = sparse_attention.sink_attention_reference(q, pool, ids, valid, sink)
    close(sparse_attention.sink_attention(q, pool_nan, ids, valid, sink), expected)


def test_sparse_attention_rows_with_nothing_visible_give_zero(in_bounds):
    rng = np.random.default_rng(0)
    q, pool_nan, pool, ids, valid, sink = attention_case(rng, 1, 2, 4, 16, 5, 6, 5)
    valid = valid.at[:, 1].set(False)
    out = sparse_attention.sink_attention(q, jnp.nan_to_num(pool_nan), ids, valid, sink)
    close(out, sparse_attention.sink_attention_reference(q, pool, ids, valid, sink))
    assert float(jnp.abs(out[:, 1]).max()) == 0.0


def test_sparse_attention_under_vmap_per_row():
    """The engine runs the attention core per row under vmap: the kernel batches."""
    rng = np.random.default_rng(1)
    q, pool_nan, pool, ids, valid, sink = attention_case(rng, 3, 2, 4, 16, 7, 9, 5)

    def per_row(fn, pool):
        return jax.vmap(lambda *a: fn(*(x[None] for x in a), sink)[0])(q, pool, ids, valid)

    close(per_row(sparse_attention.sink_attention, pool_nan), per_row(sparse_attention.sink_attention_reference, pool))


def moe_case(rng, t, k, e, d=32, i=48, unused=()):
    x = jnp.asarray(rng.normal(size=(t, d)), jnp.float32)
    choices = [x for x in range(e) if x not in unused]
    ids = jnp.asarray(np.stack([rng.choice(choices, k, replace=False) for _ in range(t)]), jnp.int32)
    weights = jnp.asarray(rng.random((t, k)), jnp.float32)
    ws = [rng.normal(size=shape).astype(np.float32) * 0.3 for shape in ((e, i, d), (e, d, i), (e, i, d))]
    return x, ids, weights, ws


@pytest.mark.parametrize("t,k,e", [(1, 2, 8), (13, 2, 4), (40, 3, 6)])  # decode, ragged groups, more experts
def test_routed_experts_equal_reference(t, k, e):
    rng = np.random.default_rng(t)
    x, ids, weights, ws = moe_case(rng, t, k, e, unused=(e - 1,))  # one expert gets no token
    expected = moe.routed_experts_reference(x, ids, weights, *map(jnp.asarray, ws), 10.0)
    close(expected, _experts_numpy(x, ids, weights, *ws, 10.0), 1e-5)
    unchosen = ~np.isin(np.arange(e), np.asarray(ids))
    ws_nan = [np.where(unchosen.reshape(-1, 1, 1), np.nan, w) for w in ws]  # experts nobody chose: never read
    for implementation in (moe.routed_experts, cpu_moe.routed_experts):  # Pallas, the XLA:CPU forms
        close(implementation(x, ids, weights, *map(jnp.asarray, ws_nan), 10.0), expected)


@pytest.mark.skipif(ON_GPU, reason="expert views alias host memory (the CPU backend's)")
@pytest.mark.parametrize("t,k,e", [(1, 2, 8), (2, 3, 8)])  # decode of one token, of two
def test_expert_views_read_only_the_chosen_experts(t, k, e):
    """Given per-expert views aliasing the stacks, the reference runs each pair through a switch over the experts'
    own arrays: equal to float64 numpy, with NaN in every expert nobody chose (never read)."""
    rng = np.random.default_rng(11 + t)
    x, ids, weights, ws = moe_case(rng, t, k, e, unused=(0,))
    unchosen = ~np.isin(np.arange(e), np.asarray(ids))
    stacks = [jnp.asarray(np.where(unchosen.reshape(-1, 1, 1), np.nan, w)) for w in ws]
    views = [expert_views(stack) for stack in stacks]
    for stack, parts in zip(stacks, views):
        assert [p.unsafe_buffer_pointer() - stack.unsafe_buffer_pointer() for p in parts] == \
            [j * stack[0].nbytes for j in range(e)]
    got = jax.jit(lambda *v: cpu_moe.routed_experts(x, ids, weights, *map(ExpertViews, v), 10.0))(*views)
    close(got, _experts_numpy(x, ids, weights, *ws, 10.0), 1e-5)


@pytest.mark.skipif(ON_GPU, reason="the split is XLA:CPU's")
@pytest.mark.parametrize("lead,out,inp", [((1,), 512, 512), ((1, 1), 96, 40), ((1,), 2048, 1024), ((1,), 7, 16)])
def test_one_row_dot_splits_small_weights_by_core(lead, out, inp):
    """One row through a small fp32 weight runs as a product batched over one group of rows per core (the
    largest count that divides the rows); from 4 MiB up, one product. Either way x W^T as float64 numpy."""
    rng = np.random.default_rng(out)
    x, w = rng.normal(size=(*lead, inp)).astype(np.float32), (rng.normal(size=(out, inp)) / inp**0.5).astype(np.float32)
    cores = len(os.sched_getaffinity(0))  # the machine's, as XLA:CPU's thread pool sees it
    expected_groups = 1 if out * inp * 4 >= 2**22 else max(g for g in range(1, cores + 1) if out % g == 0)
    assert cpu_linear.gemv_groups(jnp.asarray(w)) == expected_groups
    got = jax.jit(cpu_linear.dot_f32)(jnp.asarray(x), jnp.asarray(w))
    close(got, x.astype(np.float64) @ w.T, 1e-5)
    close(got, quant_linear.dot_f32(jnp.asarray(x), jnp.asarray(w)), 1e-5)


@pytest.mark.parametrize("lead,out,inp", [((1,), 512, 512), ((16,), 512, 512), ((1, 1), 96, 40), ((3, 5), 7, 16)])
def test_transposed_weight_dot_equals_float64(lead, out, inp):
    """x W^T through W held as W^T (`TransposedWeight`: one row split along i, one group per core; more rows one
    product) is float64 numpy's, and the held weight says W's shape."""
    rng = np.random.default_rng(inp)
    x, w = rng.normal(size=(*lead, inp)).astype(np.float32), (rng.normal(size=(out, inp)) / inp**0.5).astype(np.float32)
    held = transposed(jnp.asarray(w))
    assert held.shape == w.shape and held.t.shape == (inp, out)
    np.testing.assert_array_equal(logical(held), w)
    with pytest.raises(TypeError, match="indices of its leading"):
        held[0]  # a matrix has no stack axis to index
    close(jax.jit(cpu_linear.dot_f32)(jnp.asarray(x), held), x.astype(np.float64) @ w.T, 1e-5)


def test_transposed_grouped_weight_dot_equals_float64():
    """A grouped weight [g, o, i] held transposed maps each group of x's group axis through its own slice."""
    rng = np.random.default_rng(3)
    x, w = rng.normal(size=(5, 4, 24)).astype(np.float32), rng.normal(size=(4, 16, 24)).astype(np.float32) / 5
    expected = np.einsum("rgi,goi->rgo", x.astype(np.float64), w.astype(np.float64))
    close(jax.jit(cpu_linear.dot_f32)(jnp.asarray(x), transposed(jnp.asarray(w))), expected, 1e-5)


@pytest.mark.skipif(ON_GPU, reason="expert views alias host memory (the CPU backend's)")
@pytest.mark.parametrize("t,k,e,form", [(1, 2, 8, "views"), (1, 2, 8, "pairs"), (4, 2, 8, "dense"),
                                        (16, 2, 8, "passes"), (40, 2, 8, "tiles")])
def test_xla_cpu_routed_experts_read_transposed_stacks(t, k, e, form):
    """Expert stacks held transposed (`model.host_layout`), in each XLA:CPU form (per-expert views, pairs one by
    one, every token through every expert, passes over the stacks, sorted tiles): float64 numpy, and the
    reference on the stacks as stored."""
    rng = np.random.default_rng(t + 17)
    x, ids, weights, ws = moe_case(rng, t, k, e)
    held = [transposed(jnp.asarray(w)) for w in ws]
    if form == "views":
        parts = [expert_views(h.t) for h in held]
        run = lambda *v: cpu_moe.routed_experts(  # noqa: E731
            x, ids, weights, *(TransposedWeight(ExpertViews(p)) for p in v), 10.0)
        got = jax.jit(run)(*parts)
    else:
        got = jax.jit(lambda *h: cpu_moe.routed_experts(x, ids, weights, *h, 10.0))(*held)
    close(got, _experts_numpy(x, ids, weights, *ws, 10.0), 1e-5)
    close(got, moe.routed_experts_reference(x, ids, weights, *map(jnp.asarray, ws), 10.0), 1e-5)


def test_routed_experts_all_tokens_on_one_expert(in_bounds):
    rng = np.random.default_rng(5)
    x, _, weights, ws = moe_case(rng, 9, 1, 4)
    ids = jnp.full((9, 1), 2, jnp.int32)
    ws = list(map(jnp.asarray, ws))
    close(moe.routed_experts(x, ids, weights, *ws, 10.0), moe.routed_experts_reference(x, ids, weights, *ws, 10.0))


def test_sort_pairs_tiles_hold_one_expert():
    ids = jnp.asarray([[3, 0], [0, 1], [3, 0]], jnp.int32)
    rows, row_pair, tile_expert, slot = moe.sort_pairs(ids, 5, 2)
    assert tile_expert.shape == (6 // 2 + 5,)
    for pair, row in enumerate(np.asarray(slot).reshape(-1)):
        assert int(row_pair[row]) == pair and int(rows[row]) == pair // 2
        assert int(tile_expert[row // 2]) == int(ids.reshape(-1)[pair])
    assert int((tile_expert >= 0).sum()) == 4  # expert 0: 3 pairs -> 2 tiles; experts 1, 3: 1 tile each


def test_sort_pairs_gives_pairs_that_are_not_valid_no_row():
    ids = jnp.asarray([[3, 0], [0, 1], [3, 0]], jnp.int32)
    valid = jnp.asarray([[True, False], [True, True], [False, False]])
    rows, row_pair, tile_expert, slot = moe.sort_pairs(ids, 5, 2, valid)
    assert (np.asarray(slot) == rows.shape[0]).tolist() == [[False, True], [False, False], [True, True]]
    assert sorted(int(p) for p in row_pair if p >= 0) == [0, 2, 3]
    assert int((tile_expert >= 0).sum()) == 3  # experts 0, 1, 3: one pair each


def test_expert_shard_buffer_with_expected_pairs_equals_the_real_pairs():
    """An expert shard's receive buffer: a few real pairs among many of weight 0 sent to expert 0. Told how many
    are real, the reference sizes its tiles for them and gives weight-0 pairs no row: the real tokens' outputs
    equal the reference's on the real pairs alone, and an expert that only padding names is never read."""
    rng = np.random.default_rng(7)
    x, ids, weights, ws = moe_case(rng, 6, 1, 6, unused=(0,))
    buffer = 64
    xb = jnp.concatenate([x, jnp.asarray(rng.normal(size=(buffer - 6, x.shape[1])), jnp.float32)])
    idsb = jnp.concatenate([ids, jnp.zeros((buffer - 6, 1), jnp.int32)])
    wb = jnp.concatenate([weights, jnp.zeros((buffer - 6, 1), jnp.float32)])
    ws_nan = [jnp.asarray(w).at[0].set(jnp.nan) for w in ws]  # expert 0: only padding names it
    got = cpu_moe.routed_experts(xb, idsb, wb, *ws_nan, 10.0, pairs=6)
    expected = np.asarray(moe.routed_experts_reference(x, ids, weights, *map(jnp.asarray, ws), 10.0))
    np.testing.assert_allclose(np.asarray(got[:6]), expected, rtol=1e-5, atol=1e-6)
    assert not np.asarray(got[6:]).any()


@pytest.mark.parametrize("shape,given_pre", [((1, 1), False), ((2, 7), False), ((2, 7), True)])
def test_hc_site_equals_reference(shape, given_pre):
    rng = np.random.default_rng(len(shape) + given_pre)
    n, d = 4, 32
    streams = jnp.asarray(rng.normal(size=(*shape, n, d)), jnp.float32)
    fn = jnp.asarray(rng.normal(size=((2 + n) * n, n * d)), jnp.float32) * 0.1
    base = jnp.asarray(rng.normal(size=((2 + n) * n,)), jnp.float32)
    scale = jnp.asarray(rng.random(3) + 0.5, jnp.float32)
    pre = jnp.asarray(rng.random((*shape, n)), jnp.float32) if given_pre else None
    expected = hyper.hc_site_reference(streams, fn, base, scale, pre, 20, 1e-6, 1e-6)
    for a, b in zip(hyper.hc_site(streams, fn, base, scale, pre, 20, 1e-6, 1e-6), expected):
        close(a, b)


def test_registry_picks_and_forces_implementations():
    from pallas_kernels.sparse_attention import sink_attention_reference as model_sink_attention

    assert registry.default_implementation() == ("pallas" if ON_GPU else "xla_cpu")
    with registry.use("reference"):
        assert registry.op("sink_attention") is model_sink_attention
        assert registry.op("routed_experts") is moe.routed_experts_reference
        with registry.use("pallas"):
            assert registry.op("sink_attention") is sparse_attention.sink_attention
            with registry.use("xla_cpu"):  # its own forms where it has them, else the reference
                assert registry.op("routed_experts") is cpu_moe.routed_experts
                assert registry.op("sink_attention") is model_sink_attention
        assert registry.implementation() == "reference"
    assert set(registry.ops()) == {"sink_attention", "routed_experts", "hc_site", "fp8_linear", "routed_experts_fp4",
                                   "paged_sink_attention", "paged_hca_attention", "paged_index_scores", "dot_f32"}
    with pytest.raises(ValueError, match="reference"):
        registry.set_implementation("triton")
    with pytest.raises(KeyError, match="no kernel operation"):
        registry.op("dense_attention")


@pytest.mark.skipif(ON_GPU, reason="checks the interpret-mode index check")
def test_out_of_bounds_indexing_is_caught():
    """The `in_bounds` check fails on a valid id past the pool (interpret mode clamps it to the last row).
    Shapes as in the test of rows with nothing visible (compiled once)."""
    q, _, pool, ids, valid, sink = attention_case(np.random.default_rng(2), 1, 2, 4, 16, 5, 6, 5)
    with out_of_bounds_indexing() as errors:
        sparse_attention.sink_attention(q, pool, ids.at[0, 0, 0].set(40), valid.at[0, 0, 0].set(True), sink)
    assert len(errors) == 1 and "index 40 is out of bounds" in errors[0], errors


def _triton_cases():
    """Each kernel at the shapes of the equality tests above, sizes that are not powers of two included."""
    z = jnp.zeros

    def attn(c):
        return z((2, c, 4, 16)), z((2, 23, 16)), z((2, c, 16), jnp.int32), z((2, c, 16), bool), z((4,))

    def mhc(shape, pre):
        return (lambda s, f, b, sc: hyper.hc_site(s, f, b, sc, pre, 20, 1e-6, 1e-6),
                (z((*shape, 4, 32)), z((24, 128)), z((24,)), z((3,))))

    return {
        "decode attention": (sparse_attention.sink_attention, attn(3)),
        "prefill attention": (sparse_attention.sink_attention, attn(12)),
        "moe": (lambda *a: moe.routed_experts(*a, 10.0),
                (z((13, 32)), z((13, 2), jnp.int32), z((13, 2)), z((4, 48, 32)), z((4, 32, 48)), z((4, 48, 32)))),
        "fp8 linear": (lambda x, w, sc: quant_linear.fp8_linear_pallas(x, w, sc, (16, 32)),
                       (z((7, 80)), z((48, 80), jnp.float8_e4m3fn), z((3, 3), jnp.float8_e8m0fnu))),
        "fp4 experts": (lambda x, i, wt, *ws: fp4_experts.routed_experts_fp4_pallas(x, i, wt, *ws, 10.0),
                        (z((13, 64)), z((13, 2), jnp.int32), z((13, 2)), z((4, 96, 32), jnp.int8),
                         z((4, 96, 2), jnp.float8_e8m0fnu), z((4, 64, 48), jnp.int8), z((4, 64, 3), jnp.float8_e8m0fnu),
                         z((4, 96, 32), jnp.int8), z((4, 96, 2), jnp.float8_e8m0fnu))),
        "mhc, 1 token": mhc((1, 1), None),
        "mhc, 14 tokens": mhc((2, 7), None),
        "mhc, 14 tokens, given pre": mhc((2, 7), z((2, 7, 4))),
    }


@pytest.mark.parametrize("variant", ["sm90", "sm100"])
def test_kernels_fit_triton(variant):
    """On any machine: at the GPU tile sizes, every array the kernel bodies compute has power-of-two dimensions
    and every block divides its array (`triton_problems`), for problem sizes that are not powers of two."""
    for name, (fn, args) in _triton_cases().items():
        assert triton_problems(variant, fn, *args) == [], name


def _lower_for(device_kind: str, variant: str, fn, *args) -> str:
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType

    mesh = AbstractMesh((1,), ("x",), (AxisType.Explicit,),
                        abstract_device=AbstractDevice(device_kind=device_kind, num_cores=132, platform="gpu"))
    with jax.sharding.use_abstract_mesh(mesh), tuning.target(variant):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.skipif(ON_GPU, reason="lowering check for machines without a GPU")
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("device_kind,variant", [("NVIDIA H200", "sm90"), ("NVIDIA B200", "sm100")])
def test_kernels_lower_to_triton_for_nvidia(device_kind, variant):
    """Without a GPU: each kernel lowers to a Triton kernel for SM90 and SM100 at V4-like (small) shapes, the
    paged ones over a pool of 64-entry (index keys) and 1-entry (HCA entries, as the engine lays them out) pages."""
    z, bf16 = jnp.zeros, jnp.bfloat16
    cases = {
        "decode attention": (sparse_attention.sink_attention,
                             (z((2, 2, 16, 64), bf16), z((2, 200, 64), bf16), z((2, 2, 40), jnp.int32),
                              z((2, 2, 40), bool), z((16,)))),
        "decode paged attention": (paged_attention.paged_sink_attention,
                                   (z((2, 2, 16, 64), bf16), z((2, 130, 64), bf16), z((2, 2, 128), jnp.int32),
                                    z((2, 2, 128), bool), z((16,)), z((9, 64, 64), bf16), z((2, 3), jnp.int32),
                                    z((2, 2, 40), jnp.int32))),
        "prefill paged hca": (paged_attention.paged_hca_attention,
                              (z((2, 16, 16, 64), bf16), z((2, 144, 64), bf16), z((2, 16, 128), jnp.int32),
                               z((2, 16, 128), bool), z((16,)), z((201, 1, 64), bf16), z((2, 100), jnp.int32),
                               jnp.arange(16) * 6)),
        "paged index scores": (paged_attention.paged_index_scores,
                               (z((2, 4, 16, 128)), z((9, 64, 128)), z((2, 3), jnp.int32), z((2, 4, 16)),
                                jnp.arange(4) * 50)),
        "moe": (lambda *a: moe.routed_experts(*a, 10.0),
                (z((40, 256), bf16), z((40, 6), jnp.int32), z((40, 6)), z((8, 128, 256), bf16),
                 z((8, 256, 128), bf16), z((8, 128, 256), bf16))),
        "mhc": (lambda s, f, b, sc: hyper.hc_site(s, f, b, sc, z((2, 8, 4)), 20, 1e-6, 1e-6),
                (z((2, 8, 4, 256), bf16), z((24, 1024)), z((24,)), z((3,)))),
        "fp8 linear": (lambda x, w, sc: quant_linear.fp8_linear_pallas(x, w, sc, (128, 128)),
                       (z((1, 3, 512), bf16), z((384, 512), jnp.float8_e4m3fn), z((3, 4), jnp.float8_e8m0fnu))),
        "fp4 experts": (lambda x, i, wt, *ws: fp4_experts.routed_experts_fp4_pallas(x, i, wt, *ws, 10.0),
                        (z((40, 256), bf16), z((40, 6), jnp.int32), z((40, 6)), z((8, 128, 128), jnp.int8),
                         z((8, 128, 8), jnp.float8_e8m0fnu), z((8, 256, 64), jnp.int8),
                         z((8, 256, 4), jnp.float8_e8m0fnu), z((8, 128, 128), jnp.int8),
                         z((8, 128, 8), jnp.float8_e8m0fnu))),
    }
    for name, (fn, args) in cases.items():
        assert "__gpu$xla.gpu.triton" in _lower_for(device_kind, variant, fn, *args), name


def test_v41_model_with_each_implementation_equals_reference():
    """V4.1 (shared KV, two-level selection, single-pass mHC) through the registry: one 6-token step (the
    decode form, as MTP verification runs it), Pallas in interpret mode and the XLA:CPU forms == reference; and
    the same step traced for SM90 has no `triton_problems` (on the H200, 12 tokens in 16-token mHC tiles wrote past the outputs).
    The prefill form runs in the V4 oracle test with `pallas` (tests/test_parity.py)."""
    import dataclasses

    from model.initialize import init_model
    from model.config import preset

    # tiny-v41 cut to 6 layers: a sliding layer, a ratio-2 encoder group, the ratio-1 decoder KV with its
    # consumers and a re-index layer; Engram on layer 1
    config = dataclasses.replace(preset("tiny-v41"), num_hidden_layers=6, compress_ratios=(0, 2, 2, 1, 1, 1),
                                 kv_source_layer_ids=(1, 3), index_source_layer_ids=(1, 3, 5),
                                 candidate_source_layer_id=3)
    tokens = np.random.default_rng(0).integers(0, 256, (2, 6))
    logits = {}
    for impl in registry.IMPLEMENTATIONS:
        with registry.use(impl):
            model = init_model(config, seed=1)
            logits[impl] = model.step(tokens, model.init_cache(2, 16))[0]
    close(logits["pallas"], logits["reference"], 1e-4)
    close(logits["xla_cpu"], logits["reference"], 1e-4)

    model = init_model(config, seed=1)  # a fresh jit: traced for SM90, never run
    cache = model.init_cache(2, 16)
    rows, _ = model.engram.lookup(tokens, np.asarray(cache["engram_history"]))
    with registry.use("pallas"):
        assert triton_problems("sm90", model._forward, model.params, jnp.asarray(tokens, jnp.int32), cache,
                               rows) == []


def _fp8_case(rng, rows, out, inp, block):
    x = rng.normal(size=(*rows, inp)).astype(np.float32)
    w, scale = quantize_fp8_blocks(rng.normal(size=(out, inp)).astype(np.float32) * rng.uniform(0.01, 3.0), block)
    return x, w, scale, x @ dequant_fp8_blocks(w, scale, block).T  # numpy decode: the independent reference


@pytest.mark.parametrize("rows,out,inp,block", [((1, 1), 48, 80, (16, 32)), ((2, 7), 40, 96, (16, 16)),
                                                ((3,), 64, 256, (128, 128))])  # decode, partial blocks, one block
def test_fp8_linear_equals_reference(rows, out, inp, block, in_bounds):
    x, w, scale, expected = _fp8_case(np.random.default_rng(out), rows, out, inp, block)
    args = (jnp.asarray(x), jnp.asarray(w), jnp.asarray(scale), block)
    close(quant_linear.fp8_linear(*args), expected, 1e-5)
    close(quant_linear.fp8_linear_pallas(*args), expected)


def _fp4_experts_case(rng, t, k, e, d=64, i=32, unused=()):
    x, ids, weights, ws = moe_case(rng, t, k, e, d, i, unused)
    packed = [quantize_fp4_packed(w.reshape(-1, w.shape[-1])) for w in ws]
    stacks = [(p.reshape(e, -1, p.shape[-1]), s.reshape(e, -1, s.shape[-1])) for p, s in packed]
    dense = [dequant_fp4_packed(p, s).reshape(w.shape) for (p, s), w in zip(packed, ws)]
    return x, ids, weights, stacks, dense


def _experts_numpy(x, ids, weights, w1, w2, w3, limit):
    """Each token's chosen experts one by one, in float64 numpy (clamped SwiGLU)."""
    x, out = np.asarray(x, np.float64), np.zeros(x.shape)
    for t, k in np.ndindex(ids.shape):
        e = int(ids[t, k])
        gate, up = np.minimum(w1[e] @ x[t], limit), np.clip(w3[e] @ x[t], -limit, limit)
        out[t] += float(weights[t, k]) * (w2[e] @ (gate / (1 + np.exp(-gate)) * up))
    return out


def test_fp4_expert_shard_buffer_with_expected_pairs_equals_float64():
    """The FP4 XLA:CPU form on an expert shard's buffer (6 real pairs, 58 of weight 0 sent to expert 0, which only
    padding names and whose scales decode to inf): the real pairs' float64 experts, nothing for the padding."""
    rng = np.random.default_rng(9)
    x, ids, weights, ((p1, s1), (p2, s2), (p3, s3)), (w1, w2, w3) = _fp4_experts_case(rng, 6, 1, 6, unused=(0,))
    expected = _experts_numpy(x, np.asarray(ids), np.asarray(weights), w1, w2, w3, 1.0)
    pad = 58
    xb = jnp.concatenate([x, jnp.asarray(rng.normal(size=(pad, x.shape[1])), jnp.float32)])
    idsb, wb = jnp.concatenate([ids, jnp.zeros((pad, 1), jnp.int32)]), jnp.concatenate([weights, jnp.zeros((pad, 1))])
    inf_scales = [np.where(np.arange(6)[:, None, None] == 0, np.uint8(0xFF), s.view(np.uint8)).view(s.dtype)
                  for s in (s1, s2, s3)]
    stacks = map(jnp.asarray, (p1, inf_scales[0], p2, inf_scales[1], p3, inf_scales[2]))
    got = np.asarray(cpu_fp4_experts.routed_experts_fp4(xb, idsb, wb, *stacks, 1.0, pairs=6))
    close(got[:6], expected, 1e-4)
    assert not got[6:].any()


@pytest.mark.parametrize("t,k,e", [(1, 2, 8), (13, 2, 4)])  # decode; ragged groups, an expert without tokens
def test_routed_experts_fp4_equal_reference(t, k, e):
    x, ids, weights, ((p1, s1), (p2, s2), (p3, s3)), (w1, w2, w3) = _fp4_experts_case(
        np.random.default_rng(t), t, k, e, unused=(e - 1,))
    expected = _experts_numpy(x, np.asarray(ids), np.asarray(weights), w1, w2, w3, 1.0)  # the clamp bites
    args = (x, ids, weights, *map(jnp.asarray, (p1, s1, p2, s2, p3, s3)))
    close(fp4_experts.routed_experts_fp4(*args, 1.0), expected, 1e-4)
    close(cpu_fp4_experts.routed_experts_fp4(*args, 1.0), expected, 1e-4)
    nan_scales = [np.where(np.arange(e)[:, None, None] == e - 1, np.uint8(0xFF), s.view(np.uint8))
                  .view(s.dtype) for s in (s1, s2, s3)]  # the expert nobody chose decodes to inf: never read
    close(fp4_experts.routed_experts_fp4_pallas(x, ids, weights, jnp.asarray(p1), jnp.asarray(nan_scales[0]),
                                                jnp.asarray(p2), jnp.asarray(nan_scales[1]), jnp.asarray(p3),
                                                jnp.asarray(nan_scales[2]), 1.0), expected, 1e-4)
