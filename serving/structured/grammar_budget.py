"""Budget-aware closing of constrained outputs: finish the grammar before `max_tokens` cuts it.

In a constrained request's last tokens the host searches a short completion of the output (`closing_path`);
once the tokens left barely cover it, the mask allows only the tokens that spell it, so the output ends complete
within the limit whenever the path fits. `serving.base.engine_config.ClosePolicy` holds the settings. See docs/structured-outputs.md.
"""

from __future__ import annotations

import dataclasses

import llguidance as llg
import numpy as np

# Bytes in the order the closing search tries them: what ends a string, a group or a sentence first, openers last.
_RANKED_CLASSES = [b"\"'}])>", b".!?", b" ", b",;+*/|&", b"1234567890", b"abcdefghijklmnopqrstuvwxyz",
                   b"ABCDEFGHIJKLMNOPQRSTUVWXYZ", b"-_:=@#$%^~`", b"{[(<"]


def _byte_class(byte: int) -> int:
    """The rank of a byte's class: its index in `_RANKED_CLASSES`, or after them for every other byte."""
    return next((i for i, cls in enumerate(_RANKED_CLASSES) if byte in cls), len(_RANKED_CLASSES))


def _byte_rank() -> list[int]:
    """Every byte value, most closing first (classes above; then every other byte)."""
    return sorted(range(256), key=_byte_class)


@dataclasses.dataclass(frozen=True)
class TokenBytes:
    """What close mode needs of a tokenizer, built once per engine: the ids of each (non-special) token's bytes,
    and the single-byte tokens in the order the closing search tries them."""

    of_token: tuple[bytes, ...]  # per token id its bytes (b"" for special tokens)
    by_bytes: dict[bytes, tuple[int, ...]]
    longest: int  # bytes of the longest token
    search_bytes: np.ndarray  # uint8 [n]: byte values, most closing first
    search_tokens: np.ndarray  # int64 [n]: their single-byte token ids
    search_class: np.ndarray  # int64 [n]: their byte classes (the search tries two bytes of each)
    byte_token: np.ndarray  # int64 [256]: the single-byte token of each byte value (-1: none)

    @classmethod
    def of(cls, tokenizer: llg.LLTokenizer) -> TokenBytes:
        of_token = tuple(b"" if tokenizer.is_special_token(t) else tokenizer.decode_bytes([t])
                         for t in range(tokenizer.vocab_size))
        groups: dict[bytes, list[int]] = {}
        for t, data in enumerate(of_token):
            if data:
                groups.setdefault(data, []).append(t)
        ranked = [(b, groups[bytes([b])][0]) for b in _byte_rank() if bytes([b]) in groups]
        byte_token = np.full(256, -1, np.int64)
        for b, t in ranked:
            byte_token[b] = t
        return cls(of_token, {k: tuple(v) for k, v in groups.items()}, max(map(len, groups), default=1),
                   np.array([b for b, _ in ranked], np.uint8), np.array([t for _, t in ranked], np.int64),
                   np.array([_byte_class(b) for b, _ in ranked], np.int64), byte_token)

    def of_token_bytes(self, tokens: list[int]) -> bytes:
        return b"".join(self.of_token[t] for t in tokens)

    def prefix_tokens(self, path: bytes) -> list[tuple[int, int]]:
        """(token, its length in bytes) of every token whose bytes are a non-empty prefix of `path`."""
        return [(t, k) for k in range(1, min(len(path), self.longest) + 1) for t in self.by_bytes.get(path[:k], ())]

    def spelling_costs(self, path: bytes) -> tuple[int, ...]:
        """Per offset k (0 .. len(path)), the fewest tokens that spell `path[k:]`; every byte of a closing path
        has a single-byte token."""
        costs = [0] * (len(path) + 1)
        for k in range(len(path) - 1, -1, -1):
            costs[k] = 1 + min(costs[k + n] for n in range(1, min(self.longest, len(path) - k) + 1)
                               if path[k:k + n] in self.by_bytes)
        return tuple(costs)


@dataclasses.dataclass(frozen=True)
class Closing:
    """A completion of a constrained output: its bytes, whether an EOS must follow them (the grammar accepts
    there but could go on) rather than the grammar stopping by itself, and per offset the fewest tokens that
    spell the rest of the path (`TokenBytes.spelling_costs`)."""

    path: bytes
    needs_eos: bool
    costs: tuple[int, ...]

    @property
    def tokens(self) -> int:
        """The fewest tokens the completion takes, its EOS included."""
        return self.costs[0] + self.needs_eos

    def after(self, token_bytes: bytes) -> Closing | None:
        """The rest of the path once a token with these bytes is taken; None if it leaves the path."""
        if token_bytes and self.path.startswith(token_bytes):
            return Closing(self.path[len(token_bytes):], self.needs_eos, self.costs[len(token_bytes):])
        return None

    def next_tokens(self, table: TokenBytes, left: int) -> list[int]:
        """The tokens that follow the path and still leave room to finish it within `left` tokens (the fewest-
        token ones if none does); the EOS at the path's end is not among them."""
        options = [(1 + self.costs[n] + self.needs_eos, t) for t, n in table.prefix_tokens(self.path)]
        fit = [t for cost, t in options if cost <= left]
        return fit or [t for cost, t in options if cost == min(options)[0]]


