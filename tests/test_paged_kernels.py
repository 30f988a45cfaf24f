"""The paged kernels (`pallas_kernels.paged_attention`) equal their references, reading the shared page pool in
place through block tables: every page no row's table lists, and every stale entry of a row's own pages past
its live count, holds NaN for the kernels (the references see zeros there), so a kernel that reads an entry it
may not use shows NaN."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import paged_attention as paged
from model import registry
from tests.test_kernels import close, in_bounds, triton_problems  # noqa: F401  (in_bounds: a fixture)

pytestmark = [pytest.mark.kernels, pytest.mark.usefixtures("in_bounds")]  # no index outside an array
B, C, H, D, N_WINDOW, PER_PAGE, ROW_PAGES, POOL_PAGES = 2, 2, 4, 16, 6, 4, 3, 9


def paged_case(rng, live, c=C):
    """q (`c` queries a row), window kv, window ids / valid, sink, block tables [B, ROW_PAGES] (distinct pages of
    a POOL_PAGES pool), and the pool with NaN / zeros outside each row's first `live[row]` entries."""
    q = rng.normal(size=(B, c, H, D)).astype(np.float32)
    kv = rng.normal(size=(B, N_WINDOW, D)).astype(np.float32)
    ids = rng.integers(0, N_WINDOW, size=(B, c, N_WINDOW)).astype(np.int32)
    valid = rng.random((B, c, N_WINDOW)) < 0.7
    valid[:, :, 0] = True
    table = rng.permutation(POOL_PAGES)[:B * ROW_PAGES].reshape(B, ROW_PAGES).astype(np.int32)
    pages = rng.normal(size=(POOL_PAGES, PER_PAGE, D)).astype(np.float32)
    owned = np.zeros((POOL_PAGES, PER_PAGE), bool)
    for row in range(B):
        entries = np.arange(ROW_PAGES * PER_PAGE) < live[row]
        owned[table[row]] = entries.reshape(ROW_PAGES, PER_PAGE)
    sink = rng.normal(size=(H,)).astype(np.float32)
    nan_pages = np.where(owned[..., None], pages, np.nan).astype(np.float32)
    zero_pages = np.where(owned[..., None], pages, 0.0).astype(np.float32)
    return tuple(map(jnp.asarray, (q, kv, ids, valid, sink, table, nan_pages, zero_pages)))


def test_global_slots_resolve_through_the_table():
    table = jnp.asarray([[5, 2], [0, 7]], jnp.int32)
    ids = jnp.asarray([[[0, 3, 4, -1]], [[7, 1, -1, 5]]], jnp.int32)
    expected = [[[20, 23, 8, -1]], [[31, 1, -1, 29]]]  # page * 4 + offset by hand
    np.testing.assert_array_equal(paged.global_slots(table, ids, 4), expected)


def test_paged_sink_attention_equals_reference():
    rng = np.random.default_rng(0)
    live = [9, 12]
    q, kv, ids, valid, sink, table, nan_pages, zero_pages = paged_case(rng, live)
    picks = np.stack([rng.integers(0, n, size=(C, 5)) for n in live]).astype(np.int32)
    picks[:, :, -1] = -1  # a query's missing picks, as the indexer emits them
    picks = jnp.asarray(picks)
    expected = paged.paged_sink_attention_reference(q, kv, ids, valid, sink, zero_pages, table, picks)
    close(paged.paged_sink_attention(q, kv, ids, valid, sink, nan_pages, table, picks), expected)


# nothing yet / a partial page / most of the table; 12 queries: the prefill form, every prefix from 0 to all
@pytest.mark.parametrize("visible", [(0, 3), (5, 10), (*range(11), 10)])
def test_paged_hca_attention_reads_only_visible_entries(visible):
    rng = np.random.default_rng(sum(visible))
    q, kv, ids, valid, sink, table, nan_pages, zero_pages = paged_case(rng, [10, 10], len(visible))
    visible = jnp.asarray(visible, jnp.int32)
    expected = paged.paged_hca_attention_reference(q, kv, ids, valid, sink, zero_pages, table, visible)
    close(paged.paged_hca_attention(q, kv, ids, valid, sink, nan_pages, table, visible), expected)


