"""Structured outputs: constraints compiled with llguidance over the bundled model's vocabulary, driven by a
random sampler under the masks until the output ends, then checked by independent parsers (`jsonschema`,
Python `re`, `lark`); draft verification masks and rollback; close mode (closing paths from random states, outputs
ending within max_tokens, masks unchanged far from the limit); request-body parsing and error messages; the jnp
bitmask against llguidance's numpy kernel (the bundled model under the masks runs in test_structured_engine)."""

import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import jsonschema
import lark
import llguidance as llg
import numpy as np
import pytest
from llguidance.numpy import apply_token_bitmask_inplace

from model.checkpoint import BUNDLED
from model.tokenizer import TextTokenizer
from serving.structured.constraints import ConstraintCompiler, ConstraintSpec, constraint_from_body, grammar_tokenizer
from serving.structured.grammar_mask import (MaskFill, RequestGrammar, apply_token_bitmask, bitmask_width, fill_masks,
                                  speculate_masks)

SCHEMAS = json.loads((Path(__file__).parent / "data" / "json_schemas.json").read_text())
EOS, THINK_END = 1, 6  # the bundled tokenizer's <｜end▁of▁sentence｜> and </think>
MAX_TOKENS = 400


@pytest.fixture(scope="module")
def tokenizer():
    return TextTokenizer.from_file(BUNDLED / "tokenizer.json")


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return ConstraintCompiler(grammar_tokenizer(tokenizer, tokenizer.vocab_size, [EOS]))


@pytest.fixture(scope="module")
def bias(tokenizer):
    """Logit bonuses that make a random sampler end its outputs: EOS, and tokens that close strings,
    arrays, objects or groups."""
    v = tokenizer.vocab_size
    texts = [tokenizer.tokenizer.decode([i], skip_special_tokens=False) for i in range(v)]
    out = np.zeros(v)
    out[[i for i, s in enumerate(texts) if any(c in s for c in '"]}),;')]] = 2.0
    out[EOS] = 4.0
    return out


def allowed(row: np.ndarray, vocab: int) -> np.ndarray:
    """The tokens a mask row allows (bit i % 32 of word i // 32), as bools."""
    return np.unpackbits(row.view(np.uint8), bitorder="little")[:vocab].astype(bool)


def sample(grammar: RequestGrammar, bias: np.ndarray, seed: int, prefix=()) -> list[int]:
    """Random logits, masked argmax, token by token until the output ends with EOS."""
    rng, vocab = np.random.default_rng(seed), len(bias)
    row, out = np.empty(bitmask_width(vocab), np.int32), []
    assert grammar.accept(prefix)
    while not grammar.ended:
        assert len(out) < MAX_TOKENS, "the constrained output did not end"
        grammar.fill(row)
        token = int(np.argmax(np.where(allowed(row, vocab), rng.standard_normal(vocab) + bias, -np.inf)))
        assert grammar.accept([token])
        out.append(token)
    assert out[-1] == EOS
    return out


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_outputs_validate(name, compiler, tokenizer, bias):
    schema = SCHEMAS[name]
    compiled = compiler.compile(ConstraintSpec.json_schema(schema))
    for seed in range(3):
        text = tokenizer.decode(sample(RequestGrammar(compiled), bias, seed))
        jsonschema.validate(json.loads(text), schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)


def test_at_least_thirty_schemas_of_varied_features():
    text = json.dumps(SCHEMAS)
    assert len(SCHEMAS) >= 30
    for feature in ('"$ref"', '"enum"', '"pattern"', '"minItems"', '"maxItems"', '"minimum"', '"maximum"',
                    '"required"', '"anyOf"', '"oneOf"', '"format"', '"exclusiveMinimum"'):
        assert feature in text, feature


def test_json_object_gives_an_object(compiler, tokenizer, bias):
    spec = constraint_from_body({"response_format": {"type": "json_object"}})
    for seed in range(3):
        text = tokenizer.decode(sample(RequestGrammar(compiler.compile(spec)), bias, seed))
        assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize("pattern", [r"[A-Z][a-z]{2,6} (is|was) [0-9]{1,3}", r"(yes|no|maybe)",
                                     r"[a-z]{1,8}@[a-z]{1,8}\.(com|org)", r"-?(0|[1-9][0-9]{0,4})(\.[0-9]{1,2})?",
                                     r"\((a|b)\)( \((a|b)\)){0,3}"])
