"""Structured outputs through the engine: the bundled model's constrained outputs, sampled or greedy, with
speculation off and on, are checked by independent parsers (`jsonschema`, Python `re`); a constrained row
leaves its unconstrained neighbours' tokens as they are alone; an invalid constraint fails only its own
request; `jaxseek generate`'s JSONL bodies carry constraints; a tiny random model with a character tokenizer
runs the zero-overhead path (a constrained step's forward runs while the host reads the step before and fills
its masks) under DSpark."""

import json
import re
from pathlib import Path

import jsonschema
import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from model.initialize import init_model
from model.dspark import init_drafter
from serving.api.batch import prepare, read_jsonl, submit
from serving.structured.constraints import ConstraintSpec
from serving.core.engine import Engine
from serving.structured.grammar_mask import RequestGrammar, fill_masks, speculate_masks
from serving.api.openai_api import OpenAIRequests
from serving.base.sampling import SamplingParams
from tests.test_dspark import CONFIG, TARGET

SCHEMAS = json.loads((Path(__file__).parent / "data" / "json_schemas.json").read_text())
SHORT = ["tool_call", "matrix", "string_lengths", "const", "pattern_phone", "exact_items"]  # bounded outputs


@pytest.fixture(scope="module")
def bundled():
    from model import load_model

    return load_model()


def engine_for(model, speculation):
    engine = Engine(model, max_slots=4, max_len=160, prefill_chunk=32, max_prefill_rows=1, batch_invariant=True,
                    speculation=speculation, num_drafts=3 if speculation != "none" else None,
                    detokenize=model.tokenizer.decode)
    engine.warmup()
    return engine


@pytest.fixture(scope="module", params=["none", "fixed"])
def engine(bundled, request):
    return engine_for(bundled, request.param)


def prompt(model, text="ROMEO.\n"):
    return model.tokenizer.encode(text)


def run(engine, requests):
    """Add (prompt, params, constraint) triples; results in order."""
    ids = [engine.add_request(p, q, constraint=c) for p, q, c in requests]
    results = engine.run()
    return [results[i] for i in ids]


def test_json_schema_outputs_validate(engine, bundled):
    sampled = [(prompt(bundled), SamplingParams(temperature=1.0, max_tokens=120, seed=s),
                ConstraintSpec.json_schema(SCHEMAS[name])) for s, name in enumerate(SHORT)]
    for name, out in zip(SHORT, run(engine, sampled)):
        assert out.finish_reason == "stop", (name, out.text)
        jsonschema.validate(json.loads(out.text), SCHEMAS[name])


def test_regex_and_choice_outputs(engine, bundled):
    greedy = SamplingParams(temperature=0.0, max_tokens=60)
    patterns = [r"(yes|no), because [a-z ]{3,20}\.", r"[A-Z][a-z]{2,8} [0-9]{1,3}", r"\d{4}-\d{2}-\d{2}"]
    choices = ["Romeo", "Juliet", "Mercutio and Tybalt"]
    requests = [(prompt(bundled), greedy, ConstraintSpec.regex(p)) for p in patterns]
    requests.append((prompt(bundled), SamplingParams(temperature=1.0, seed=1, logprobs=5),
                     ConstraintSpec.choice(choices)))
    outputs = run(engine, requests)
    for pattern, out in zip(patterns, outputs):
        assert out.finish_reason == "stop" and re.fullmatch(pattern, out.text), (pattern, out.text)
    chosen = outputs[-1]
    assert chosen.text in choices and chosen.finish_reason == "stop"
    # logprobs are of the masked distribution: the first token's alternatives all start some choice
    first = chosen.logprobs[0]
    assert first.top and all(any(c.startswith(bundled.tokenizer.decode([t])) for c in choices) for t, _ in first.top)
    assert all(np.isfinite(lp.logprob) for lp in chosen.logprobs)
    assert np.exp([v for _, v in first.top]).sum() <= 1 + 1e-5


def test_unconstrained_rows_are_unchanged_and_bad_constraints_refused(engine, bundled):
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    free = prompt(bundled, "JULIET.\nO Romeo, Romeo")
    alone = run(engine, [(free, params, None)])[0]
    for bad, message in [(ConstraintSpec.regex("(unclosed"), "invalid regex"),
                         (ConstraintSpec.json_schema({"type": "object", "properties": {"a": {"type": "nope"}}}),
                          "invalid JSON Schema")]:
        with pytest.raises(ValueError, match=message):
            engine.add_request(free, params, constraint=bad)
    constrained = (prompt(bundled), SamplingParams(temperature=0.0, max_tokens=60),
                   ConstraintSpec.json_schema(SCHEMAS["tool_call"]))
    together = run(engine, [constrained, (free, params, None), constrained])
    assert together[1].token_ids == alone.token_ids and together[1].finish_reason == "length"
    jsonschema.validate(json.loads(together[0].text), SCHEMAS["tool_call"])
    assert engine.scheduler.pages.idle() == engine.layout.num_pages