def closing_path(matcher: llg.LLMatcher, table: TokenBytes, max_bytes: int = 256, max_nodes: int = 512,
                 max_repeats: int = 32) -> Closing | None:
    """A short completion of the matcher's output, or None if none of at most `max_bytes` bytes turns up within
    `max_nodes` mask computations. The matcher is left as it was.

    A depth-first search: a forced run of bytes is taken whole; otherwise it tries two bytes per byte class
    (the first and the last the grammar allows), classes in closing order, starting k ranked classes later in a
    state whose mask shows up for the (k+1)-th time on the path. A state whose mask has shown up `max_repeats`
    times on the path counts as a dead end (a loop, e.g. digits of an unbounded number); counted repetitions
    shorter than that still pass. Not always the shortest completion: the first its order leads to."""
    taken_total, nodes, path = 0, 0, bytearray()
    frames: list[list] = []  # per level: [untried search indices (best last), bytes taken, mask signature]
    seen: dict[int, int] = {}  # mask signatures on the current path, with their counts
    try:
        while True:
            if matcher.is_stopped() or matcher.is_accepting():
                return Closing(bytes(path), not matcher.is_stopped(), table.spelling_costs(bytes(path)))
            if len(path) < max_bytes and nodes < max_nodes:
                nodes += 1
                frame = _expand(matcher, table, max_bytes - len(path), seen, max_repeats)
                if frame is not None:
                    frames.append(frame)
                    if frame[1]:  # a forced run, taken
                        path += table.of_token_bytes(frame[3])
                        taken_total += frame[1]
                        continue
            # take the next untried byte of the deepest level, backtracking over exhausted levels
            while frames:
                frame = frames[-1]
                if frame[1]:
                    matcher.rollback(frame[1])
                    del path[len(path) - frame[1]:]
                    taken_total -= frame[1]
                    frame[1] = 0
                if frame[0] and nodes < max_nodes:
                    i = frame[0].pop()
                    if matcher.try_consume_tokens([int(table.search_tokens[i])]) == 1:
                        frame[1] = 1
                        path.append(int(table.search_bytes[i]))
                        taken_total += 1
                        break
                    continue
                frames.pop()
                if frame[2] is not None:
                    seen[frame[2]] -= 1
            if not frames:
                return None
    finally:
        if taken_total:
            matcher.rollback(taken_total)


def reconnect(matcher: llg.LLMatcher, table: TokenBytes, closing: Closing, eos: int) -> Closing | None:
    """`closing` (a path found from an earlier state) if it still completes the matcher's output (`eos`: an
    end-of-sequence id the matcher allows where its output is complete), else None. After the model leaves a
    closing path with a token that does not change what closes the output (one more letter of a string, one
    more digit), the old path still completes it: one validation of its bytes and an EOS, without consuming
    them, instead of a search. Whether an EOS must follow is kept from the old path (it moves the path's token
    count by one, and the grammar's own mask decides at its end)."""
    tokens = [int(table.byte_token[b]) for b in closing.path]
    if tokens and min(tokens) < 0:
        return None
    return closing if matcher.validate_tokens(tokens + [eos]) == len(tokens) + 1 else None


def _expand(matcher: llg.LLMatcher, table: TokenBytes, room: int, seen: dict[int, int], max_repeats: int
            ) -> list | None:
    """The search level of the matcher's state: a forced run taken at once ([[], bytes, None, tokens]), or the
    bytes to try ([untried, 0, signature, None]); None for a dead end (no byte allowed, or a loop)."""
    forced = matcher.compute_ff_bytes()
    if forced and len(forced) <= room:
        tokens = [int(table.byte_token[b]) for b in forced]
        took = matcher.try_consume_tokens(tokens) if min(tokens) >= 0 else 0
        if took == len(tokens):
            return [[], took, None, tokens]
        matcher.rollback(took)
    raw = matcher.compute_bitmask()
    signature = hash(raw)
    if seen.get(signature, 0) >= max_repeats:
        return None
    mask = np.frombuffer(raw, np.uint8)
    ok = np.flatnonzero((mask[table.search_tokens >> 3] >> (table.search_tokens & 7)) & 1)
    if not len(ok):
        return None
    # per class its first allowed byte, then its last (a loop on the first, '0.000...', may end on another);
    # a state seen before on the path starts from a later ranked class (a loop of spaces or of ',000' groups ends).
    # Plain lists: a few dozen bytes, where numpy's per-call cost would dominate.
    pairs: list[list[int]] = []
    for i, cls in zip(ok.tolist(), table.search_class[ok].tolist()):  # classes ascend: search bytes are ranked
        if pairs and pairs[-1][2] == cls:
            pairs[-1][1] = i
        else:
            pairs.append([i, i, cls])
    ranked = sum(cls < len(_RANKED_CLASSES) for _, _, cls in pairs)  # every other byte stays last
    if ranked:
        k = seen.get(signature, 0) % ranked
        pairs[:ranked] = pairs[k:ranked] + pairs[:k]
    seen[signature] = seen.get(signature, 0) + 1
    return [list(dict.fromkeys(i for first, last, _ in pairs for i in (first, last)))[::-1], 0, signature, None]