def test_regex_outputs_full_match(pattern, compiler, tokenizer, bias):
    compiled = compiler.compile(ConstraintSpec.regex(pattern))
    for seed in range(3):
        text = tokenizer.decode(sample(RequestGrammar(compiled), bias, seed))
        assert re.fullmatch(pattern, text), (pattern, text)


LARK_GRAMMARS = [
    """start: expr
expr: term (("+" | "-") term)*
term: factor (("*" | "/") factor)*
factor: NUMBER | "(" expr ")"
NUMBER: /[0-9]{1,3}/
""",
    """start: pair (";" pair)*
pair: KEY "=" value
value: INT | STRING | "[" [INT ("," INT)*] "]"
KEY: /[a-z]{1,6}/
INT: /-?[0-9]{1,4}/
STRING: /"[a-z ]{0,8}"/
""",
]


@pytest.mark.parametrize("grammar", LARK_GRAMMARS)
def test_lark_grammar_outputs_parse(grammar, compiler, tokenizer, bias):
    compiled = compiler.compile(ConstraintSpec.grammar(grammar))
    parser = lark.Lark(grammar, parser="earley")
    for seed in range(3):
        parser.parse(tokenizer.decode(sample(RequestGrammar(compiled), bias, seed)))


def test_gbnf_grammar_is_converted(compiler, tokenizer, bias):
    gbnf = 'root ::= item ("," item)*\nitem ::= [a-z] [a-z]? | "<" [0-9] ">"\n'
    compiled = compiler.compile(constraint_from_body({"structured_outputs": {"grammar": gbnf}}))
    for seed in range(3):
        text = tokenizer.decode(sample(RequestGrammar(compiled), bias, seed))
        assert re.fullmatch(r"([a-z]{1,2}|<[0-9]>)(,([a-z]{1,2}|<[0-9]>))*", text), text


def test_choice_outputs_are_one_of_the_choices(compiler, tokenizer, bias):
    choices = ["Romeo", "Juliet", "the Nurse", "Friar Laurence"]
    compiled = compiler.compile(constraint_from_body({"structured_outputs": {"choice": choices}}))
    seen = {tokenizer.decode(sample(RequestGrammar(compiled), bias, seed)) for seed in range(12)}
    assert seen <= set(choices) and len(seen) > 1


@pytest.fixture(scope="module")
def point(compiler):
    return compiler.compile(ConstraintSpec.json_schema(SCHEMAS["ref_defs"]))


def masks_along(compiled, tokens, trigger=None) -> np.ndarray:
    """Reference: the masks of a fresh matcher fed `tokens` one at a time ([len + 1, W])."""
    g = RequestGrammar(compiled, trigger)
    out = np.empty((len(tokens) + 1, g.words), np.int32)
    for j, t in enumerate(tokens):
        g.fill(out[j])
        assert g.accept([t])
    g.fill(out[-1])
    return out


def test_verify_masks_follow_the_drafts_and_settle(point, tokenizer):
    text = tokenizer.encode('{"from":{"x":12,"y":3},"to":{"x":4,"y":5}}')
    committed, drafts = text[:5], text[5:10]
    g = RequestGrammar(point)
    assert g.accept(committed)
    masks = np.zeros((len(drafts) + 1, g.words), np.int32)
    assert g.speculate(drafts, masks) == len(drafts)
    np.testing.assert_array_equal(masks, masks_along(point, committed + drafts)[len(committed):])
    with pytest.raises(RuntimeError, match="settle"):
        g.accept([drafts[0]])  # the drafts are still under verification
    g.settle(2)  # the verifier kept 2 drafts, then emitted its own token
    assert g.accept([drafts[2]])
    row = np.empty(g.words, np.int32)
    g.fill(row)
    np.testing.assert_array_equal(row, masks_along(point, committed + drafts[:3])[-1])