def test_close_mode_ends_long_outputs_within_max_tokens(engine, bundled):
    """Sampled outputs of open-ended constraints under a tight limit: without close mode the limit cuts some
    mid-structure; with it (the engine's default) every one ends complete and validates, in both speculation
    modes."""
    limit = 24
    cases = [("json", {"type": "object"}), ("json", SCHEMAS["open_object"]), ("json", SCHEMAS["all_optional"]),
             ("regex", r"[A-Z][a-z ]{5,200}\."), ("regex", r"[0-9]+(\.[0-9]+)? ducats")]
    specs = [ConstraintSpec.json_schema(t) if k == "json" else ConstraintSpec.regex(t) for k, t in cases]
    requests = [(prompt(bundled), SamplingParams(temperature=1.0, max_tokens=limit, seed=seed), spec)
                for seed in range(2) for spec in specs]
    policy, engine.structured.close = engine.structured.close, None
    try:
        cut = run(engine, requests)
    finally:
        engine.structured.close = policy
    assert any(out.finish_reason == "length" for out in cut)
    for (_, _, spec), out in zip(requests, run(engine, requests)):
        assert out.finish_reason == "stop" and len(out.token_ids) <= limit, (spec.source, out.text)
        if spec.kind == "regex":
            assert re.fullmatch(spec.source, out.text), (spec.source, out.text)
        else:
            jsonschema.validate(json.loads(out.text), json.loads(spec.source))


def test_generate_reads_constraints_from_jsonl_bodies(engine, bundled, tmp_path):
    schema = SCHEMAS["tool_call"]
    lines = [{"url": "/v1/completions", "body": {"prompt": "ROMEO.\n", "max_tokens": 80, "response_format": {
                 "type": "json_schema", "json_schema": {"name": "call", "schema": schema}}}},
             {"url": "/v1/completions", "body": {"prompt": "ROMEO.\n", "structured_outputs": {"regex": "(Ay|Nay)!"}}},
             {"url": "/v1/completions", "body": {"prompt": "ROMEO.\n", "structured_outputs": {"regex": "(a"}}},
             {"url": "/v1/completions", "body": {"prompt": "ROMEO.\n", "structured_outputs": {"choice": "no list"}}}]
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps({"custom_id": f"r{i}", **line}) + "\n" for i, line in enumerate(lines)))
    requests = read_jsonl(path)
    prepare(requests, OpenAIRequests.for_model(bundled, "auto", None, engine.layout.max_len), {"temperature": 0.0},
            seed=0)
    assert "choice must be a non-empty list" in requests[3].error
    submit(engine, requests)
    assert "invalid regex" in requests[2].error
    assert requests[0].error is None and requests[1].error is None
    results = engine.run()
    jsonschema.validate(json.loads(results["0/0"].text), schema)
    assert results["1/0"].text in ("Ay!", "Nay!")


# ---- zero-overhead scheduling with speculation: a tiny random model and a character tokenizer -----------------
CHARS = "<>" + "0123456789abcdefghijklmnopqrstuvwxyz ,.:;-+*/()[]{}\"'!?=_#@$%"


@pytest.fixture(scope="module")
def tiny():
    assert len(CHARS) <= TARGET.vocab_size
    chars = Tokenizer(models.BPE({c.replace(" ", "\u0120"): i for i, c in enumerate(CHARS)}, [], unk_token="<"))
    chars.decoder, chars.pre_tokenizer = decoders.ByteLevel(), pre_tokenizers.ByteLevel(add_prefix_space=False)
    model = init_model(TARGET, seed=0)
    model.drafter = init_drafter(TARGET, CONFIG, seed=1)
    model.tokenizer = type("Chars", (), {"tokenizer": chars})()  # what `grammar_tokenizer` reads
    return model


@pytest.fixture(scope="module")
def tiny_engine(tiny):
    return Engine(tiny, max_slots=2, max_len=64, page_tokens=16, prefill_chunk=16, max_prefill_rows=1,
                  batch_invariant=True, speculation="dspark", verify_widths=(2, 4), num_drafts=3)


def chars_text(token_ids) -> str:
    return "".join(CHARS[t] for t in token_ids if t != TARGET.eos_token_id)