@pytest.mark.parametrize("visible", [(5,), (3, 7), (0, 2, 4, 5, 7, 7)])  # 1, 2 and 6 queries (query blocks)
def test_paged_index_scores_equal_reference(visible):
    rng = np.random.default_rng(2 + len(visible))
    c = len(visible)
    q, _, _, _, _, table, nan_pages, zero_pages = paged_case(rng, [7, 7], c)
    weights = jnp.asarray(rng.normal(size=(B, c, H)), jnp.float32)
    visible = jnp.asarray(visible, jnp.int32)
    expected = paged.paged_index_scores_reference(q, zero_pages, table, weights, visible)
    assert expected.shape == (B, c, ROW_PAGES * PER_PAGE)
    assert np.isinf(np.asarray(expected)[:, 0, int(visible[0]):]).all()
    close(paged.paged_index_scores(q, nan_pages, table, weights, visible), expected)


def test_paged_kernels_take_pools_of_empty_pages():
    """A dense cache shorter than one window (`model.paged.row_pages`: one page of max_len // ratio = 0 entries a
    row) has nothing to score or attend beyond the window: the kernels equal their references."""
    rng = np.random.default_rng(3)
    q, kv, ids, valid, sink, _, _, _ = paged_case(rng, [0, 0])
    pages, table = jnp.zeros((B, 0, D), jnp.float32), jnp.arange(B, dtype=jnp.int32)[:, None]
    weights, visible = jnp.asarray(rng.normal(size=(B, C, H)), jnp.float32), jnp.zeros((C,), jnp.int32)
    scores = paged.paged_index_scores(q, pages, table, weights, visible)
    assert scores.shape == (B, C, 0)
    np.testing.assert_array_equal(scores, paged.paged_index_scores_reference(q, pages, table, weights, visible))
    picks = jnp.zeros((B, C, 0), jnp.int32)
    close(paged.paged_sink_attention(q, kv, ids, valid, sink, pages, table, picks),
          paged.paged_sink_attention_reference(q, kv, ids, valid, sink, pages, table, picks))
    close(paged.paged_hca_attention(q, kv, ids, valid, sink, pages, table, visible),
          paged.paged_hca_attention_reference(q, kv, ids, valid, sink, pages, table, visible))


def test_index_top_k_ties_go_to_the_lower_entry():
    """Equal keys give equal scores; both implementations pick the lower entries, and -1 past the visible."""
    from model.compressor import top_visible

    q, weights = jnp.ones((1, 2, H, D), jnp.float32), jnp.ones((1, 2, H), jnp.float32)
    pages, table = jnp.ones((POOL_PAGES, PER_PAGE, D), jnp.float32), jnp.asarray([[7, 0, 4]], jnp.int32)
    visible = jnp.asarray([3, 9], jnp.int32)
    for impl in registry.IMPLEMENTATIONS:
        with registry.use(impl):
            picks = top_visible(registry.op("paged_index_scores")(q, pages, table, weights, visible), 5)
        np.testing.assert_array_equal(picks[0], [[0, 1, 2, -1, -1], [0, 1, 2, 3, 4]])


@pytest.mark.parametrize("variant", ["sm90", "sm100"])
def test_paged_kernels_fit_triton(variant):
    """At the GPU tile sizes every array the kernel bodies compute has power-of-two dimensions and every block
    divides its array, for query, window and pick counts that are not powers of two, in the decode and the
    prefill form (`triton_problems`)."""
    z = jnp.zeros
    q, kv, ids, valid, sink = z((2, 3, 4, 16)), z((2, 23, 16)), z((2, 3, 16), jnp.int32), z((2, 3, 16), bool), z((4,))
    pages, table = z((9, 32, 16)), z((2, 3), jnp.int32)
    cases = {"attention": (paged.paged_sink_attention, (q, kv, ids, valid, sink, pages, table,
                                                         z((2, 3, 5), jnp.int32))),
             "hca": (paged.paged_hca_attention, (q, kv, ids, valid, sink, pages, table, jnp.arange(3))),
             "prefill hca": (paged.paged_hca_attention, (z((2, 12, 4, 16)), kv, z((2, 12, 16), jnp.int32),
                                                         z((2, 12, 16), bool), sink, pages, table, jnp.arange(12))),
             "index scores": (paged.paged_index_scores, (z((2, 6, 4, 16)), pages, table, z((2, 6, 4)),
                                                         jnp.arange(6))),
             "index scores, 1 query": (paged.paged_index_scores, (z((2, 1, 4, 16)), pages, table, z((2, 1, 4)),
                                                                  jnp.arange(1)))}
    for name, (fn, args) in cases.items():
        assert triton_problems(variant, fn, *args) == [], name
