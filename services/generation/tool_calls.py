"""Tool calls: the tools offered to the model, its output constrained to calls of them
(or an answer), and that output taken apart again as it streams, into the answer's text
and the calls' deltas.

A chat template that knows tools renders them itself, and the model writes its calls in
the format it was trained on; the tokenizer service says which (ToolFormat). Hermes's
(Qwen 2.5 and 3, Hermes 2 Pro): the template gets the tools and the turns in OpenAI's
shape, and the output is calls, each a JSON object `{"name": ..., "arguments": {...}}` on
a line of its own between a `<tool_call>` and a `</tool_call>` line, or in `auto` mode an
answer that does not begin with the tag.

Llama 3.1's (and 3.2's and 3.3's, custom tools): the template gets the tools and the
turns, results go in `ipython` turns, and the output is one call,
`{"name": ..., "parameters": {...}}`, as the whole turn (the template renders one call a
turn, so calls are never parallel), or in `auto` mode an answer that does not begin like
one.

For templates that know no tools (SmolLM2's among them), llama.cpp's generic format: the
tools described in the system turn, the output one JSON object,
`{"tool_calls": [{"name": ..., "arguments": {...}}, ...]}` to call or `{"response": "..."}`
to answer, and earlier turns rendered the same way: an assistant's calls as the JSON it
would have written, the tools' results as one user turn (`{"tool_results": [...]}`).

Either way the grammar (services/llm/guide.py) makes every call name one of the request's
functions and every arguments object valid against that function's schema, so a call
always parses, in `auto` mode too. Not yet: Mistral's `[TOOL_CALLS]` format (its
marker is a control token, which the grammar would have to name by id and the
detokenizer keep); its templates fall back to the generic format.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from aimesh.common.v1 import common_pb2
from aimesh.llm.v1 import generation_pb2, sampling_pb2
from aimesh.tokenizer.v1 import tokenizer_pb2
from mesh.validation import Violations
from services.llm.guide import JSON_FORMAT, MAX_SCHEMA_BYTES, grammar_of

MAX_TOOLS = 128
MAX_DESCRIPTION_BYTES = 4096
# A function's arguments nest a few levels; the envelope is built by recursion.
MAX_SCHEMA_DEPTH = 64
# All of them are rendered into the prompt, which the tokenizer takes up to 1 MiB of.
MAX_TOOLS_BYTES = 256 * 1024
NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
NAME_RULE = "must be 1 to 64 of a-z, A-Z, 0-9, _ and -"
Mode = generation_pb2.ToolChoice.Mode
_CALL_OPEN = '{"name": "'
_REF = re.compile(r"^#/(\$defs|definitions)/")
_TAG_OPEN, _TAG_CLOSE = "<tool_call>", "</tool_call>"


def _mode(request: generation_pb2.ChatRequest) -> tuple[int, str]:
    """(mode, the function it must call or "")."""
    choice = request.tool_choice
    if choice.WhichOneof("choice") == "function":
        return Mode.MODE_REQUIRED, choice.function
    mode = choice.mode if choice.WhichOneof("choice") == "mode" else Mode.MODE_UNSPECIFIED
    return (Mode.MODE_AUTO if mode == Mode.MODE_UNSPECIFIED else mode), ""


def check(request: generation_pb2.ChatRequest, violations: Violations) -> None:
    """The tools, the choice among them and the tool fields of the conversation: each
    refusal names its field. Tool schemas are compiled later, with the whole constraint."""
    tools = request.tools
    violations.check(len(tools) <= MAX_TOOLS, "tools", f"at most {MAX_TOOLS} tools")
    names: set[str] = set()
    for i, tool in enumerate(tools[:MAX_TOOLS]):
        if violations.check(NAME.fullmatch(tool.name) is not None, f"tools[{i}].name", NAME_RULE):
            violations.check(tool.name not in names, f"tools[{i}].name", "is not unique")
            names.add(tool.name)
        violations.max_length(
            tool.description.encode(), f"tools[{i}].description", MAX_DESCRIPTION_BYTES
        )
        if tool.parameters:
            violations.max_length(
                tool.parameters.encode(), f"tools[{i}].parameters", MAX_SCHEMA_BYTES
            )
            schema = _loaded(tool.parameters)
            if violations.check(
                isinstance(schema, dict),
                f"tools[{i}].parameters",
                "must be a JSON object (a JSON Schema)",
            ):
                violations.check(
                    _depth(schema) <= MAX_SCHEMA_DEPTH,
                    f"tools[{i}].parameters",
                    f"nests deeper than {MAX_SCHEMA_DEPTH} levels",
                )
    total = sum(len(t.description.encode()) + len(t.parameters.encode()) for t in tools)
    violations.check(
        total <= MAX_TOOLS_BYTES,
        "tools",
        f"descriptions and schemas must be at most {MAX_TOOLS_BYTES} bytes in all, got {total}",
    )
    mode, function = _mode(request)
    choice = request.tool_choice
    if choice.WhichOneof("choice") == "function":
        violations.check(function in names, "tool_choice.function", "is none of the tools")
    violations.check(
        mode in (Mode.MODE_AUTO, Mode.MODE_NONE, Mode.MODE_REQUIRED),
        "tool_choice.mode",
        f"must be one of {sorted(Mode.keys())[1:]}",
    )
    violations.check(
        not (tools and mode != Mode.MODE_NONE and request.stopping.ignore_eos),
        "stopping.ignore_eos",
        "cannot be combined with tools: a turn of calls ends with the end token",
    )
    violations.check(
        bool(tools) or mode != Mode.MODE_REQUIRED,
        "tool_choice",
        "requires a tool to be called but no tools were given",
    )
    violations.check(
        not (tools and request.sampling.choices), "tools", "cannot be combined with choices"
    )
    kind = request.sampling.constraint.WhichOneof("kind")
    violations.check(
        not tools or mode == Mode.MODE_NONE or kind in (None, "json_schema", "json_object"),
        "sampling.constraint",
        "with tools, only a JSON schema or json_object can shape the answer",
    )
    for i, message in enumerate(request.messages):
        if message.tool_calls:
            violations.check(
                message.role == "assistant",
                f"messages[{i}].tool_calls",
                "only an assistant turn makes calls",
            )
        for j, call in enumerate(message.tool_calls):
            violations.check(bool(call.id), f"messages[{i}].tool_calls[{j}].id", "is required")
            violations.check(
                NAME.fullmatch(call.name) is not None,
                f"messages[{i}].tool_calls[{j}].name",
                NAME_RULE,
            )
        violations.check(
            bool(message.tool_call_id) == (message.role == "tool"),
            f"messages[{i}].tool_call_id",
            "is required on a tool turn, and only there",
        )


def _loaded(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def _parameters(tool: generation_pb2.ToolDefinition) -> Any:
    """The tool's arguments schema, parsed (checked before); any object when it has none."""
    return _loaded(tool.parameters) if tool.parameters else {"type": "object"}