def test_a_draft_that_breaks_the_grammar_is_refused_and_rolled_back(point, tokenizer):
    committed = tokenizer.encode('{"from":{"x":')
    bad = tokenizer.encode("7")[0], tokenizer.encode("}")[0], tokenizer.encode("7")[0]  # `}` cannot follow x
    g = RequestGrammar(point)
    assert g.accept(committed)
    before = masks_along(point, committed)[-1]
    masks = np.zeros((len(bad) + 1, g.words), np.int32)
    assert g.speculate(list(bad), masks) == 1
    assert not allowed(masks[1], tokenizer.vocab_size)[bad[1]]  # the verifier rejects it there
    np.testing.assert_array_equal(masks[2], masks[1])  # unreachable rows repeat the refusing mask
    with pytest.raises(ValueError, match="only 1 were allowed"):
        g.settle(2)
    g.settle(0)
    row = np.empty(g.words, np.int32)
    g.fill(row)
    np.testing.assert_array_equal(row, before)
    assert not g.accept([bad[1]]) and g.error  # committing it is refused too


def test_batch_fills_match_one_request_at_a_time(point, compiler, tokenizer):
    text = tokenizer.encode('{"from":{"x":12,"y":3},"to":{"x":4,"y":5}}')
    choice = compiler.compile(ConstraintSpec.choice(["yes", "no"]))
    executor = llg.LLExecutor(2)

    def requests():  # active, before its trigger, unconstrained, complete (EOS next), refusing a draft
        rows = [RequestGrammar(point), RequestGrammar(point, THINK_END), None, RequestGrammar(choice),
                RequestGrammar(point)]
        for g, tokens in zip(rows, [text[:3], [40, 41], [], tokenizer.encode("yes"), text[:5]]):
            assert g is None or g.accept(tokens)
        return rows

    drafts = [text[3:7], [42, THINK_END] + text[:2], [5, 6, 7], [EOS], text[5:7] + [EOS, 9]]
    batched, one_by_one = requests(), requests()
    masks = np.zeros((6, 5, one_by_one[0].words), np.int32)
    n = speculate_masks(batched, drafts, masks, executor)
    expected = np.full_like(masks, -1)
    m = [-1 if g is None else g.speculate(d, expected[i]) for i, (g, d) in enumerate(zip(one_by_one, drafts))]
    assert n == [4, 4, 3, 1, 2] and m[:2] + m[3:] == [4, 4, 1, 2]
    np.testing.assert_array_equal(masks, expected)
    np.testing.assert_array_equal(masks[1, :2], -1)  # the constraint starts after </think>
    np.testing.assert_array_equal(masks[1, 2:], masks_along(point, text[:2]))
    for g, k in zip(batched, [2, 1, None, 1, 0]):
        if g is not None:
            g.settle(k)
    assert batched[1].active is False  # the trigger was not kept
    plain = np.zeros((6, one_by_one[0].words), np.int32)
    fill_masks(batched, plain, executor)
    for g, row in zip(batched, plain):
        if g is None:
            np.testing.assert_array_equal(row, -1)
        else:
            g2 = np.empty_like(row)
            g.fill(g2)
            np.testing.assert_array_equal(row, g2)
    assert batched[3].ended and np.flatnonzero(allowed(plain[3], tokenizer.vocab_size)).tolist() == [EOS]
    filler = MaskFill(executor, trials=2)  # times one batch each way (serial, pool), then keeps the faster
    for _ in range(3):
        again = np.zeros_like(plain)
        fill_masks(batched, again, filler)
        np.testing.assert_array_equal(again, plain)
    assert filler.serial is not None


def test_eos_ends_the_output_only_where_the_constraint_is_complete(compiler, tokenizer):
    g = RequestGrammar(compiler.compile(ConstraintSpec.regex("ab+")))
    row = np.empty(g.words, np.int32)
    g.fill(row)
    assert not allowed(row, 4096)[EOS]
    assert g.accept(tokenizer.encode("ab")) and not g.finished
    g.fill(row)
    assert allowed(row, 4096)[EOS] and allowed(row, 4096)[tokenizer.encode("b")[0]]
    assert g.accept([EOS]) and g.finished
    g.fill(row)
    assert np.flatnonzero(allowed(row, 4096)).tolist() == [EOS]
    assert not g.accept(tokenizer.encode("b")) and g.error


