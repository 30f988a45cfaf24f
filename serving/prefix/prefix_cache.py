"""Prefix cache index: a radix tree over token blocks, mapping cached prompt prefixes to KV pages.

A block is `block_tokens` consecutive tokens starting at a multiple of `block_tokens`: the engine's page, whose
size is a multiple of every compression ratio, so a cached prefix always ends on a compressed-group boundary
and its pages hold only complete groups. Each tree edge carries one or more blocks (and their pages); a node is
split when a match or an insert ends inside its edge. Only whole blocks are ever matched or inserted.

Pure host bookkeeping (`serving.prefix.prefix_admission` wires it into the engine): the tree never allocates or frees
a page itself. It holds one reference to every page it lists (`insert` says which pages it took) and hands pages
back from `evict`; the page allocator owns the counts. Requests using a cached prefix `lock` its path so eviction
skips it. Eviction is least-recently-used over unlocked leaves, from the tail of a leaf's edge.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
from typing import Sequence


@dataclasses.dataclass(eq=False)
class _Node:
    """An edge of `blocks` (token tuples) with one page each, ending at this node."""

    blocks: list[tuple[int, ...]]
    pages: list[int]
    parent: _Node | None
    children: dict[tuple[int, ...], _Node] = dataclasses.field(default_factory=dict)
    locks: int = 0
    last_use: int = 0


@dataclasses.dataclass(frozen=True)
class PrefixMatch:
    """The longest cached prefix of a query: `tokens` (a multiple of the block size) and their pages, in order."""

    tokens: int
    pages: tuple[int, ...]
    node: _Node  # the node that ends the match (the root for a miss): pass it to lock / unlock


class PrefixCache:
    """Radix tree of cached token blocks with per-path locks, LRU eviction and hit-rate counters."""

    def __init__(self, block_tokens: int):
        if isinstance(block_tokens, bool) or not isinstance(block_tokens, int) or block_tokens <= 0:
            raise ValueError(f"block_tokens must be a positive integer, got {block_tokens!r}")
        self.block_tokens = block_tokens
        self.root = _Node([], [], None)
        self._clock = itertools.count(1)
        self.cached_blocks = 0
        self.queries = self.query_tokens = self.hit_tokens = self.evicted_blocks = 0

    # ---- lookup ------------------------------------------------------------------------------------------
    def match(self, tokens: Sequence[int], record: bool = True, use: bool = True) -> PrefixMatch:
        """The longest cached prefix of `tokens` in whole blocks (a trailing partial block never matches);
        with `use` marks its path used now (False: a probe), with `record` counts the query in the hit-rate
        metrics."""
        blocks = self._blocks(tokens)
        node, pages, now = self.root, [], next(self._clock)
        i = 0
        while i < len(blocks) and blocks[i] in node.children:
            child = node.children[blocks[i]]
            same = _common(child.blocks, blocks[i:])
            if same < len(child.blocks):
                child = self._split(child, same)
            pages += child.pages
            i += same
            node = child
            if use:
                node.last_use = now
        if record:
            self.record(len(tokens), i * self.block_tokens)
        return PrefixMatch(i * self.block_tokens, tuple(pages), node)

    def record(self, query_tokens: int, hit_tokens: int) -> None:
        """Count one query of `query_tokens` tokens of which `hit_tokens` were served from the cache."""
        self.queries += 1
        self.query_tokens += query_tokens
        self.hit_tokens += hit_tokens

    def lock(self, match: PrefixMatch) -> None:
        """Pin the matched path (a request is using its pages): eviction skips it until `unlock`."""
        for node in _path(match.node):
            node.locks += 1

    def unlock(self, match: PrefixMatch) -> None:
        """Undo one `lock` of the same match."""
        path = list(_path(match.node))
        if any(node.locks == 0 for node in path):
            raise ValueError("unlock of a prefix that is not locked")
        for node in path:
            node.locks -= 1

    # ---- insert / evict ----------------------------------------------------------------------------------
    def insert(self, tokens: Sequence[int], pages: Sequence[int]) -> list[int]:
        """Cache the whole blocks of `tokens`, block i held in `pages[i]`; returns the pages the tree took (a
        reference each). Blocks already cached keep their pages: the caller's copies stay the caller's."""
        blocks = self._blocks(tokens)
        if len(pages) < len(blocks):
            raise ValueError(f"{len(blocks)} whole blocks of {self.block_tokens} tokens need as many pages, "
                             f"got {len(pages)}")
        node, now, i = self.root, next(self._clock), 0
        while i < len(blocks) and blocks[i] in node.children:
            child = node.children[blocks[i]]
            same = _common(child.blocks, blocks[i:])
            if same < len(child.blocks):
                child = self._split(child, same)
            i += same
            node = child
            node.last_use = now
        if i == len(blocks):
            return []
        taken = list(pages[i:len(blocks)])
        leaf = _Node(blocks[i:], taken, node, last_use=now)
        node.children[leaf.blocks[0]] = leaf
        self.cached_blocks += len(taken)
        return taken

    def evict(self, pages: int) -> list[int]:
        """Drop up to `pages` cached blocks, least recently used first, only from unlocked leaves (tail blocks
        of an edge first); returns the freed pages (the tree's references to them are gone)."""
        return [page for _, page in self.evict_blocks(pages)]

    def evict_blocks(self, pages: int) -> list[tuple[tuple[int, ...], int]]:
        """`evict`, naming each dropped block by the whole token prefix it ends: (prefix tokens, page)."""
        if pages < 0:
            raise ValueError(f"cannot evict {pages} pages")
        heap = [(n.last_use, id(n), n) for n in self._nodes() if not n.children and not n.locks]
        heapq.heapify(heap)
        freed: list[tuple[tuple[int, ...], int]] = []
        while heap and len(freed) < pages:
            _, _, node = heapq.heappop(heap)
            drop = min(len(node.blocks), pages - len(freed))
            before = [t for upper in reversed(list(_path(node.parent))) for block in upper.blocks for t in block]
            before += [t for block in node.blocks[:len(node.blocks) - drop] for t in block]
            for block, page in zip(node.blocks[len(node.blocks) - drop:], node.pages[len(node.pages) - drop:]):
                before += block
                freed.append((tuple(before), page))
            self.cached_blocks -= drop
            self.evicted_blocks += drop
            if drop < len(node.blocks):
                del node.blocks[-drop:], node.pages[-drop:]
                continue
            parent = node.parent
            del parent.children[node.blocks[0]]
            if parent is not self.root and not parent.children and not parent.locks:
                heapq.heappush(heap, (parent.last_use, id(parent), parent))
        return freed

    # ---- metrics -----------------------------------------------------------------------------------------
    @property
    def hit_rate(self) -> float:
        """Matched tokens over queried tokens (0 before the first query)."""
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    def metrics(self) -> dict[str, float]:
        """Counters for monitoring: queries, tokens queried / matched, hit rate, blocks cached / evicted."""
        return {"queries": self.queries, "query_tokens": self.query_tokens, "hit_tokens": self.hit_tokens,
                "hit_rate": self.hit_rate, "cached_blocks": self.cached_blocks,
                "evicted_blocks": self.evicted_blocks}

    # ---- internals ---------------------------------------------------------------------------------------
    def _blocks(self, tokens: Sequence[int]) -> list[tuple[int, ...]]:
        b = self.block_tokens
        return [tuple(int(t) for t in tokens[i:i + b]) for i in range(0, len(tokens) - b + 1, b)]

    def _split(self, node: _Node, at: int) -> _Node:
        """Cut `node`'s edge after `at` blocks; returns the new upper node (same locks and last use)."""
        upper = _Node(node.blocks[:at], node.pages[:at], node.parent, locks=node.locks, last_use=node.last_use)
        node.parent.children[upper.blocks[0]] = upper
        node.blocks, node.pages, node.parent = node.blocks[at:], node.pages[at:], upper
        upper.children[node.blocks[0]] = node
        return upper

    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())


def _common(edge: list[tuple[int, ...]], blocks: list[tuple[int, ...]]) -> int:
    """How many leading blocks `edge` and `blocks` share."""
    n = 0
    while n < min(len(edge), len(blocks)) and edge[n] == blocks[n]:
        n += 1
    return n


def _path(node: _Node):
    """`node` and its ancestors below the root."""
    while node is not None and node.parent is not None:
        yield node
        node = node.parent
