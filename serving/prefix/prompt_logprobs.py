"""Prompt logprobs (a completion's `echo` with `logprobs`): each prompt token's logprob given the tokens before it,
as the engine's prefill computes them (`serving.core.step.prompt_logprobs`), and the store that lets a prefix-cache
hit skip computing them again.

A request that asks for them holds `prompt_logprobs`, one entry per prompt token (the first None: nothing
predicts it), filled as its prefill chunks are read. Entry i depends on the prompt's first i + 1 tokens only,
so the entries a page of positions predicts (entries kP + 1 .. (k + 1)P for page k of P tokens) are filed under
the digest of the prompt's first (k + 1)P tokens and the token after them; a later request with the same prefix
copies them, and its prefill (which the prefix cache lets start no later than they reach,
`serving.prefix.prefix_admission`) computes the entries after them."""

from __future__ import annotations

import collections

from serving.base.request import Request, TokenLogprob
from serving.prefix.window_snapshots import boundary_keys, put_newest


class PromptLogprobStore:
    """Prompt-logprob entries by page of prompt positions (`page_tokens` each), at most `capacity` pages, least
    recently used dropped first."""

    def __init__(self, page_tokens: int, capacity: int):
        self.page_tokens, self.capacity = page_tokens, capacity
        self.pages: collections.OrderedDict[bytes, tuple] = collections.OrderedDict()
        self.hits = 0  # prompt tokens whose logprobs came from the store

    def fill(self, request: Request) -> int:
        """Copy the stored entries of the request's leading pages into its `prompt_logprobs`; returns the last
        prompt position whose entry the prompt's first entries up to it now all have (a multiple of the page
        size; 0: none): its prefill may start there."""
        prompt, block, covered = request.prompt, self.page_tokens, 0
        for end, key in boundary_keys(prompt, block, len(prompt) - 1):
            entries = self.pages.get((key, prompt[end]))
            if entries is None:
                break
            self.pages.move_to_end((key, prompt[end]))
            request.prompt_logprobs[end - block + 1:end + 1] = entries
            covered = end
        self.hits += covered
        return covered

    def put(self, request: Request) -> None:
        """File the entries of every full page of positions of the request's prompt (all of them computed)."""
        prompt, block, entries = request.prompt, self.page_tokens, request.prompt_logprobs
        for end, key in boundary_keys(prompt, block, len(prompt) - 1):
            page = entries[end - block + 1:end + 1]
            if any(e is None for e in page):
                return
            put_newest(self.pages, (key, prompt[end]), tuple(page), self.capacity)


def scores(request: Request, start: int, count: int) -> bool:
    """Whether a prefill row of `request` over positions [start, start + count) computes prompt-logprob entries
    it still lacks (entry p + 1 from position p)."""
    entries = request.prompt_logprobs
    return entries is not None and any(e is None for e in entries[start + 1:start + count + 1])


def record(request: Request, start: int, logprobs, top_ids, top_logprobs) -> bool:
    """Set the prompt-logprob entries still missing that a prefill row starting at position `start` computed
    (position p gives entry p + 1; `logprobs` [t], `top_ids` / `top_logprobs` [t, n] of the row's real tokens,
    host arrays; an entry already set came from the store or an earlier prefill and stays); returns whether
    every entry of the prompt is now set."""
    entries, n = request.prompt_logprobs, len(request.prompt)
    for j in range(min(len(logprobs), n - 1 - start)):
        if entries[start + j + 1] is None:
            entries[start + j + 1] = TokenLogprob(request.prompt[start + j + 1], float(logprobs[j]),
                                                  [(int(t), float(v)) for t, v in zip(top_ids[j], top_logprobs[j])])
    return all(e is not None for e in entries[1:])