def test_forced_tokens_jump_forward(compiler, tokenizer):
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes"]}, "n": {"type": "integer"}},
              "required": ["answer", "n"], "additionalProperties": False}
    g = RequestGrammar(compiler.compile(ConstraintSpec.json_schema(schema)))
    forced = g.forced_tokens()
    assert tokenizer.decode(forced) == '{"answer":"yes","n":'
    assert g.accept(forced) and g.forced_tokens() == []


def test_constraint_starts_after_the_trigger(compiler, tokenizer, bias):
    schema = SCHEMAS["enum_in_object"]
    g = RequestGrammar(compiler.compile(ConstraintSpec.json_schema(schema)), trigger=THINK_END)
    row = np.empty(g.words, np.int32)
    g.fill(row)
    np.testing.assert_array_equal(row, -1)  # reasoning is free
    thinking = tokenizer.encode("I think, therefore") + [THINK_END]
    out = sample(g, bias, seed=0, prefix=thinking)
    jsonschema.validate(json.loads(tokenizer.decode(out)), schema)


def test_compiles_once_and_refuses_bad_constraints_clearly(tokenizer):
    compiler = ConstraintCompiler(grammar_tokenizer(tokenizer, tokenizer.vocab_size, [EOS]), cache_size=2,
                                  max_source_bytes=300_000, max_grammar_symbols=2_000)
    a, b, c = ConstraintSpec.regex("a+"), ConstraintSpec.regex("b+"), ConstraintSpec.regex("c+")
    first = compiler.compile(a)
    assert compiler.compile(ConstraintSpec.regex("a+")) is first  # cached
    compiler.compile(b), compiler.compile(c)
    assert compiler.compile(a) is not first  # evicted (least recently used), compiled again
    cases = [
        (ConstraintSpec.regex("a(b"), "invalid regex.*unclosed group"),
        (ConstraintSpec.json_schema({"type": "nonsense"}), "invalid JSON Schema.*nonsense"),
        (ConstraintSpec.json_schema({"type": "array", "uniqueItems": True}), "invalid JSON Schema.*uniqueItems"),
        (ConstraintSpec.grammar("start: foo"), "invalid grammar.*unknown name"),
        (ConstraintSpec.grammar("root ::= (unclosed"), "invalid grammar"),
        (ConstraintSpec.grammar("start: " + " | ".join(f'"w{i}"' for i in range(3000))), "too big"),
        (ConstraintSpec.regex("x" * 300_001), "over the limit of 300000"),
    ]
    for spec, message in cases:
        for _ in range(2):  # a refusal is cached like a success
            with pytest.raises(ValueError, match="(?s)" + message):
                compiler.compile(spec)


def test_compilation_has_a_time_limit(tokenizer):
    compiler = ConstraintCompiler(grammar_tokenizer(tokenizer, tokenizer.vocab_size, [EOS]), timeout_s=0.02)
    slow = ConstraintSpec.grammar("start: " + " | ".join(f'"w{i}"' for i in range(20_000)))  # ~0.5 s
    with pytest.raises(ValueError, match="took over 0.02 s"):
        compiler.compile(slow)