def _depth(value: Any) -> int:
    """How deep a parsed JSON value nests, walked without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict | list):
            deepest = max(deepest, depth)
            children = node.values() if isinstance(node, dict) else node
            stack.extend((child, depth + 1) for child in children)
    return deepest


# Keywords whose value is data, not a schema: a `$ref` or `$defs` key in them is kept.
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples", "required"})
# Keywords whose value maps names (of properties, say) to schemas.
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "dependentSchemas"})


def _rehomed(schema: Any, prefix: str, defs: dict[str, Any]) -> Any:
    """`schema` with its `$defs` moved into `defs` under `prefix` and its references
    renamed to match: a function's schema nested in the envelope would otherwise point
    its `#/$defs/...` references at the envelope's root (pydantic writes nested models
    that way). Only schema positions are walked: a property named `$defs` stays a
    property, a `const` stays as written."""
    if isinstance(schema, list):  # anyOf, allOf, prefixItems...: lists of schemas
        return [_rehomed(item, prefix, defs) for item in schema]
    if not isinstance(schema, dict):
        return schema
    moved: dict[str, Any] = {}
    for key, value in schema.items():
        if key in ("$defs", "definitions") and isinstance(value, dict):
            for name, definition in value.items():
                defs[f"{prefix}{name}"] = _rehomed(definition, prefix, defs)
        elif key == "$ref" and isinstance(value, str) and _REF.match(value):
            moved[key] = "#/$defs/" + prefix + _REF.sub("", value)
        elif key in _DATA_KEYWORDS:
            moved[key] = value
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            moved[key] = {name: _rehomed(sub, prefix, defs) for name, sub in value.items()}
        else:
            moved[key] = _rehomed(value, prefix, defs)
    return moved


def _closed(properties: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
    }


def _call_schemas(
    tools: Sequence[generation_pb2.ToolDefinition], function: str, defs: dict[str, Any]
) -> list[dict[str, Any]]:
    """One schema per callable tool (`function` alone, when named): its name and its
    arguments; their `$defs` go into `defs`."""
    calls = []
    for i, tool in enumerate(tools):
        if function and tool.name != function:
            continue
        parameters = _parameters(tool)
        arguments = _rehomed(parameters, f"tool{i}_", defs)
        calls.append(_closed({"name": {"const": tool.name}, "arguments": arguments}))
    return calls


def native_grammar(
    form: CallFormat,
    tools: Sequence[generation_pb2.ToolDefinition],
    mode: int,
    function: str,
    parallel: bool,
    answer: dict[str, Any] | None,
) -> str:
    """The Lark grammar (llguidance's) of every output allowed in a template's own
    format `form`: calls of the tools the choice allows (one when not parallel, when a
    function is named or when the format writes one a turn), or, in auto mode, an
    answer: text that does not begin like the calls, or what `answer` (the
    response_format's schema) describes, for a format whose calls open with a tag."""
    # The format's separators hold a call object's closing brace; here each call is
    # written whole: its opening up to the arguments as a literal (so that the lexer
    # tells a call from an answer's text as they are written, side by side), then the
    # arguments as JSON of the tool's schema (its own root: its `$defs` resolve as
    # written), then the brace.
    opening, closing = _literal(form.calls_open), _literal(form.calls_close[1:])
    many = parallel and not function and form.call_between is not None
    repeated = f" ({_literal(form.call_between[1:])} call)*" if many else ""
    lines = [
        "start: calls | answer" if mode == Mode.MODE_AUTO else "start: calls",
        f"calls: {opening} call{repeated} {closing}",
    ]
    callable_ = [(i, tool) for i, tool in enumerate(tools) if not function or tool.name == function]
    lines.append("call: " + " | ".join(f"call{i}" for i, _ in callable_))
    for i, tool in callable_:
        head = _literal(f'{_CALL_OPEN}{tool.name}", "{form.arguments_key}": ')
        arguments = _parameters(tool)
        lines.append(f'call{i}: {head} arguments{i} "}}"')
        lines.append(f"arguments{i}: %json {json.dumps({**arguments, 'x-guidance': JSON_FORMAT})}")
    if mode == Mode.MODE_AUTO:
        if answer is not None:  # its own root, like each call's arguments
            lines.append(f"answer: %json {json.dumps({**answer, 'x-guidance': JSON_FORMAT})}")
        else:
            # Hermes's calls begin with the tag; a line break after it is not needed for
            # text to read as a call.
            marker = (form.calls_open or _CALL_OPEN).rstrip("\n")
            lines.append(f"answer: /{_not_beginning_with(marker)}/")
    return "\n".join(lines)


def _literal(text: str) -> str:
    """`text` as a Lark string (JSON's escapes are Lark's), or nothing when empty."""
    return json.dumps(text) if text else ""


def _not_beginning_with(tag: str) -> str:
    """A regex (Rust's syntax, no lookaround) of any non-empty text that does not begin
    with `tag`: it differs from the tag at some character before the tag ends."""
    differs = [re.escape(tag[:k]) + "[^" + re.escape(tag[k]) + "]" for k in range(len(tag))]
    return "(?:" + "|".join(differs) + ")(?s:.*)"


def envelope(
    tools: Sequence[generation_pb2.ToolDefinition],
    mode: int,
    function: str,
    parallel: bool,
    answer: dict[str, Any] | None,
) -> dict[str, Any]:
    """The JSON schema of every output allowed: calls of the tools the choice allows
    (one when not parallel or when a function is named), or, in auto mode, an answer (a
    string, or what `answer`, the response_format's schema, describes)."""
    defs: dict[str, Any] = {}
    calls = _call_schemas(tools, function, defs)
    array: dict[str, Any] = {
        "type": "array",
        "items": calls[0] if len(calls) == 1 else {"anyOf": calls},
        "minItems": 1,
    }
    if not parallel or function:  # a named function is called once, as OpenAI does
        array["maxItems"] = 1
    schema: dict[str, Any] = _closed({"tool_calls": array})
    if mode == Mode.MODE_AUTO:
        response = _rehomed(answer, "answer_", defs) if answer else {"type": "string"}
        schema = {"anyOf": [schema, _closed({"response": response})]}
    if defs:
        schema["$defs"] = defs
    return schema


def _instruction(tools: Sequence[generation_pb2.ToolDefinition], mode: int, function: str) -> str:
    described = [
        {
            "name": tool.name,
            "description": tool.description,
            "parameters": _parameters(tool),
        }
        for tool in tools
    ]
    lines = [
        "You can call these tools (their arguments as JSON Schemas):",
        json.dumps(described, ensure_ascii=False),
    ]
    call = '{"tool_calls": [{"name": <tool name>, "arguments": <arguments object>}]}'
    if function:
        lines.append(f"Call the tool {function} now, replying with only {call}.")
    elif mode == Mode.MODE_REQUIRED:
        lines.append(f"Call one or more of them now, replying with only {call}.")
    else:
        lines.append(
            f"Reply with only a JSON object: {call} to call tools, or "
            '{"response": <your answer>} to answer without them. After tool results, '
            "answer with them."
        )
    return "\n".join(lines)


def _call_text(calls: Sequence[common_pb2.ToolCall]) -> str:
    """An assistant's calls as it would have written them."""
    written = []
    for call in calls:
        arguments = _loaded(call.arguments)
        if arguments is None or _depth(arguments) > MAX_SCHEMA_DEPTH:
            arguments = call.arguments  # as the string it came as
        written.append({"name": call.name, "arguments": arguments})
    return json.dumps({"tool_calls": written}, ensure_ascii=False)


def conversation(
    messages: Sequence[common_pb2.ChatMessage], instruction: str, system_turn: bool = True
) -> list[common_pb2.ChatMessage]:
    """The turns as any chat template can render them: the instruction joined to the
    system turn (or one made for it; for a template without system turns, Mistral's,
    put before the first user turn's words, as llama.cpp does), calls as JSON text,
    consecutive tool results as one user turn."""
    names = {call.id: call.name for m in messages for call in m.tool_calls}
    rendered: list[common_pb2.ChatMessage] = []
    results: list[dict[str, str]] = []

    def flush() -> None:
        if results:
            text = json.dumps({"tool_results": results}, ensure_ascii=False)
            rendered.append(common_pb2.ChatMessage(role="user", content=text))
            results.clear()

    for message in messages:
        if message.role == "tool":
            results.append(
                {
                    "tool_call_id": message.tool_call_id,
                    "name": names.get(message.tool_call_id, ""),
                    "content": message.content,
                }
            )
            continue
        flush()
        if message.tool_calls:
            calls = _call_text(message.tool_calls)
            content = f"{message.content}\n{calls}" if message.content else calls
            rendered.append(common_pb2.ChatMessage(role="assistant", content=content))
        else:
            rendered.append(common_pb2.ChatMessage(role=message.role, content=message.content))
    flush()
    if instruction:
        if rendered and rendered[0].role == "system":
            rendered[0].content = f"{rendered[0].content}\n\n{instruction}".lstrip()
        elif system_turn:
            rendered.insert(0, common_pb2.ChatMessage(role="system", content=instruction))
        else:
            first = next((m for m in rendered if m.role == "user"), None)
            if first is None:
                first = common_pb2.ChatMessage(role="user")
                rendered.insert(0, first)
            first.content = f"{instruction}\n\n{first.content}".rstrip()
    return rendered


@dataclass(frozen=True)
class CallFormat:
    """How an output opens its calls ("": the first call's own `{"name": "` opens
    them), goes from one to the next (None: one call only) and closes them, each call
    `{"name": "...", "<arguments_key>": {...}}` in between, and how it answers instead:
    after `answer_open`, as a JSON value, or (None) as the text itself."""

    calls_open: str
    call_between: str | None
    calls_close: str
    answer_open: str | None
    arguments_key: str = "arguments"


GENERIC = CallFormat('{"tool_calls": [', "}, ", "}]}", '{"response": ')
HERMES = CallFormat(f"{_TAG_OPEN}\n", f"}}\n{_TAG_CLOSE}\n{_TAG_OPEN}\n", f"}}\n{_TAG_CLOSE}", None)
LLAMA3 = CallFormat("", None, "}", None, arguments_key="parameters")
# The formats of templates that render tools themselves, by tokenizer_pb2.ToolFormat.
NATIVE_FORMATS = {
    tokenizer_pb2.TOOL_FORMAT_HERMES: HERMES,
    tokenizer_pb2.TOOL_FORMAT_LLAMA3: LLAMA3,
}


@dataclass(frozen=True)
class Plan:
    """A chat request with tools as the router runs it."""

    messages: list[common_pb2.ChatMessage]
    constraint: sampling_pb2.OutputConstraint | None
    # The answer is text (else raw JSON of response_format's shape).
    answer_is_text: bool
    format: CallFormat = GENERIC
    # OpenAI's `tools` JSON for a template that renders them itself; "" when it does not.
    tools: str = ""


def uses_tools(request: generation_pb2.ChatRequest) -> bool:
    """Whether the request offers tools or its conversation holds calls or results."""
    return bool(request.tools) or any(m.tool_calls or m.role == "tool" for m in request.messages)


def plan(
    request: generation_pb2.ChatRequest, tool_format: int = 0, system_turn: bool = True
) -> Plan | None:
    """What a checked request becomes for a template whose tool format is `tool_format`
    (tokenizer_pb2.ToolFormat) and which renders a system turn or not; None when it has
    no tool fields at all."""
    if not uses_tools(request):
        return None
    native = NATIVE_FORMATS.get(tool_format)
    mode, function = _mode(request)
    if not request.tools or mode == Mode.MODE_NONE:
        if native is not None:
            return Plan(list(request.messages), None, answer_is_text=True)
        return Plan(conversation(request.messages, "", system_turn), None, answer_is_text=True)
    shape = request.sampling.constraint
    answer = None
    if shape.WhichOneof("kind") == "json_schema":
        answer = _loaded(shape.json_schema)
    elif shape.WhichOneof("kind") == "json_object":
        answer = {"type": "object"}
    parallel = not request.HasField("parallel_tool_calls") or request.parallel_tool_calls
    if native is not None and not native.calls_open and answer and mode == Mode.MODE_AUTO:
        # A call and a JSON answer would both begin with `{"`, which the grammar cannot
        # keep apart as they are written: the generic format, as llama.cpp does.
        native = None
    if native is not None:
        grammar = native_grammar(native, request.tools, mode, function, parallel, answer)
        return Plan(
            list(request.messages),
            sampling_pb2.OutputConstraint(lark_grammar=grammar),
            answer_is_text=answer is None,
            format=native,
            tools=json.dumps([_openai_tool(tool) for tool in request.tools]),
        )
    schema = envelope(request.tools, mode, function, parallel, answer)
    return Plan(
        conversation(request.messages, _instruction(request.tools, mode, function), system_turn),
        sampling_pb2.OutputConstraint(json_schema=json.dumps(schema)),
        answer_is_text=answer is None,
    )


def _openai_tool(tool: generation_pb2.ToolDefinition) -> dict[str, Any]:
    """A tool as OpenAI's request gives it, the shape templates read."""
    parameters = _parameters(tool)
    function = {"name": tool.name, "description": tool.description, "parameters": parameters}
    return {"type": "function", "function": function}


def compile_problem(plan_: Plan, violations: Violations) -> None:
    """The envelope compiles, or the tools are refused with the compiler's message.
    Blocking: milliseconds for large schemas."""
    if plan_.constraint is not None:
        found = Violations()
        grammar_of(plan_.constraint, found)
        for violation in found.items:
            violations.add("tools", violation.description)


@dataclass
class CallParser:
    """Takes the constrained output apart as it streams. The grammar fixes its every
    separator, so a scan with no backtracking suffices: the answer's text (unescaped as
    it completes) or its JSON, and each call's name once whole and its arguments as they
    are written."""

    answer_is_text: bool = True
    format: CallFormat = GENERIC
    calls: list[common_pb2.ToolCall] = field(default_factory=list)
    _buffer: str = ""
    _at: int = 0
    _state: str = "start"
    _depth: int = 0
    _in_string: bool = False
    _escaped: bool = False

    def feed(self, text: str) -> tuple[str, list[generation_pb2.ToolCallDelta]]:
        """The answer text and call deltas that `text` completes."""
        self._buffer += text
        answer: list[str] = []
        deltas: list[generation_pb2.ToolCallDelta] = []
        while self._step(answer, deltas):
            pass
        return "".join(answer), deltas

    def _expect(self, literal: str) -> bool | None:
        """True and past it when the buffer holds `literal` here; None while it may yet;
        False when something else is here."""
        rest = self._buffer[self._at :]
        if rest.startswith(literal):
            self._at += len(literal)
            return True
        return None if literal.startswith(rest) else False

    def _step(self, answer: list[str], deltas: list[generation_pb2.ToolCallDelta]) -> bool:
        """One move of the scan; False when it needs more text."""
        state = self._state
        form = self.format
        if state == "start":
            opens = self._expect(form.calls_open or _CALL_OPEN)
            if opens:
                self._state = "call" if form.calls_open else "name"
                return True
            if form.answer_open is None:  # the answer is whatever else comes
                if opens is False:
                    self._state = "answer"
                return opens is False
            if self._expect(form.answer_open):
                self._state = "answer"
                if self.answer_is_text:
                    return self._expect('"') is True or self._back(form.answer_open)
                return True
            return False
        if state == "answer":
            return self._answer(answer)
        if state == "call":
            if self._expect(_CALL_OPEN):
                self._state = "name"
                return True
            return False
        if state == "name":
            end = self._buffer.find('"', self._at)
            if end < 0:
                return False
            name, self._at = self._buffer[self._at : end], end
            call = common_pb2.ToolCall(id=f"call_{secrets.token_hex(12)}", name=name)
            self.calls.append(call)
            deltas.append(
                generation_pb2.ToolCallDelta(index=len(self.calls) - 1, id=call.id, name=name)
            )
            self._state = "arguments_open"
            return True
        if state == "arguments_open":
            if self._expect(f'", "{form.arguments_key}": '):
                self._state = "arguments"
                return True
            return False
        if state == "arguments":
            fragment, done = self._value()
            if fragment:
                self.calls[-1].arguments += fragment
                deltas.append(
                    generation_pb2.ToolCallDelta(index=len(self.calls) - 1, arguments=fragment)
                )
            if done:
                self._state = "call_close"
            return done
        if state == "call_close":
            between = False if form.call_between is None else self._expect(form.call_between)
            if between:
                self._state = "call"
                return True
            if between is False and self._expect(form.calls_close):
                self._state = "end"
                return True
            return False
        return False

    def _back(self, literal: str) -> bool:
        """The answer's opening quote has not arrived yet: wait at the opening."""
        self._at -= len(literal)
        self._state = "start"
        return False

    def _value(self) -> tuple[str, bool]:
        """The next stretch of a JSON value being written, and whether it is whole (a
        scalar ends where the envelope's `,`, `}` or `]` begins)."""
        start = self._at
        for index in range(self._at, len(self._buffer)):
            char = self._buffer[index]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
                    if self._depth == 0:
                        return self._cut(start, index + 1)
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]" or (char == "," and self._depth == 0):
                if self._depth == 0:
                    return self._cut(start, index)
                self._depth -= 1
                if self._depth == 0:
                    return self._cut(start, index + 1)
        self._at = len(self._buffer)
        return self._buffer[start:], False

    def _cut(self, start: int, end: int) -> tuple[str, bool]:
        self._at = end
        return self._buffer[start:end], True

    def _answer(self, answer: list[str]) -> bool:
        if self.answer_is_text and self.format.answer_open is None:
            answer.append(self._buffer[self._at :])
            self._at = len(self._buffer)
            return False
        if not self.answer_is_text:
            fragment, done = self._value()
            answer.append(fragment)
            if done:
                self._state = "end"
            return done
        text, used, closed = _unescaped(self._buffer[self._at :])
        answer.append(text)
        self._at += used
        if closed:
            self._state = "end"
        return closed


_SIMPLE_ESCAPES = {
    '"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"
}  # fmt: skip


def _unescaped(rest: str) -> tuple[str, int, bool]:
    """A JSON string's content from `rest`, decoded as far as it is whole: (the text, the
    characters used, whether its closing quote came). An escape cut short, or the first
    half of a surrogate pair without its second, waits for more."""
    out: list[str] = []
    at = 0
    while at < len(rest):
        char = rest[at]
        if char == '"':
            return "".join(out), at + 1, True
        if char != "\\":
            out.append(char)
            at += 1
            continue
        if at + 1 >= len(rest):
            break
        if rest[at + 1] != "u":
            out.append(_SIMPLE_ESCAPES[rest[at + 1]])
            at += 2
            continue
        if at + 6 > len(rest):
            break
        code = int(rest[at + 2 : at + 6], 16)
        if 0xD800 <= code < 0xDC00:  # a pair: \\uD83D\\uDE00
            if at + 12 > len(rest):
                break
            low = int(rest[at + 8 : at + 12], 16)
            out.append(chr(0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00)))
            at += 12
            continue
        out.append(chr(code))
        at += 6
    return "".join(out), at, False
