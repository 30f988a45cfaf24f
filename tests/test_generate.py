"""`jaxseek generate`: one batch run over a JSONL file that mixes good and bad requests, checked against greedy
decoding with the full-sequence forward (`Model.logits`) of the same random model; input parsing, the byte
tokenizer and flag errors without starting the engine."""

import contextlib
import io
import json
from types import SimpleNamespace

import numpy as np
import pytest

from model.initialize import init_model
from jaxseek.cli import main
from model.config import preset
from serving.api.batch import merge_sampling, prepare, read_jsonl, read_txt, request_seed
from serving.api.chat_format import DeepSeekV4Format, PlainFormat
from serving.api.openai_api import OpenAIRequests
from serving.base.tokenizer import ByteTokenizer, tokenizer_for
from tests.helpers import greedy_full_forward

SEED = 3  # the CLI's --seed: the random model's seed
MAX_LEN = 128
TOK = ByteTokenizer(256, skip_ids=(1,))  # tiny's eos_token_id is 1
FOX, ONCE = "The quick brown fox", "Once upon a time"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi ☃"}]
CHAT_TEXT = "SYSTEM:\nBe brief.\n\nUSER:\nHi ☃\n\nASSISTANT:\n"  # the plain format (a random tiny model)
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def model():
    return init_model(preset("tiny"), seed=SEED)


def greedy_references(model, prompts, steps):
    """Greedy tokens and their log-softmax rows (float64) by the full forward, all prompts in one padded batch."""
    out = []
    for (ids, logits), n in zip(greedy_full_forward(model, prompts, max(steps)), steps):
        logits = logits[:n].astype(np.float64)
        m = logits.max(-1, keepdims=True)
        out.append((ids[:n], list(logits - np.log(np.exp(logits - m).sum(-1, keepdims=True)) - m)))
    return out


def line(custom_id, body, url="/v1/completions"):
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


@pytest.fixture(scope="module")
def run(model, tmp_path_factory):
    """One CLI run: sampling defaults on the command line (4 tokens, temperature 0.8), 2 slots, batch-invariant
    (two buckets), no warm-up. Returns (input lines, output records by custom_id, ordered ids, stderr, status,
    references)."""
    (fox_ref, fox_rows), (chat_ref, chat_rows), (once_ref, _) = greedy_references(
        model, [TOK.encode(FOX), TOK.encode(CHAT_TEXT), TOK.encode(ONCE)], [8, 5, 2])
    # a stop string: a character of the greedy continuation; generation ends at the token that completes it
    chars = [c for c in TOK.decode(fox_ref) if c != "\ufffd"]
    assert chars, "the greedy continuation decodes to no whole character"
    stop = chars[min(2, len(chars) - 1)]
    k = next(k for k in range(1, 9) if stop in TOK.decode(fox_ref[:k]))
    stop_expected = (fox_ref[:k], TOK.decode(fox_ref[:k]).split(stop)[0])

    lines = [
        line("fox", {"model": "x", "prompt": FOX, "max_tokens": 6, "logprobs": 3, **GREEDY}),
        line("chat", {"messages": MESSAGES, "max_tokens": 5, "logprobs": True, "top_logprobs": 2, **GREEDY},
             url="/v1/chat/completions"),
        "",  # blank lines are skipped
        line("fox-top-k-1", {"prompt": FOX, "max_tokens": 6, "temperature": 1.0, "top_k": 1, "seed": 123,
                             "ignore_eos": True}),
        line("defaults", {"prompt": ONCE}),  # index 3: 4 tokens at temperature 0.8 with seed request_seed(3, 3)
        line("defaults-seeded", {"prompt": ONCE, "seed": request_seed(SEED, 3)}),
        line("override", {"prompt": ONCE, "max_tokens": 2, "max_completion_tokens": None, **GREEDY}),
        line("stop", {"prompt": FOX, "max_tokens": 8, "stop": stop, **GREEDY}),
        line("ids", {"prompt": TOK.encode(FOX), "max_tokens": 3, **GREEDY}) + "\r",
        '{"custom_id": "broken", "url": ',
        line("unknown-field", {"prompt": FOX, "frobnicate": 1}),
        line("bool-max-tokens", {"prompt": FOX, "max_tokens": True}),
        line("negative-max-tokens", {"prompt": FOX, "max_tokens": -3}),
        line("absurd-max-tokens", {"prompt": FOX, "max_tokens": 10**9}),
        line("over-max-len", {"prompt": FOX, "max_tokens": 5000}),
        line("empty", {"prompt": ""}),
        line("too-long", {"prompt": "x" * 200}),
        line("embeddings", {"input": FOX}, url="/v1/embeddings"),
        line("fox", {"prompt": FOX}),
        line("no-messages", {"messages": []}, url="/v1/chat/completions"),
        line("bad-id", {"prompt": [5, 300]}),
    ]
    path = tmp_path_factory.mktemp("gen") / "in.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    out = path.with_name("out.jsonl")
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        status = main(["generate", "--config", "tiny", "--input", str(path), "--output", str(out), "--seed", str(SEED),
                       "--max-tokens", "4", "--temperature", "0.8", "--max-slots", "2", "--max-len", str(MAX_LEN),
                       "--prefill-chunk", "16", "--batch-invariant", "--no-warmup", "--output-format",
                       "jsonl-compact"])
    records = [json.loads(x) for x in out.read_text().splitlines()]
    refs = {"fox": (fox_ref, fox_rows), "chat": (chat_ref, chat_rows), "once": once_ref, "stop": stop_expected}
    return {"records": records, "by_id": {r["custom_id"]: r for r in records if "error" not in r},
            "errors": {r["custom_id"]: r["error"]["message"] for r in records if "error" in r},
            "stderr": err.getvalue(), "status": status, "refs": refs}


