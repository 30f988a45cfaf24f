"""Request stop conditions: stop strings found across multi-byte characters, checking only the output's tail;
min_tokens in the step's token masks and in the stop checks."""

import collections

from serving.base.request import Request
from serving.base.sampling import SamplingParams


def test_stop_string_split_across_tokens_and_characters_is_found_from_the_tail():
    text = "a" * 300 + "héé!" + "zzz"
    tokens = list(text.encode())  # one byte per token: "é" is split over two tokens
    lengths = []

    def detokenize(ids):
        lengths.append(len(ids))
        return bytes(ids).decode(errors="replace")

    request = Request("r", [1], SamplingParams(stop=["é!", "never"], max_tokens=1000, seed=0))
    for token in tokens:
        request.accept(token, None, None, detokenize)
        if request.finish_reason:
            break
    assert request.finish_reason == "stop" and request.text == "a" * 300 + "hé"
    assert request.output == tokens[: len(("a" * 300 + "héé!").encode())]
    assert max(lengths[:-1]) <= 4 * len("never") + 4  # only the confirming decode reads the whole output


def test_min_tokens_masks_stops_at_the_positions_before_it():
    """The step's masks refuse EOS and the stop ids at each verify position that would emit one of a request's
    first min_tokens tokens (tokens in flight counted), keep EOS for ignore_eos, leave other rows and tokens
    alone, and keep the stops where a constraint allows nothing else; the request itself stops on neither
    within those tokens, nor on a stop string that starts in their text."""
    import numpy as np

    from model.api import abstract_model
    from model.config import preset
    from serving.structured.grammar_mask import ALL_ALLOWED
    from serving.base.request import Row
    from serving.structured.structured_outputs import StructuredOutputs

    model = abstract_model(preset("tiny"))  # shapes only: the masks need its eos and vocabulary
    eos, vocab, verify = model.config.eos_token_id, model.config.vocab_size, 3
    structured = StructuredOutputs(model, None, False, {"grammar_seconds": 0.0})

    def row(params, output=(), in_flight=(), sample=True):
        request = Request("r", [5], params)
        request.output, request.in_flight = list(output), collections.deque(in_flight)
        return Row(request, [5], 0, False, False, sample, [0])

    rows = [row(SamplingParams(min_tokens=4, stop_token_ids=[200], max_tokens=9), output=[7], in_flight=[1]),
            row(SamplingParams(min_tokens=2, ignore_eos=True, stop_token_ids=[3], max_tokens=9)),
            row(SamplingParams(min_tokens=5, max_tokens=9), sample=False),
            row(SamplingParams(max_tokens=9))]
    masks = np.full((len(rows), verify, (vocab + 31) // 32), ALL_ALLOWED, np.int32)
    out = structured.bitmask(rows, masks)

    def allowed(i, j):
        bits = np.unpackbits(out[i, j].view(np.uint8), bitorder="little")[:vocab]
        return set(np.flatnonzero(bits == 0).tolist())  # the refused tokens

    # row 0: 2 tokens sampled or in flight, so positions 0 and 1 emit its 3rd and 4th tokens
    assert [allowed(0, j) for j in range(verify)] == [{eos, 200}, {eos, 200}, set()]
    assert [allowed(1, j) for j in range(verify)] == [{3}, {3}, set()]
    assert all(allowed(i, j) == set() for i in (2, 3) for j in range(verify))
    only_eos = np.zeros((1, 1, masks.shape[-1]), np.int32)
    only_eos[0, 0, 0] = 1 << eos
    kept = structured.bitmask([row(SamplingParams(min_tokens=3, max_tokens=9))], only_eos.copy())
    np.testing.assert_array_equal(kept, only_eos)
    # no row short of its min_tokens: the all-allowed masks, unchanged
    plain = structured.bitmask(rows[3:], np.full((1, verify, masks.shape[-1]), ALL_ALLOWED, np.int32))
    assert (np.asarray(plain) == ALL_ALLOWED).all()

    request = Request("r", [1], SamplingParams(min_tokens=3, stop=["b"], stop_token_ids=[9], max_tokens=9))
    for token in [9, ord("b"), ord("a"), ord("b"), ord("c")]:
        request.accept(token, None, eos, lambda ids: bytes(t for t in ids if t != 9).decode())
        if request.finish_reason:
            break
    assert request.finish_reason == "stop" and request.output == [9, ord("b"), ord("a"), ord("b")]
    assert request.text == "ba"