def test_zero_overhead_speculative_outputs_match_the_regex(tiny_engine):
    eos, engine = TARGET.eos_token_id, tiny_engine
    assert CHARS[eos] in "<>"  # a special character that no pattern uses
    assert engine.zero_overhead
    rng = np.random.default_rng(0)
    patterns = [r"[a-c]{3,6}(,[0-9]{1,3}){2}\.", r"\((x|y|z){1,5}\)", r"[0-9]{2}:[0-9]{2}"]
    requests = [(rng.integers(0, TARGET.vocab_size, 7).tolist(), SamplingParams(temperature=t, max_tokens=40, seed=s),
                 ConstraintSpec.regex(p)) for s, (p, t) in enumerate(zip(patterns * 2, [0.0] * 3 + [1.0] * 3))]
    free = (requests[0][0], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True), None)
    outputs = run(engine, requests + [free])
    for (_, _, spec), out in zip(requests, outputs):
        text = chars_text(out.token_ids)
        assert out.finish_reason == "stop" and re.fullmatch(spec.source, text), (spec.source, text)
    assert outputs[-1].token_ids == run(engine, [free])[0].token_ids
    assert engine.speculation_metrics()["verified_per_step"] > 0 and engine.stats["masked_during_forward"] > 0


def test_jump_forward_gives_the_same_greedy_outputs_in_fewer_steps(tiny_engine):
    """With one token per character every forced continuation has one tokenisation, so greedy outputs with
    jump-forward are those without it (penalties included: the replayed last token is not counted twice), and
    the forced runs cost one step each instead of one per token."""
    engine, rng = tiny_engine, np.random.default_rng(1)
    patterns = [r"(yes|no)-confirmed:[0-9]{2}!done", r"\{\"id\":[0-9]{1,2},\"ok\":(true|false)\}",
                r"[a-e]{2}=(abc|xyz)@host.example", r"([a-e]{3}-){4}[a-e]{3}"]
    penalties = [{}, {"repetition_penalty": 1.3}, {"frequency_penalty": 0.7}, {"frequency_penalty": 1.5}]
    requests = [(rng.integers(0, TARGET.vocab_size, 6).tolist(),
                 SamplingParams(temperature=0.0, max_tokens=40, **penalty), ConstraintSpec.regex(p))
                for p, penalty in zip(patterns, penalties)]
    results, steps = {}, {}
    for jump in (False, True):
        engine.structured.jump_forward, before = jump, engine.stats["steps"]
        results[jump] = run(engine, requests)
        steps[jump] = engine.stats["steps"] - before
    engine.structured.jump_forward = False
    for (_, _, spec), plain, jumped in zip(requests, results[False], results[True]):
        assert jumped.token_ids == plain.token_ids and jumped.finish_reason == plain.finish_reason == "stop"
        assert re.fullmatch(spec.source, chars_text(jumped.token_ids))
    assert steps[True] < steps[False], steps


def test_a_verify_row_without_drafts_gets_its_plain_mask(bundled):
    """A constrained verify row may have no drafts (its cap is 0 at its last token): its mask is the decode
    mask, whatever the other rows draft."""
    engine = Engine(bundled, max_slots=2, max_len=64)
    compiled = engine.structured.compiler().compile(ConstraintSpec.json_schema(SCHEMAS["tool_call"]))
    prefix = bundled.tokenizer.encode('{"name":"search","arguments":{"city":"')
    grammars = [RequestGrammar(compiled), RequestGrammar(compiled)]
    assert all(g.accept(prefix) for g in grammars)
    expected = np.empty((1, grammars[0].words), np.int32)
    fill_masks(grammars[:1], expected, engine.structured.executor)
    masks = np.zeros((2, 4, grammars[0].words), np.int32)
    assert speculate_masks(grammars, [[], bundled.tokenizer.encode("Ve")], masks, engine.structured.executor)[0] == 0
    np.testing.assert_array_equal(masks[0], np.repeat(expected, 4, axis=0))
    grammars[0].settle(0)
    assert grammars[0].accept(bundled.tokenizer.encode("V"))


def test_a_verify_row_completing_its_constraint_keeps_no_eos_after_it(bundled):
    """Drafts that complete a constraint admitting nothing more: the verifier's token after them can only be EOS,
    and the output ends before it, where one-token decoding stops (it never samples that EOS); an EOS the
    constraint merely allows (it could go on) stays, as one-token decoding would take it."""
    engine = Engine(bundled, max_slots=2, max_len=64)
    structured, eos = engine.structured, bundled.config.eos_token_id
    for pattern, text, kept in ((r"Romeo\.", "Romeo.", None), (r"Romeo\.?", "Romeo", "all")):
        drafts = bundled.tokenizer.encode(text)
        grammar = structured.grammar(ConstraintSpec.regex(pattern), None, 32)
        masks = np.zeros((1, len(drafts) + 1, grammar.words), np.int32)
        assert speculate_masks([grammar], [drafts], masks, structured.executor)[0] == len(drafts)
        row = drafts + [eos]  # every draft accepted, then the verifier's EOS
        got = structured.commit(grammar, row, len(drafts))
        assert got == (len(row) if kept == "all" else len(drafts)), (pattern, got)