def test_every_request_has_one_record_in_input_order(run):
    ids = [r["custom_id"] for r in run["records"]]
    assert ids == ["fox", "chat", "fox-top-k-1", "defaults", "defaults-seeded", "override", "stop", "ids",
                   "request-8", "unknown-field", "bool-max-tokens", "negative-max-tokens", "absurd-max-tokens",
                   "over-max-len", "empty", "too-long", "embeddings", "fox", "no-messages", "bad-id"]
    assert run["status"] == 1  # some requests failed; the others ran


def test_greedy_tokens_and_logprobs_equal_the_full_forward(run):
    fox_ref, fox_rows = run["refs"]["fox"]
    chat_ref, chat_rows = run["refs"]["chat"]
    for rid, ref, rows, n in (("fox", fox_ref[:6], fox_rows, 3), ("chat", chat_ref, chat_rows, 2)):
        r = run["by_id"][rid]
        assert r["token_ids"] == ref and r["finish_reason"] == "length"
        assert r["text"] == TOK.decode(ref)
        assert len(r["logprobs"]) == len(ref)
        for lp, row, token in zip(r["logprobs"], rows, ref):
            assert lp["token_id"] == token and lp["logprob"] == pytest.approx(row[token], abs=1e-4)
            top = lp["top_logprobs"]
            assert len(top) == n
            np.testing.assert_allclose([t["logprob"] for t in top], np.sort(row)[::-1][:n], atol=1e-4)
            np.testing.assert_allclose([t["logprob"] for t in top], row[[t["token_id"] for t in top]], atol=1e-4)


def test_sampling_fields_and_defaults(run):
    by_id, fox_ref = run["by_id"], run["refs"]["fox"][0]
    assert by_id["fox-top-k-1"]["token_ids"] == fox_ref[:6]  # top-k 1 samples the argmax
    assert "logprobs" not in by_id["fox-top-k-1"]
    assert by_id["ids"]["token_ids"] == fox_ref[:3]  # a prompt of token ids
    # the body's max_tokens / temperature override the flags (a null field does not)
    assert by_id["override"]["token_ids"] == run["refs"]["once"] and by_id["override"]["finish_reason"] == "length"
    d = by_id["defaults"]  # the flags: 4 tokens at temperature 0.8 (EOS may stop it earlier)
    assert (len(d["token_ids"]), d["finish_reason"]) == (4, "length") or d["finish_reason"] == "stop"
    assert by_id["defaults-seeded"]["token_ids"] == d["token_ids"]  # request i's seed is request_seed(seed, i)


