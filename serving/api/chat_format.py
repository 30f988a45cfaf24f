"""Chat prompt formats: OpenAI chat messages to a prompt string, and a generated reply back to OpenAI fields.

`DeepSeekV4Format` is our encoder of DeepSeek-V4's prompt format (which ships as Python code, not a Jinja
template; reference/serving-ecosystem.md §2): bos, the system text (with the tool schemas), `<｜User｜>` turns,
`<｜Assistant｜>` turns closed by eos; after the last user turn `<think>` (thinking mode) or `</think>` (chat mode);
earlier turns' reasoning is dropped; tool calls are DSML blocks and tool results `<tool_result>` blocks inside
a user turn. `PlainFormat` is the bundled model's own template: the model was trained on plays, so a chat is a
scene, `SPEAKER:` then the line.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from pathlib import Path

ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclasses.dataclass
class Reply:
    """A parsed assistant reply: OpenAI `content`, `reasoning_content` and `tool_calls`."""

    content: str
    reasoning: str | None = None
    tool_calls: list[dict] = dataclasses.field(default_factory=list)


# ---- message validation ----------------------------------------------------------------------------------------
def _text(content, where: str, allow_none: bool = False) -> str:
    """A message content as text: a string, or a list of `{"type": "text", "text": ...}` parts."""
    if content is None and allow_none:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise ValueError(f"{where}.content must be a string or a list of text parts ({{\"type\": \"text\", \"text\": "
                     f"...}}), got {json.dumps(content)[:80]}")


def _tool_call(call, where: str) -> dict:
    """An assistant message's tool call, checked: {"name", "arguments": dict}."""
    if not isinstance(call, dict) or call.get("type", "function") != "function" or not isinstance(
            call.get("function"), dict):
        raise ValueError(f"{where} must be {{\"id\", \"type\": \"function\", \"function\": {{\"name\", \"arguments\"}}}}")
    fn = call["function"]
    if not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ValueError(f"{where}.function.name must be a non-empty string")
    arguments = fn.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments or "{}")
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}.function.arguments is not valid JSON: {e}") from None
    if not isinstance(arguments, dict):
        raise ValueError(f"{where}.function.arguments must be a JSON object")
    return {"id": call.get("id"), "name": fn["name"], "arguments": arguments}


def normalize_messages(messages) -> list[dict]:
    """OpenAI chat messages, checked, as `{"role", "content": str, ...}` with `tool_calls` parsed (assistant) and
    `reasoning` kept (assistant `reasoning_content`); raises ValueError naming the bad message."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise ValueError(f"{where} must be an object with role one of {', '.join(ROLES)}, got "
                             f"{json.dumps(m)[:80]}")
        role = m["role"]
        calls = m.get("tool_calls") or []
        if calls and role != "assistant":
            raise ValueError(f"{where}: only assistant messages carry tool_calls")
        if not isinstance(calls, list):
            raise ValueError(f"{where}.tool_calls must be a list")
        message = {"role": role, "content": _text(m.get("content"), where, allow_none=role == "assistant")}
        if role == "assistant":
            message["tool_calls"] = [_tool_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)]
            reasoning = m.get("reasoning_content")
            if reasoning is not None and not isinstance(reasoning, str):
                raise ValueError(f"{where}.reasoning_content must be a string")
            message["reasoning"] = reasoning or ""
        if role == "tool":
            message["tool_call_id"] = m.get("tool_call_id")
        out.append(message)
    return out


def normalize_tools(tools) -> list[dict]:
    """OpenAI `tools` (`[{"type": "function", "function": {"name", "description", "parameters"}}]`) as their
    function objects; raises ValueError on a malformed entry."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise ValueError("tools must be a list of {\"type\": \"function\", \"function\": {...}} objects")
    out = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": str, ...}}}}")
        if not isinstance(fn.get("parameters", {}), dict):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON Schema object")
        out.append(fn)
    return out