def test_request_bodies_parse_into_specs():
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
    spec = ConstraintSpec.json_schema(schema)
    assert list(json.loads(spec.source)["properties"]) == ["b", "a"]  # schema order is the output order
    assert constraint_from_body({"response_format": {"type": "json_schema",
                                                     "json_schema": {"name": "x", "schema": schema}}}) == spec
    assert constraint_from_body({"structured_outputs": {"json": json.dumps(schema)}}) == spec
    assert constraint_from_body({"structured_outputs": {"json_object": True}}) == ConstraintSpec.json_object()
    assert constraint_from_body({"response_format": {"type": "json_object"}}) == ConstraintSpec.json_object()
    assert constraint_from_body({"structured_outputs": {"regex": "a+"}}) == ConstraintSpec("regex", "a+")
    assert constraint_from_body({"structured_outputs": {"choice": ["x", "y"]}}).kind == "choice"
    assert constraint_from_body({"response_format": {"type": "text"}, "prompt": "hi"}) is None
    assert constraint_from_body({"response_format": None, "structured_outputs": None}) is None
    bad = [
        ({"response_format": {"type": "xml"}}, "not supported"),
        ({"response_format": {"type": "json_schema"}}, "needs"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}}, "must be a JSON object"),
        ({"response_format": "json"}, "must be an object"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one"),
        ({"structured_outputs": {"structural_tag": "x"}}, "unsupported structured_outputs field"),
        ({"structured_outputs": {"choice": []}}, "non-empty list"),
        ({"structured_outputs": {"json": "{not json"}}, "not valid JSON"),
        ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "not both"),
    ]
    for body, message in bad:
        with pytest.raises(ValueError, match=message):
            constraint_from_body(body)


def test_apply_token_bitmask_matches_numpy():
    rng = np.random.default_rng(0)
    for shape, vocab in [((3,), 100), ((2, 4), 4096), ((5,), 65)]:
        logits = rng.standard_normal((*shape, vocab)).astype(np.float32)
        masks = rng.integers(-2**31, 2**31, (*shape, bitmask_width(vocab)), dtype=np.int64).astype(np.int32)
        masks.reshape(-1, masks.shape[-1])[0] = -1  # an all-allowed row
        got = np.asarray(jax.jit(apply_token_bitmask)(jnp.asarray(logits), jnp.asarray(masks)))
        want = logits.reshape(-1, vocab).copy()
        apply_token_bitmask_inplace(want, masks.reshape(-1, masks.shape[-1]))
        np.testing.assert_array_equal(got.reshape(-1, vocab), want)
    with pytest.raises(ValueError, match="fewer than"):
        apply_token_bitmask(jnp.zeros((1, 65)), jnp.zeros((1, 2), jnp.int32))


# ---- close mode: ending the output within max_tokens --------------------------------------------------------
CLOSE_CASES = [("json", SCHEMAS[name]) for name in ("nested_objects", "array_of_objects", "open_object",
                                                    "recursive_tree", "number_exclusive", "format_uuid",
                                                    "string_lengths", "matrix")] + [
    ("regex", r"(ROMEO|JULIET): [a-z ]{5,30}\."), ("regex", r"\d{1,3}(,\d{3})* ducats"),
    ("lark", LARK_GRAMMARS[0]), ("lark", LARK_GRAMMARS[1]),
    ("lark", 'start: "(" item ("," item)* ")"\nitem: /[a-z]{1,12}/\n%ignore " "\n')]  # spaces loop anywhere


def spec_of(kind, target) -> ConstraintSpec:
    return {"json": ConstraintSpec.json_schema, "regex": ConstraintSpec.regex, "lark": ConstraintSpec.grammar}[kind](
        target)