def test_stop_string_cuts_the_text(run):
    ids, text = run["refs"]["stop"]
    r = run["by_id"]["stop"]
    assert (r["token_ids"], r["text"], r["finish_reason"]) == (ids, text, "stop")


def test_text_is_the_byte_decoding_of_the_tokens(run):
    for rid, r in run["by_id"].items():
        if rid != "stop":
            assert r["text"] == TOK.decode(r["token_ids"]), rid


def test_bad_requests_get_clear_errors(run):
    errors = run["errors"]
    expected = {
        "request-8": "in.jsonl line 10: invalid JSON",
        "bool-max-tokens": "max_tokens must be an integer [1, 1000000], got True",
        "negative-max-tokens": "max_tokens must be an integer [1, 1000000], got -3",
        "absurd-max-tokens": "max_tokens must be an integer [1, 1000000], got 1000000000",
        "over-max-len": f"max_tokens (5000) exceeds the engine's max_len={MAX_LEN}",
        "empty": "the prompt is empty",
        "too-long": "prompt (200 tokens) + max_tokens (4)",
        "embeddings": "unsupported url '/v1/embeddings'",
        "fox": "custom_id 'fox' is already used on line 1",
        "no-messages": "messages must be a non-empty list",
        "bad-id": "outside the vocabulary",
    }
    assert set(errors) == set(expected)
    assert "unknown-field" in run["by_id"]  # an unknown field is ignored (with a warning), as the server does
    for rid, message in expected.items():
        assert message in errors[rid], (rid, errors[rid])


def test_stderr_says_random_model_shows_progress_and_summary(run):
    err, by_id = run["stderr"], run["by_id"]
    assert "no --model given: running a randomly initialised 'tiny' model (seed 3)" in err
    assert "9/9" in err  # the progress bar reached every request that ran
    prompts = [FOX, CHAT_TEXT, FOX, ONCE, ONCE, ONCE, FOX, FOX, FOX]
    generated = sum(len(r["token_ids"]) for r in by_id.values())
    assert "requests: 20 (11 failed)" in err
    assert f"tokens: {sum(len(p.encode()) for p in prompts)} prompt, {generated} generated" in err
    assert "prefill" in err and "decode" in err and "tokens/s" in err
    assert ("compiled buckets (rows, tokens, verify, context pages): 2 [(2, 1, 1, 2), (2, 16, 1, 2)]"  # batch-invariant:
            in err)  # one per step kind, over the whole table


def test_txt_input_to_stdout_with_a_checkpoint(model, tmp_path, capsys):
    """A .txt file whose every prompt fails (too long; not UTF-8) runs nothing and compiles nothing."""
    from model.checkpoint import save_checkpoint

    save_checkpoint(model, tmp_path / "ckpt")
    prompts = tmp_path / "prompts.txt"
    prompts.write_bytes(b"\n" + b"x" * 100 + b"\n   \ncaf\xe9 au lait\n")
    assert main(["generate", "--model", str(tmp_path / "ckpt"), "--input", str(prompts), "--max-len", "64"]) == 1
    out, err = capsys.readouterr()
    records = [json.loads(x) for x in out.splitlines()]
    assert [r["custom_id"] for r in records] == ["request-0", "request-1"]
    assert "exceeds the engine's max_len=64" in records[0]["error"]["message"]
    assert "prompts.txt line 4 is not valid UTF-8" in records[1]["error"]["message"]
    assert "randomly initialised" not in err and "requests: 2 (2 failed)" in err
    assert "buckets (rows, tokens, verify, context pages): 0" in err