def new_tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def openai_tool_call(name: str, arguments: dict) -> dict:
    """An OpenAI `tool_calls` entry."""
    return {"id": new_tool_call_id(), "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


# ---- DeepSeek-V4 ----------------------------------------------------------------------------------------------
BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"
THINK, END_THINK = "<think>", "</think>"
DSML = "｜DSML｜"
TOOL_CALLS_OPEN, TOOL_CALLS_CLOSE = f"<{DSML}tool_calls>", f"</{DSML}tool_calls>"
MAX_EFFORT = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root "
    "cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial "
    "scenarios.\nExplicitly write out your entire deliberation process, documenting every intermediate step, "
    "considered alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n")


def _json(value) -> str:
    return json.dumps(value, ensure_ascii=False)


def _tools_section(tools: list[dict]) -> str:
    """The tool instructions and schemas V4 reads in its system prompt."""
    d = DSML
    return (
        "## Tools\n\nYou have access to a set of tools to help answer the user's question. You can invoke tools "
        f"by writing a \"<{d}tool_calls>\" block like the following:\n\n"
        f"<{d}tool_calls>\n<{d}invoke name=\"$TOOL_NAME\">\n"
        f"<{d}parameter name=\"$PARAMETER_NAME\" string=\"true|false\">$PARAMETER_VALUE</{d}parameter>\n...\n"
        f"</{d}invoke>\n<{d}invoke name=\"$TOOL_NAME2\">\n...\n</{d}invoke>\n</{d}tool_calls>\n\n"
        "String parameters should be specified as is and set `string=\"true\"`. For all other types (numbers, "
        "booleans, arrays, objects), pass the value in JSON format and set `string=\"false\"`.\n\n"
        f"If thinking_mode is enabled (triggered by {THINK}), you MUST output your complete reasoning inside "
        f"{THINK}...{END_THINK} BEFORE any tool calls or final response.\n\n"
        f"Otherwise, output directly after {END_THINK} with tool calls or final response.\n\n"
        "### Available Tool Schemas\n\n" + "\n".join(_json(t) for t in tools) + "\n\n"
        "You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n")


def dsml_tool_calls(calls: list[dict]) -> str:
    """A DSML `tool_calls` block for calls `{"name", "arguments": dict}` (strings raw, other values as JSON)."""
    invokes = []
    for call in calls:
        params = "\n".join(
            f'<{DSML}parameter name="{k}" string="{"true" if isinstance(v, str) else "false"}">'
            f"{v if isinstance(v, str) else _json(v)}</{DSML}parameter>" for k, v in call["arguments"].items())
        invokes.append(f'<{DSML}invoke name="{call["name"]}">\n{params}\n</{DSML}invoke>')
    return f"{TOOL_CALLS_OPEN}\n" + "\n".join(invokes) + f"\n{TOOL_CALLS_CLOSE}"


_INVOKE = re.compile(rf'<{DSML}invoke name="([^"]*)">(.*?)</{DSML}invoke>', re.S)
_PARAM = re.compile(rf'<{DSML}parameter name="([^"]*)" string="(true|false)">(.*?)</{DSML}parameter>', re.S)


def parse_dsml_tool_calls(block: str) -> list[dict]:
    """OpenAI tool calls from the text after `<｜DSML｜tool_calls>`; raises ValueError on a malformed block."""
    calls = []
    for name, body in _INVOKE.findall(block):
        arguments = {}
        for key, is_string, value in _PARAM.findall(body):
            try:
                arguments[key] = value if is_string == "true" else json.loads(value)
            except json.JSONDecodeError:
                raise ValueError(f"tool call {name!r}: parameter {key!r} is not valid JSON: {value[:80]!r}") from None
        calls.append(openai_tool_call(name, arguments))
    if not calls or TOOL_CALLS_CLOSE not in block:
        raise ValueError("the reply's DSML tool_calls block is malformed or unfinished")
    return calls