def valid(kind, target, text: str) -> bool:
    """Whether `text` satisfies the constraint, by a parser independent of llguidance."""
    try:
        if kind == "json":
            jsonschema.validate(json.loads(text), target, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
        elif kind == "regex":
            return re.fullmatch(target, text) is not None
        else:
            lark.Lark(target, parser="earley").parse(text)
        return True
    except (ValueError, jsonschema.ValidationError, lark.exceptions.LarkError):
        return False


def sample_until(grammar: RequestGrammar, logits_bias: np.ndarray, seed: int) -> list[int]:
    """Random logits, masked argmax, until the output ends (EOS) or reaches the grammar's max_tokens."""
    rng, vocab = np.random.default_rng(seed), len(logits_bias)
    row, out = np.empty(bitmask_width(vocab), np.int32), []
    while not grammar.ended and len(out) < grammar.max_tokens:
        grammar.fill(row)
        token = int(np.argmax(np.where(allowed(row, vocab), rng.standard_normal(vocab) + logits_bias, -np.inf)))
        assert grammar.accept([token])
        out.append(token)
    return out


def test_closing_paths_complete_outputs_from_any_state(compiler, tokenizer):
    """From states along random outputs (no bias toward ending: strings and numbers run on), the closing path
    completes the output, as the independent parsers confirm, and leaves the matcher as it was."""
    from serving.structured.grammar_budget import closing_path

    table, vocab = compiler.token_bytes, tokenizer.vocab_size
    for c, (kind, target) in enumerate(CLOSE_CASES):
        compiled = compiler.compile(spec_of(kind, target))
        g = RequestGrammar(compiled, max_tokens=30)
        prefix = sample_until(g, np.zeros(vocab), seed=c)
        for cut in (len(prefix) // 3, len(prefix)):
            g = RequestGrammar(compiled)
            if prefix[cut - 1:cut] == [EOS]:
                cut -= 1
            assert g.accept(prefix[:cut])
            before = np.frombuffer(g.matcher.compute_bitmask(), np.uint8).copy()
            closing = closing_path(g.matcher, table)
            np.testing.assert_array_equal(np.frombuffer(g.matcher.compute_bitmask(), np.uint8), before)
            text = tokenizer.decode(prefix[:cut]) + closing.path.decode()
            assert valid(kind, target, text), (kind, target, text)
            assert g.accept([int(table.byte_token[b]) for b in closing.path])
            assert g.finished if not closing.needs_eos else g.accept([EOS])
    # where a space may always come next, the search leaves the loop of spaces: "(ab, " closes with " a)"
    g = RequestGrammar(compiler.compile(spec_of(*CLOSE_CASES[-1])))
    assert g.accept(tokenizer.encode("(ab, "))
    assert closing_path(g.matcher, table).path == b" a)"


def test_a_closing_path_reconnects_after_tokens_that_leave_it(compiler, tokenizer):
    """The last closing path, checked again after the model left it: where it still completes the output (the
    independent parsers agree) it is kept, and equals a new search there; where it does not, None. The matcher
    is left as it was."""
    from serving.structured.grammar_budget import closing_path, reconnect

    table = compiler.token_bytes
    compiled = compiler.compile(spec_of("json", SCHEMAS["nested_objects"]))
    g = RequestGrammar(compiled)
    assert g.accept(tokenizer.encode('{"user":{"id":4'))
    old = closing_path(g.matcher, table)
    assert old.path.startswith(b",") and not old.needs_eos
    assert g.accept(tokenizer.encode("2"))  # one more digit: the old path still closes the object
    before = np.frombuffer(g.matcher.compute_bitmask(), np.uint8).copy()
    assert reconnect(g.matcher, table, old, EOS) == closing_path(g.matcher, table) == old
    np.testing.assert_array_equal(np.frombuffer(g.matcher.compute_bitmask(), np.uint8), before)
    assert valid("json", SCHEMAS["nested_objects"], '{"user":{"id":42' + old.path.decode())
    assert g.accept(tokenizer.encode(","))  # a comma: ",," cannot follow
    assert reconnect(g.matcher, table, old, EOS) is None
    # along random outputs: every path kept completes the output
    kept = 0
    for c, (kind, target) in enumerate(CLOSE_CASES):
        compiled = compiler.compile(spec_of(kind, target))
        out = sample_until(RequestGrammar(compiled, max_tokens=24), np.zeros(tokenizer.vocab_size), seed=c)
        out = out[:-1] if out[-1] == EOS else out
        for k in range(0, len(out), 3):
            g = RequestGrammar(compiled)
            assert g.accept(out[:k])
            old = closing_path(g.matcher, table)
            assert g.accept([out[k]])
            again = reconnect(g.matcher, table, old, EOS)
            if again is not None:
                kept += 1
                assert valid(kind, target, tokenizer.decode(out[:k + 1]) + again.path.decode())
    assert kept >= 10, kept  # 28 of the ~90 states here


def test_close_mode_ends_every_output_within_max_tokens(compiler, tokenizer):
    """Unbiased random outputs of unbounded strings / numbers / lists: without close mode the limit cuts most
    of them; with it every one ends with EOS (or the grammar's own end) within max_tokens and validates."""
    from serving.base.engine_config import ClosePolicy
    from serving.structured.grammar_budget import closing_path

    vocab, cut_without = tokenizer.vocab_size, 0
    for c, (kind, target) in enumerate(CLOSE_CASES):
        compiled = compiler.compile(spec_of(kind, target))
        shortest = closing_path(compiled.new_matcher(), compiler.token_bytes).tokens  # fewer tokens cannot do
        for seed, limit in enumerate((shortest + 2, shortest + 30)):
            plain = sample_until(RequestGrammar(compiled, max_tokens=limit), np.zeros(vocab), seed)
            cut_without += plain[-1] != EOS
            g = RequestGrammar(compiled, max_tokens=limit, close=ClosePolicy(window=64, margin=2))
            closed = sample_until(g, np.zeros(vocab), seed)
            assert len(closed) <= limit and (g.ended or g.finished), (target, tokenizer.decode(closed))
            text = tokenizer.decode([t for t in closed if t != EOS])
            assert valid(kind, target, text), (kind, target, text)
            assert g.closed > 0 or closed == plain  # untouched unless it had to close
    assert cut_without >= len(CLOSE_CASES) // 2


def test_close_mode_leaves_outputs_that_end_early_alone(compiler, tokenizer, bias):
    """Outputs that end with more than window + margin tokens to spare are those of the plain masks."""
    from serving.base.engine_config import ClosePolicy

    for c, (kind, target) in enumerate(CLOSE_CASES[:6]):
        compiled = compiler.compile(spec_of(kind, target))
        plain = sample_until(RequestGrammar(compiled, max_tokens=MAX_TOKENS), bias, seed=c)
        g = RequestGrammar(compiled, max_tokens=len(plain) + 20, close=ClosePolicy(window=16, margin=4))
        assert sample_until(g, bias, seed=c) == plain and g.closed == 0


def test_close_mode_under_speculation_matches_one_token_at_a_time(compiler, tokenizer):
    """Verify masks near the limit: each position's mask is the one the request would get with the drafts
    before it committed (the limit counts them), and a draft off the closing path is cut."""
    from serving.base.engine_config import ClosePolicy
    from serving.structured.grammar_budget import closing_path

    compiled = compiler.compile(ConstraintSpec.json_schema(SCHEMAS["nested_objects"]))
    committed = tokenizer.encode('{"user":{"id":12')
    drafts = tokenizer.encode('3456789,"address":{"city":"Ve')
    start = RequestGrammar(compiled)
    assert start.accept(committed)
    # one token to spare: the closing starts at the first draft, which the closing path does not extend
    policy, limit = ClosePolicy(window=64, margin=0), len(committed) + closing_path(start.matcher,
                                                                                   compiler.token_bytes).tokens + 1
    g = RequestGrammar(compiled, max_tokens=limit, close=policy)
    assert g.accept(committed)
    masks = np.zeros((2, len(drafts) + 1, g.words), np.int32)
    n = speculate_masks([g, None], [drafts, []], masks, llg.LLExecutor(2))[0]
    for j in range(n + 1):
        ref = RequestGrammar(compiled, max_tokens=limit, close=policy)
        assert ref.accept(committed + drafts[:j])
        row = np.empty(g.words, np.int32)
        ref.fill(row)
        np.testing.assert_array_equal(masks[0, j], row)
    assert 0 < n < 3 and g.closed > 0  # the closing path ends the number, not "3456789,..."
    np.testing.assert_array_equal(masks[1], -1)
    # a batch fill (parallel masks, then the closing cut) is the one-at-a-time fill
    one, batch = (RequestGrammar(compiled, max_tokens=limit - 1, close=policy) for _ in range(2))
    assert one.accept(committed) and batch.accept(committed)
    row, rows = np.empty(g.words, np.int32), np.empty((2, g.words), np.int32)
    one.fill(row)
    fill_masks([batch], rows, llg.LLExecutor(2))
    np.testing.assert_array_equal(rows[0], row)
    assert one.closed == batch.closed == 1 and allowed(row, tokenizer.vocab_size).sum() < 10