# ---- without the engine ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("args, message", [
    (["--prompt", "a", "--max-tokens", "0"], "max_tokens must be an integer"),
    (["--prompt", "a", "--temperature", "-1"], "temperature must be a finite number"),
    (["--prompt", "a", "--top-p", "nan"], "top_p must be a finite number"),
    (["--prompt", "a", "--logprobs", "21"], "logprobs must be an integer [0, 20]"),
    (["--prompt", "a", "--max-slots", "0"], "--max-slots: must be >= 1"),
    (["--prompt", "a", "--max-len", "many"], "expected an integer, got 'many'"),
    (["--prompt", "a", "--input", "x.txt"], "not allowed with argument"),
    ([], "one of the arguments --prompt --input is required"),
])
def test_bad_flags_exit_2(args, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", *args])
    assert e.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["--input", "prompts.csv"], "--input must be a .txt"),
    (["--input", "missing.jsonl"], "does not exist"),
    (["--prompt", "a", "--output", "no/such/dir/out.jsonl"], "cannot write --output"),
])
def test_bad_files_exit_2_before_loading_the_model(args, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "prompts.csv").write_text("a\n")
    assert main(["generate", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "randomly initialised" not in err


def test_txt_lines(tmp_path):
    path = tmp_path / "p.txt"
    path.write_bytes(b"\xef\xbb\xbffirst\r\n\n  \n second \n\xff\xfe\nlast")
    requests = read_txt(path)
    assert [(r.custom_id, r.body.get("prompt"), r.error) for r in requests] == [
        ("request-0", "first", None), ("request-1", " second ", None),
        ("request-2", None, "p.txt line 5 is not valid UTF-8 (byte 0: b'\\xff')"), ("request-3", "last", None)]


def test_jsonl_requests(tmp_path):
    path = tmp_path / "b.jsonl"
    path.write_text("\n".join([
        line("a", {"prompt": "hi", "model": "m", "temperature": 0.5}),
        line("b", {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]},
             url="/v1/chat/completions"),
        json.dumps({"custom_id": "c", "method": "GET", "url": "/v1/completions", "body": {"prompt": "p"}}),
        "[1, 2]",
        line("d", {"prompt": ["ab", "c"], "n": 2, "stream": True}),
        line("e", {"prompt": "p"}, url="/v1/chat/completions"),
        line("f", {"prompt": {"text": "p"}}),
    ]))
    r = read_jsonl(path)
    assert (r[0].url, r[0].body, r[0].error) == ("/v1/completions", {"prompt": "hi", "model": "m",
                                                                      "temperature": 0.5}, None)
    assert "line 3: method must be POST" in r[2].error
    assert "line 4: expected a JSON object" in r[3].error and r[3].custom_id == "request-3"
    assert "takes messages, not a prompt" in r[5].error
    prepare(r, OpenAIRequests(TOK, PlainFormat(), TOK.decode, MAX_LEN), {"max_tokens": 3}, seed=SEED)
    assert [(s.prompt, s.params.temperature, s.params.max_tokens) for s in r[0].prepared.submissions] == [
        (TOK.encode("hi"), 0.5, 3)]
    assert r[1].prepared.submissions[0].prompt == TOK.encode("USER:\nx\n\nASSISTANT:\n")
    # as the server: several prompts times n choices, seeds seed, seed + 1; stream is ignored
    seed = request_seed(SEED, 4)
    assert [(s.prompt, s.params.seed) for s in r[4].prepared.submissions] == [
        (TOK.encode("ab"), seed), (TOK.encode("ab"), seed + 1), (TOK.encode("c"), seed), (TOK.encode("c"), seed + 1)]
    assert (r[6].prepared, r[6].status) == (None, 400) and "prompt must be a string" in r[6].error


def test_chat_messages_rendered_by_the_chat_format(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(json.dumps({"custom_id": c, "url": "/v1/chat/completions", "body": {"messages": m}})
                              for c, m in (("ok", MESSAGES), ("bad", [{"role": "user", "content": 3}]))))
    requests = read_jsonl(path)
    prepare(requests, OpenAIRequests(TOK, PlainFormat(), TOK.decode, MAX_LEN), {}, seed=0)
    assert "messages[0].content must be a string" in requests[1].error
    assert requests[0].prepared.submissions[0].prompt == TOK.encode(CHAT_TEXT)
    requests = read_jsonl(path)
    prepare(requests, OpenAIRequests(TOK, DeepSeekV4Format(), TOK.decode, MAX_LEN), {}, seed=0)
    assert TOK.decode(requests[0].prepared.submissions[0].prompt).endswith("<｜User｜>Hi ☃<｜Assistant｜></think>")


def test_body_fields_override_flag_defaults():
    defaults = {"max_tokens": 4, "temperature": 0.8, "logprobs": 2}
    assert merge_sampling(defaults, {"temperature": 0, "max_tokens": None}) == {**defaults, "temperature": 0}
    assert merge_sampling(defaults, {"max_completion_tokens": 9, "logprobs": True, "top_logprobs": 1}) == {
        "temperature": 0.8, "max_completion_tokens": 9, "logprobs": True, "top_logprobs": 1}


def test_byte_tokenizer_never_emits_broken_utf8():
    tok = ByteTokenizer(300, skip_ids=(1,))
    text = "naïve ☃ \U0001f600"
    ids = tok.encode(text)
    assert ids == list(text.encode()) and tok.decode(ids) == text
    for cut in range(len(ids) + 1):  # every prefix: what Python's own replace-decoding gives, or held back
        assert tok.decode(ids[:cut]) == bytes(ids[:cut]).decode("utf-8", errors="replace")
        held = tok.decode(ids[:cut], final=False)
        assert text.startswith(held) and len(text.encode()[:cut]) - len(held.encode()) < 4
    assert tok.decode([0xFF, 65, 1, 0xE2, 299, 66]) == "\ufffdA\ufffd\ufffdB"  # bad byte, EOS, cut char, non-byte


def test_tokenizer_choice():
    own = ByteTokenizer(256)
    assert tokenizer_for(SimpleNamespace(tokenizer=own, config=None)) is own  # the model's own tokenizer
    small = SimpleNamespace(tokenizer=None, config=SimpleNamespace(vocab_size=100, eos_token_id=1))
    with pytest.raises(ValueError, match=r"vocabulary \(100 ids\) is too small for the byte-level fallback"):
        tokenizer_for(small)


def test_a_known_batch_compiles_only_the_shapes_it_can_use():
    """No more slots than requests, and a prefill chunk no wider than the longest prompt's bucket; batch-invariant
    configs keep their shapes."""
    from serving.api.batch import BatchRequest, fitted_config
    from serving.base.engine_config import EngineConfig
    from serving.api.engine_loop import Submission
    from serving.api.openai_api import Prepared
    from serving.base.sampling import SamplingParams

    def shape(requests, **settings):
        config = fitted_config(requests, EngineConfig(**settings))
        return config.max_slots, config.prefill_chunk

    requests = [BatchRequest(i, str(i), prepared=Prepared([Submission([1] * n, SamplingParams())], n))
                for i, n in enumerate((3, 20))]
    assert shape(requests, max_slots=8, prefill_chunk=64) == (2, 32)
    assert shape(requests[:1], max_slots=8, prefill_chunk=64) == (1, 8)
    assert shape(requests, max_slots=1, prefill_chunk=16) == (1, 16)
    assert shape([BatchRequest(0, "0", error="bad")], max_slots=8, prefill_chunk=64) == (1, 8)
    assert shape(requests, max_slots=8, prefill_chunk=64, batch_invariant=True) == (8, 64)


# ---- OpenAI's batch output format (the default) ---------------------------------------------------------------
BATCH_LINE = {  # OpenAI's batch output line; the body a completion or chat completion as the server answers
    "type": "object", "required": ["id", "custom_id", "response", "error"], "additionalProperties": False,
    "properties": {
        "id": {"type": "string", "minLength": 1}, "custom_id": {"type": "string"},
        "response": {"type": "object", "required": ["status_code", "request_id", "body"], "properties": {
            "status_code": {"type": "integer"}, "request_id": {"type": "string", "minLength": 1},
            "body": {"type": ["object", "null"]}}},
        "error": {"anyOf": [{"type": "null"}, {"type": "object", "required": ["code", "message"]}]}}}
BODY = {"type": "object", "required": ["id", "object", "created", "model", "choices", "usage"], "properties": {
    "object": {"enum": ["text_completion", "chat.completion"]},
    "choices": {"type": "array", "minItems": 1, "items": {"type": "object", "required": ["index", "finish_reason"]}},
    "usage": {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"]}}}


def test_openai_batch_output_lines(model, tmp_path):
    """The default output: every line validates against OpenAI's batch output shape; bodies are what the server
    answers (several prompts, n choices, chat with stream ignored), their greedy text the full forward's; a
    request the server would refuse (tools with a format that has none) is an error line with its status."""
    import jsonschema

    (fox, _), (chat, _) = greedy_references(model, [TOK.encode(FOX), TOK.encode(CHAT_TEXT)], [5, 5])
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join([
        line("two-prompts", {"prompt": [FOX, ONCE], "max_tokens": 5, "model": "mine", **GREEDY}),
        line("chat-n", {"messages": MESSAGES, "n": 2, "stream": True, "max_tokens": 5, **GREEDY},
             url="/v1/chat/completions"),
        line("tools", {"messages": MESSAGES, "tools": [tool]}, url="/v1/chat/completions"),
        line("wrong", {"prompt": FOX, "temperature": "hot"}),
    ]) + "\n")
    out = tmp_path / "out.jsonl"
    with contextlib.redirect_stderr(io.StringIO()):
        status = main(["generate", "--config", "tiny", "--input", str(path), "--output", str(out), "--seed", str(SEED),
                       "--max-num-seqs", "2", "--max-model-len", str(MAX_LEN), "--prefill-chunk", "16",
                       "--batch-invariant", "--no-warmup"])
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert status == 1 and [x["custom_id"] for x in lines] == ["two-prompts", "chat-n", "tools", "wrong"]
    for x in lines:
        jsonschema.validate(x, BATCH_LINE)
    ok = {x["custom_id"]: x["response"]["body"] for x in lines if x["error"] is None}
    for body in ok.values():
        jsonschema.validate(body, BODY)
    two, chat_n = ok["two-prompts"], ok["chat-n"]
    assert (two["object"], two["model"], [c["index"] for c in two["choices"]]) == ("text_completion", "mine", [0, 1])
    assert two["choices"][0]["text"] == TOK.decode(fox) and two["choices"][0]["finish_reason"] == "length"
    assert two["usage"]["prompt_tokens"] == len(TOK.encode(FOX)) + len(TOK.encode(ONCE))
    assert (chat_n["object"], chat_n["model"]) == ("chat.completion", "tiny")
    assert [c["message"]["content"] for c in chat_n["choices"]] == [TOK.decode(chat)] * 2
    assert chat_n["usage"] == {"prompt_tokens": len(TOK.encode(CHAT_TEXT)), "completion_tokens": 10,
                               "total_tokens": len(TOK.encode(CHAT_TEXT)) + 10,
                               "prompt_tokens_details": {"cached_tokens": 0}}
    errors = {x["custom_id"]: x for x in lines if x["error"] is not None}
    assert errors["tools"]["response"]["status_code"] == 400 and "no tool calls" in errors["tools"]["error"]["message"]
    assert errors["wrong"]["error"] == {"code": "invalid_request_error",
                                        "message": "temperature must be a finite number in [0, 100], got 'hot'"}


def test_compact_output_refuses_several_choices(tmp_path, capsys):
    path = tmp_path / "in.jsonl"
    path.write_text(line("n", {"prompt": FOX, "n": 2}) + "\n")
    assert main(["generate", "--config", "tiny", "--input", str(path), "--output-format", "jsonl-compact"]) == 1
    [record] = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert "--output-format jsonl-compact writes one: use --output-format openai" in record["error"]["message"]


def test_the_example_batch_file_is_valid():
    from pathlib import Path

    requests = read_jsonl(Path(__file__).parents[1] / "examples" / "batch.jsonl")
    prepare(requests, OpenAIRequests(TOK, PlainFormat(), TOK.decode, 1024), {}, seed=0)
    assert len(requests) == 5 and [r.error for r in requests] == [None] * 5
    assert [len(r.prepared.submissions) for r in requests] == [1, 1, 2, 2, 1]
