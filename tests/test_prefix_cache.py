"""The prefix cache's radix tree (`serving.prefix.prefix_cache`): matching, splitting, locks, LRU eviction, metrics.

Random operation sequences are checked against a brute-force reference: a dict from every cached block prefix
to its page (a prefix is cached iff all its shorter prefixes are).
"""

import random

import pytest

from serving.prefix.prefix_cache import PrefixCache

B = 4  # tokens per block


def seq(*blocks: int) -> list[int]:
    """Tokens of blocks whose every token is the block's id (block k = [k, k, k, k])."""
    return [b for b in blocks for _ in range(B)]


def test_match_takes_whole_blocks_and_splits_edges():
    cache = PrefixCache(B)
    assert cache.insert(seq(1, 2, 3) + [9, 9], [10, 11, 12]) == [10, 11, 12]  # the partial block is not cached
    hit = cache.match(seq(1, 2, 7))
    assert (hit.tokens, hit.pages) == (2 * B, (10, 11))
    assert cache.match(seq(1, 2, 3) + [9, 9, 9, 9]).pages == (10, 11, 12)
    assert cache.match(seq(1, 2)[:-1]).tokens == B  # 7 tokens: one whole block
    assert cache.insert(seq(1, 2, 7, 8), [20, 21, 22, 23]) == [22, 23]  # the shared blocks keep their pages
    assert cache.match(seq(1, 2, 7, 8)).pages == (10, 11, 22, 23)
    assert cache.match(seq(5)).tokens == 0 and cache.cached_blocks == 5


def test_eviction_is_lru_over_unlocked_leaves_from_the_tail():
    cache = PrefixCache(B)
    cache.insert(seq(1, 2), [10, 11])
    cache.insert(seq(3), [30])
    cache.insert(seq(1, 4), [10, 40])
    cache.match(seq(1, 2))  # 1-2 used after 3 and 1-4 were inserted
    assert cache.evict(1) == [30]
    assert cache.evict(1) == [40]
    locked = cache.match(seq(1, 2))
    cache.lock(locked)
    assert cache.evict(5) == []  # everything left is on the locked path
    cache.unlock(locked)
    assert cache.evict(1) == [11]  # the tail of the edge first; the rest stays matchable
    assert cache.match(seq(1, 2)).pages == (10,)
    assert cache.evict(5) == [10] and cache.cached_blocks == 0 and cache.evicted_blocks == 4
    with pytest.raises(ValueError, match="not locked"):
        cache.unlock(locked)


def test_a_lock_survives_a_later_split():
    cache = PrefixCache(B)
    cache.insert(seq(1, 2, 3), [10, 11, 12])
    whole = cache.match(seq(1, 2, 3))
    cache.lock(whole)
    cache.insert(seq(1, 5), [10, 50])  # splits the locked edge after block 1
    assert cache.evict(9) == [50]
    cache.unlock(whole)
    assert sorted(cache.evict(9)) == [10, 11, 12]


def test_hit_rate_counts_matched_over_queried_tokens():
    cache = PrefixCache(B)
    assert cache.hit_rate == 0.0
    cache.insert(seq(1, 2, 3), [0, 1, 2])
    cache.match(seq(1, 2, 3, 4))  # 12 of 16
    cache.match(seq(9, 9))  # 0 of 8
    assert cache.metrics() == {"queries": 2, "query_tokens": 24, "hit_tokens": 12, "hit_rate": 0.5,
                               "cached_blocks": 3, "evicted_blocks": 0}


def test_bad_arguments():
    with pytest.raises(ValueError, match="block_tokens must be a positive integer"):
        PrefixCache(0)
    with pytest.raises(ValueError, match="2 whole blocks of 4 tokens need as many pages, got 1"):
        PrefixCache(B).insert(seq(1, 2), [0])
    with pytest.raises(ValueError, match="cannot evict -1"):
        PrefixCache(B).evict(-1)


def test_random_operations_match_a_brute_force_reference():
    rng = random.Random(0)
    cache, ref, next_page, locked = PrefixCache(B), {}, 0, []
    for _ in range(3000):
        blocks = tuple(rng.randrange(3) for _ in range(rng.randrange(1, 7)))
        op = rng.random()
        if op < 0.4:
            pages = list(range(next_page, next_page + len(blocks)))
            next_page += len(blocks)
            taken = cache.insert(seq(*blocks), pages)
            new = [k for k in range(1, len(blocks) + 1) if blocks[:k] not in ref]
            assert taken == [pages[k - 1] for k in new]
            ref.update({blocks[:k]: pages[k - 1] for k in new})
        elif op < 0.8:
            hit = cache.match(seq(*blocks))
            k = max((k for k in range(len(blocks) + 1) if k == 0 or blocks[:k] in ref))
            assert (hit.tokens, hit.pages) == (k * B, tuple(ref[blocks[:j]] for j in range(1, k + 1)))
            if rng.random() < 0.3:
                cache.lock(hit)
                locked.append((hit, blocks[:k]))
        elif op < 0.9 and locked:
            cache.unlock(locked.pop(rng.randrange(len(locked)))[0])
        else:
            freed = set(cache.evict(rng.randrange(1, 4)))
            pinned = {p[:k] for _, p in locked for k in range(1, len(p) + 1)}
            gone = {prefix for prefix, page in ref.items() if page in freed}
            assert len(gone) == len(freed) and not gone & pinned
            ref = {prefix: page for prefix, page in ref.items() if prefix not in gone}
            assert all(prefix[:k] in ref for prefix in ref for k in range(1, len(prefix)))
        assert cache.cached_blocks == len(ref)