# The JSON a forced tool call's values are generated as: as `dsml_tool_calls` writes them (Python's separators).
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ", "lenient": False}
_RAW_STRING_KEYS = {"type", "title", "description", "default", "examples", "minLength", "maxLength"}


def _lark(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _object_schema(tool: dict) -> dict:
    """A tool's parameters as an object schema with `properties` (a top-level `$ref` into `$defs` resolved);
    ValueError for a schema that is not one."""
    schema = tool.get("parameters") or {}
    defs = schema.get("$defs", {})
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#/$defs/") and ref[len("#/$defs/"):] in defs:
        schema = {"$defs": defs, **defs[ref[len("#/$defs/"):]]}
    if schema.get("type", "object") != "object" or not isinstance(schema.get("properties", {}), dict) or any(
            k in schema for k in ("anyOf", "oneOf", "allOf", "$ref")):
        raise ValueError(f"tool {tool['name']!r}: forcing a call needs its parameters as an object schema with "
                         "properties")
    return schema


def _dsml_parameter(name: str, prop, defs: dict) -> str:
    """The Lark rule body of one DSML parameter: a plain string raw (`string="true"`, as V4 writes strings), any
    other value as JSON its schema constrains (`string="false"`)."""
    raw, value = (_lark(f'\n<{DSML}parameter name="{name}" string="{kind}">') for kind in ("true", "false"))
    tail = _lark(f"</{DSML}parameter>")
    prop = prop if isinstance(prop, dict) else {}
    if prop.get("type") == "string" and set(prop) <= _RAW_STRING_KEYS:
        low, high = prop.get("minLength", 0), prop.get("maxLength")
        return f'{raw} /[^<]{{{low},{"" if high is None else high}}}/ {tail}'
    enum = prop.get("enum")
    if prop.get("type", "string") == "string" and isinstance(enum, list) and enum and all(
            isinstance(e, str) and "<" not in e for e in enum) and set(prop) <= _RAW_STRING_KEYS | {"enum"}:
        return f'{raw} ({" | ".join(_lark(e) for e in enum)}) {tail}'
    schema = {**({"$defs": defs} if defs else {}), **prop, "x-guidance": _JSON_OPTIONS}
    return f"{value} %json {json.dumps(schema, ensure_ascii=False)} {tail}"


def dsml_tool_call_grammar(tools: list[dict], parallel: bool = True) -> str:
    """A Lark grammar (llguidance's, `%json` for values) of a reply that is a DSML tool_calls block and nothing
    else: one call (`parallel` False) or more, each of one of `tools` with its required parameters, its
    optional ones or not, in schema order, each valid against its schema. `dsml_tool_calls` writes such a block
    and `parse_dsml_tool_calls` reads it back. Each newline starts the literal after it, so that no literal is
    the prefix of another the lexer may take instead."""
    rules = []
    for i, tool in enumerate(tools):
        schema = _object_schema(tool)
        required, defs = set(schema.get("required", [])), schema.get("$defs", {})
        parts = []
        for j, (name, prop) in enumerate(schema.get("properties", {}).items()):
            rules.append(f"param_{i}_{j}: {_dsml_parameter(name, prop, defs)}")
            parts.append(f"param_{i}_{j}" if name in required else f"param_{i}_{j}?")
        head = _lark(f'\n<{DSML}invoke name="{tool["name"]}">' + ("" if parts else "\n"))  # as `dsml_tool_calls`
        rules.append(f"invoke_{i}: {head} {' '.join(parts)} {_lark(chr(10) + f'</{DSML}invoke>')}")
    invoke = " | ".join(f"invoke_{i}" for i in range(len(tools)))
    calls = f"({invoke})" + ("+" if parallel else "")
    return "\n".join([f"start: {_lark(TOOL_CALLS_OPEN)} {calls} {_lark(chr(10) + TOOL_CALLS_CLOSE)}", *rules]) + "\n"


def json_tool_call_grammar(tools: list[dict], parallel: bool = True) -> str:
    """The grammar of a reply that is vLLM's JSON form of forced tool calls, for a format with no tool-call syntax
    of its own: `[{"name": ..., "parameters": {...}}, ...]`, one call (`parallel` False) or more, each naming one
    of `tools` with parameters valid against its schema (their `$defs` gathered at the top, where their `$ref`s
    point); `parse_json_tool_calls` reads it back. ValueError when two tools define one `$defs` name
    differently."""
    defs, calls = {}, []
    for tool in tools:
        schema = dict(tool.get("parameters") or {})
        for name, value in schema.pop("$defs", {}).items():
            if defs.setdefault(name, value) != value:
                raise ValueError(f"tools define $defs {name!r} differently; forcing a call of either needs one")
        calls.append({"type": "object", "properties": {"name": {"const": tool["name"]}, "parameters": schema},
                      "required": ["name", "parameters"], "additionalProperties": False})
    schema = {**({"$defs": defs} if defs else {}), "type": "array", "items": {"anyOf": calls}, "minItems": 1,
              **({} if parallel else {"maxItems": 1}), "x-guidance": _JSON_OPTIONS}
    return f"start: %json {json.dumps(schema, ensure_ascii=False)}\n"


def parse_json_tool_calls(text: str) -> Reply:
    """The reply of a forced call in vLLM's JSON form (see `json_tool_call_grammar`); the text stays content when
    it is not one (an output the length limit cut)."""
    try:
        calls = json.loads(text)
        return Reply(content="", tool_calls=[openai_tool_call(c["name"], c["parameters"]) for c in calls])
    except (json.JSONDecodeError, TypeError, KeyError):
        return Reply(content=text)


class DeepSeekV4Format:
    """DeepSeek-V4's chat format (chat and thinking modes, tools, tool results); see the module docstring."""

    name = "deepseek-v4"
    reasoning_end, tool_calls_start = END_THINK, TOOL_CALLS_OPEN  # the markers a streamed reply is split at

    @staticmethod
    def tool_call_grammar(tools: list[dict], parallel: bool = True) -> str:
        """The grammar of a reply that only calls `tools` (see `dsml_tool_call_grammar`)."""
        return dsml_tool_call_grammar(tools, parallel)

    def render(self, messages: list[dict], tools: list[dict] = (), thinking: bool = False,
               reasoning_effort: str | None = None) -> str:
        """The prompt of normalized `messages` (see `normalize_messages`) ending in the generation prompt."""
        messages = list(messages)
        if tools:  # the schemas go into the system prompt (an empty one if the request has none)
            if messages[0]["role"] != "system":
                messages.insert(0, {"role": "system", "content": ""})
            head = messages[0]
            messages[0] = {**head, "content": head["content"] + "\n\n" + _tools_section(tools)}
        turns = self._merge_tool_results(messages)
        last_user = max((i for i, t in enumerate(turns) if t["role"] in ("user", "developer")), default=-1)
        keep_reasoning = bool(tools)  # with tools the model's earlier reasoning stays (as V4's encoder does)
        out = [BOS, MAX_EFFORT if thinking and reasoning_effort == "max" else ""]
        for i, turn in enumerate(turns):
            role, content = turn["role"], turn["content"]
            if role == "system":
                out.append(content)
            elif role in ("user", "developer"):
                out.append(USER + content)
            else:  # assistant
                think = turn["reasoning"] + END_THINK if thinking and (keep_reasoning or i > last_user) else ""
                calls = "\n\n" + dsml_tool_calls(turn["tool_calls"]) if turn["tool_calls"] else ""
                out.append(think + content + calls + EOS)
            following = turns[i + 1]["role"] if i + 1 < len(turns) else None
            if role in ("user", "developer") and following in ("assistant", None):
                open_thinking = thinking and (keep_reasoning or i >= last_user)
                out.append(ASSISTANT + (THINK if open_thinking else END_THINK))
        if turns[-1]["role"] not in ("user", "developer"):
            raise ValueError("the last message must be from the user (or a tool result) for the assistant to reply")
        return "".join(out)

    @staticmethod
    def _merge_tool_results(messages: list[dict]) -> list[dict]:
        """Tool messages become `<tool_result>` blocks of a user turn, in the order of the assistant's calls;
        consecutive user and tool messages share one turn, their blocks joined by a blank line."""
        turns: list[dict] = []
        order: dict[str, int] = {}
        for m in messages:
            if m["role"] == "assistant":
                order = {c["id"]: j for j, c in enumerate(m["tool_calls"]) if c["id"]}
            if m["role"] not in ("user", "tool"):
                turns.append(dict(m))
                continue
            if m["role"] == "tool":
                block = (order.get(m["tool_call_id"], len(order)), f"<tool_result>{m['content']}</tool_result>")
            else:
                block = (None, m["content"])
            if turns and turns[-1].get("blocks") is not None:
                turns[-1]["blocks"].append(block)
            else:
                turns.append({"role": "user", "blocks": [block]})
        for t in turns:
            if t.get("blocks") is not None:
                blocks = t.pop("blocks")
                results = iter(sorted((b for b in blocks if b[0] is not None), key=lambda b: b[0]))
                t["content"] = "\n\n".join(text if key is None else next(results)[1] for key, text in blocks)
        return turns

    def parse(self, text: str, thinking: bool = False, forced: bool = False) -> Reply:
        """The reply fields of generated text (special tokens kept, eos dropped); a forced call is a DSML block
        like any other."""
        reasoning = None
        if thinking:
            reasoning, found, text = text.partition(END_THINK)
            if not found:  # cut off while thinking
                return Reply(content="", reasoning=reasoning)
        content, found, block = text.partition(TOOL_CALLS_OPEN)
        if not found:
            return Reply(content=content, reasoning=reasoning)
        try:
            return Reply(content=content.rstrip(), reasoning=reasoning, tool_calls=parse_dsml_tool_calls(block))
        except ValueError:  # not a well-formed call: the text stays content
            return Reply(content=text, reasoning=reasoning)


class PlainFormat:
    """The bundled model's template: a scene of `SPEAKER:\\n` + line + blank line, ending in `ASSISTANT:\\n`.

    It has no tool calls and no thinking mode (the bundled model knows neither)."""

    name = "plain"
    reasoning_end = tool_calls_start = tool_call_grammar = None

    def render(self, messages: list[dict], tools: list[dict] = (), thinking: bool = False,
               reasoning_effort: str | None = None) -> str:
        if tools:
            raise ValueError("this model's chat format has no tool calls: drop `tools`")
        if thinking:
            raise ValueError("this model's chat format has no thinking mode")
        if any(m["role"] == "assistant" and m["tool_calls"] for m in messages) or any(
                m["role"] == "tool" for m in messages):
            raise ValueError("this model's chat format has no tool calls or tool results")
        return "".join(f"{m['role'].upper()}:\n{m['content']}\n\n" for m in messages) + "ASSISTANT:\n"

    def parse(self, text: str, thinking: bool = False, forced: bool = False) -> Reply:
        return Reply(content=text)


class JinjaFormat:
    """A checkpoint's own Jinja chat template (`chat_template` in its tokenizer_config.json), rendered in
    Jinja's immutable sandbox: the template sees `messages` (OpenAI shape; tool-call arguments as objects),
    `tools`, `add_generation_prompt`, `bos_token`, `eos_token`, the `tojson` filter and `raise_exception`. Its
    replies are plain content (no reasoning or tool-call parsing), but for forced tool calls, which take vLLM's
    JSON form (`json_tool_call_grammar`)."""

    name = "jinja"
    reasoning_end = tool_calls_start = None
    tool_call_grammar = staticmethod(json_tool_call_grammar)

    def __init__(self, template: str, bos_token: str = "", eos_token: str = ""):
        import jinja2.ext
        import jinja2.sandbox

        def raise_exception(message):
            raise jinja2.TemplateError(message)

        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                          extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
        env.globals["raise_exception"] = raise_exception
        self.source = template
        try:
            self.template = env.from_string(template)
        except jinja2.TemplateError as e:
            raise ValueError(f"the chat template does not compile: {e}") from None
        self.bos_token, self.eos_token, self._errors = bos_token, eos_token, (jinja2.TemplateError,)

    def render(self, messages: list[dict], tools: list[dict] = (), thinking: bool = False,
               reasoning_effort: str | None = None) -> str:
        if thinking:
            raise ValueError("this model's chat template has no thinking mode")
        view = []
        for m in messages:
            entry = {"role": m["role"], "content": m["content"]}
            if m.get("tool_calls"):
                entry["tool_calls"] = [{"id": c["id"], "type": "function",
                                        "function": {"name": c["name"], "arguments": c["arguments"]}}
                                       for c in m["tool_calls"]]
            if m.get("reasoning"):
                entry["reasoning_content"] = m["reasoning"]
            if m["role"] == "tool":
                entry["tool_call_id"] = m["tool_call_id"]
            view.append(entry)
        try:
            return self.template.render(
                messages=view, tools=[{"type": "function", "function": t} for t in tools] or None,
                add_generation_prompt=True, bos_token=self.bos_token, eos_token=self.eos_token)
        except self._errors as e:  # raise_exception, a sandbox violation, an undefined call
            raise ValueError(f"the chat template refused the messages: {e}") from None

    def parse(self, text: str, thinking: bool = False, forced: bool = False) -> Reply:
        return parse_json_tool_calls(text) if forced else Reply(content=text)


def _token_text(value) -> str:
    """A tokenizer_config.json special token: a string or an AddedToken object with `content`."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""


def jinja_format(checkpoint_dir) -> JinjaFormat | None:
    """The chat template a checkpoint ships in tokenizer_config.json (None if it has none)."""
    path = Path(checkpoint_dir) / "tokenizer_config.json"
    if not path.is_file():
        return None
    config = json.loads(path.read_text(encoding="utf-8"))
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                        None)
    if not isinstance(template, str) or not template:
        return None
    return JinjaFormat(template, _token_text(config.get("bos_token")), _token_text(config.get("eos_token")))


FORMATS = {f.name: f for f in (DeepSeekV4Format, PlainFormat)}


def format_for(tokenizer, name: str = "auto", checkpoint_dir=None):
    """The chat format by name, or (auto) DeepSeek-V4's when the tokenizer has the DSML token, else the
    checkpoint's own Jinja template if it ships one, else plain; or a Jinja template file's (`name` its path;
    bos / eos from the checkpoint's tokenizer_config.json when it has one)."""
    if name not in ("auto", "jinja", *FORMATS):
        path = Path(name)
        if not path.is_file():
            raise ValueError(f"unknown chat format {name!r}; choose auto, jinja, {', '.join(FORMATS)} or give a "
                             "Jinja template file")
        tokens = Path(checkpoint_dir or "") / "tokenizer_config.json"
        config = json.loads(tokens.read_text(encoding="utf-8")) if checkpoint_dir and tokens.is_file() else {}
        return JinjaFormat(path.read_text(encoding="utf-8"), _token_text(config.get("bos_token")),
                           _token_text(config.get("eos_token")))
    if name in FORMATS:
        return FORMATS[name]()
    jinja = jinja_format(checkpoint_dir) if checkpoint_dir is not None else None
    if name == "jinja":
        if jinja is None:
            raise ValueError(f"--chat-format jinja: the checkpoint {checkpoint_dir} ships no chat_template in "
                             "tokenizer_config.json")
        return jinja
    vocab = tokenizer.tokenizer.get_vocab() if hasattr(tokenizer, "tokenizer") else {}
    return DeepSeekV4Format() if DSML in vocab else jinja or PlainFormat()
