"""Jump-forward decoding: a constrained request takes the tokens its grammar forces without sampling them.

Where the constraint allows only one continuation (a JSON key and its quotes, the fixed text between two fields
of a regex), llguidance tokenises it (`RequestGrammar.forced_tokens`). `jump_forward` appends those tokens to
the request's output at once and rewinds its prefill cursor, so the scheduler's next row for it is a prefill
row of [its last sampled token, the forced tokens] that also samples the token after them: k forced tokens
cost the request one step instead of k decode steps (in a busy batch that row runs in the iteration's prefill
step, beside the decode step of the others). The forced tokens count as outputs for the sampling penalties; the
last sampled token, counted when it was sampled, is not counted twice.

With a tokenizer where every continuation has one tokenisation, outputs are those of plain decoding; with BPE
the forced text is tokenised canonically, which the model itself might have split differently.
"""

from __future__ import annotations

from collections.abc import Callable

from serving.base.request import Request, Status, TokenLogprob


def jump_forward(request: Request, eos: int | None, detokenize: Callable[[list[int]], str] | None) -> int:
    """Append the tokens the request's constraint forces next (at most up to its `max_tokens`); returns how
    many. The request finishes ("stop") if they complete its constraint. Call only with every step of the
    request read (nothing in flight) and its drafts settled."""
    grammar = request.grammar
    if grammar is None or request.status is not Status.RUNNING or request.in_flight or request.prefilling:
        return 0
    if grammar.speculating:
        raise RuntimeError("jump_forward() while drafts are under verification: settle them first")
    forced = grammar.forced_tokens()[:request.params.max_tokens - len(request.output)]
    if not forced or not grammar.accept(forced):
        return 0
    # the slot's cache holds every token before the last sampled one (the device's next input)
    request.computed = len(request.prompt) + len(request.output) - 1
    request.counted_outputs = len(request.output)
    for token in forced:
        logprob = None if request.params.logprobs is None else TokenLogprob(token, 0.0, [(token, 0.0)])
        request.accept(token, logprob, eos, detokenize)
        if request.status is Status.FINISHED:
            break
    request.replay_outputs = len(request.output)
    if request.status is not Status.FINISHED and grammar.finished:
        request.finish("stop")
    return len(forced)
