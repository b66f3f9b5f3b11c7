"""Tool calls in the generic, Hermes and Llama 3.1 formats (services/generation/tool_calls.py) as
unit calls: the envelope or grammar every output must fit, the conversation any template
can render, and the streaming parser that takes an output apart, however its text is
split. The model
calling tools through the mesh and the SDKs: test_generation_mesh.py, tests/edge/."""

from __future__ import annotations

import json
import random
from pathlib import Path

import jsonschema
import pytest

from aimesh.common.v1 import common_pb2
from aimesh.llm.v1 import generation_pb2, sampling_pb2
from mesh.validation import Violations
from services.generation import tool_calls
from services.generation.tool_calls import CallParser, Mode
from services.llm.guide import Vocabulary, grammar_of
from tests.services.llm.test_guide import walk

pytestmark = pytest.mark.unit

WEATHER = generation_pb2.ToolDefinition(
    name="get_weather",
    description="The weather in a city.",
    parameters=json.dumps(
        {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"enum": ["C", "F"]},
                "when": {"$ref": "#/$defs/Day"},
            },
            "required": ["city", "unit", "when"],
            "additionalProperties": False,
            "$defs": {"Day": {"type": "integer", "minimum": 0, "maximum": 6}},
        }
    ),
)
ADD = generation_pb2.ToolDefinition(
    name="add",
    parameters=json.dumps(
        {
            "type": "object",
            "properties": {"a": {"type": "integer", "minimum": -99, "maximum": 99}},
            "required": ["a"],
            "additionalProperties": False,
        }
    ),
)


def chunks(text: str, seed: int) -> list[str]:
    """`text` cut at random places, one character at a time included."""
    rng = random.Random(seed)
    pieces, at = [], 0
    while at < len(text):
        step = rng.choice([1, 1, 2, 3, 7])
        pieces.append(text[at : at + step])
        at += step
    return pieces


def parsed(output: str, seed: int, answer_is_text: bool = True, form=tool_calls.GENERIC):
    parser = CallParser(answer_is_text, form)
    answer, deltas = "", []
    for piece in chunks(output, seed):
        text, new = parser.feed(piece)
        answer += text
        deltas += new
    return parser, answer, deltas


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(
    "response",
    [
        "Plain words.",
        'Quotes \\" and \\\\ backslashes, a tab\\t and a line\\nbreak',
        "Emoji escaped \\ud83d\\ude00 and raw 🙂, accents é, CJK 日本",
        "",
    ],
)
def test_an_answer_streams_back_as_its_text(response, seed):
    output = '{"response": "' + response + '"}'
    parser, answer, deltas = parsed(output, seed)
    assert answer == json.loads(output)["response"] and deltas == [] and parser.calls == []


@pytest.mark.parametrize("seed", range(6))
def test_calls_stream_back_as_deltas_that_join_into_the_calls(seed):
    calls = [
        {"name": "get_weather", "arguments": {"city": 'Pa"ris}, ]', "unit": "C", "when": 0}},
        {"name": "add", "arguments": {"a": -4}},
        {"name": "add", "arguments": {}},
    ]
    output = json.dumps({"tool_calls": calls}, ensure_ascii=False)
    parser, answer, deltas = parsed(output, seed)
    assert answer == ""
    assert [(c.name, json.loads(c.arguments)) for c in parser.calls] == [
        (c["name"], c["arguments"]) for c in calls
    ]
    firsts = [d for d in deltas if d.id]
    assert [(d.index, d.name) for d in firsts] == [(0, "get_weather"), (1, "add"), (2, "add")]
    assert len({d.id for d in firsts}) == 3
    for index, call in enumerate(parser.calls):
        assert "".join(d.arguments for d in deltas if d.index == index) == call.arguments


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("value", [{"answer": [1, "}"], "ok": True}, 42, "text", None])
def test_an_answer_of_a_response_format_streams_as_its_json(value, seed):
    output = json.dumps({"response": value})
    _, answer, _ = parsed(output, seed, answer_is_text=False)
    assert json.loads(answer) == value


def _hermes(calls: list[dict]) -> str:
    return "\n".join(
        f"<tool_call>\n{json.dumps(call, ensure_ascii=False)}\n</tool_call>" for call in calls
    )


@pytest.mark.parametrize("seed", range(6))
def test_hermes_calls_stream_back_as_deltas_that_join_into_the_calls(seed):
    calls = [
        {"name": "get_weather", "arguments": {"city": "Pa}\n</tool_call>", "unit": "C"}},
        {"name": "add", "arguments": {"a": -4}},
    ]
    parser, answer, deltas = parsed(_hermes(calls), seed, form=tool_calls.HERMES)
    assert answer == ""
    assert [(c.name, json.loads(c.arguments)) for c in parser.calls] == [
        (c["name"], c["arguments"]) for c in calls
    ]
    assert [(d.index, d.name) for d in deltas if d.id] == [(0, "get_weather"), (1, "add")]
    for index, call in enumerate(parser.calls):
        assert "".join(d.arguments for d in deltas if d.index == index) == call.arguments


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("text", ["Sunny in Oslo.", "<b>bold</b> and 🙂", "<tool_cal", "<"])
def test_a_hermes_answer_is_its_text_as_written(text, seed):
    """Text that does not begin with the tag is the answer, unescaped, streamed as it
    comes (a tag's beginning is held back only while it could still be the tag)."""
    parser, answer, deltas = parsed(text, seed, form=tool_calls.HERMES)
    could_be_the_tag = text in ("<tool_cal", "<")  # held back: the stream stopped there
    assert answer == ("" if could_be_the_tag else text)
    assert deltas == [] and parser.calls == []


@pytest.mark.parametrize("seed", range(4))
def test_a_hermes_answer_of_a_response_format_streams_as_its_json(seed):
    value = {"answer": [1, "}"], "ok": True}
    _, answer, _ = parsed(json.dumps(value), seed, answer_is_text=False, form=tool_calls.HERMES)
    assert json.loads(answer) == value


def _matches(grammar: str, vocabulary: Vocabulary, output: str) -> bool:
    """Whether `output`, tokenized, is a whole output of `grammar`."""
    import llguidance

    matcher = llguidance.LLMatcher(vocabulary.tokenizer, grammar)
    ids = vocabulary.tokenizer.tokenize_str(output)
    return matcher.consume_tokens(ids) and matcher.is_accepting()


def _llama3(calls: list[dict]) -> str:
    (call,) = calls
    return json.dumps({"name": call["name"], "parameters": call["arguments"]})


@pytest.mark.parametrize("seed", range(6))
def test_a_llama3_call_streams_back_as_deltas_that_join_into_the_call(seed):
    call = {"name": "get_weather", "arguments": {"city": 'Pa"}ris', "unit": "C", "when": 1}}
    parser, answer, deltas = parsed(_llama3([call]), seed, form=tool_calls.LLAMA3)
    assert answer == ""
    (made,) = parser.calls
    assert (made.name, json.loads(made.arguments)) == (call["name"], call["arguments"])
    assert "".join(d.arguments for d in deltas) == made.arguments


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("text", ["It is sunny.", '{"nam', '{"city": "Oslo"}', "{"])
def test_a_llama3_answer_is_its_text_as_written(text, seed):
    """Text that stops short of a call's opening, or leaves it, is the answer."""
    parser, answer, deltas = parsed(text, seed, form=tool_calls.LLAMA3)
    if '{"name": "'.startswith(text):  # could yet become a call: held back
        assert answer == ""
    else:
        assert answer == text
    assert deltas == [] and parser.calls == []


@pytest.mark.parametrize(
    ("form", "written"),
    [(tool_calls.HERMES, _hermes), (tool_calls.LLAMA3, _llama3)],
    ids=["hermes", "llama3"],
)
def test_a_native_grammar_takes_valid_calls_or_an_answer_and_nothing_else(
    model_dir: Path, form, written
):
    config = json.loads((model_dir / "config.json").read_text())
    vocabulary = Vocabulary(model_dir / "tokenizer.json", config["vocab_size"], [2])
    weather = {"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C", "when": 3}}
    add = {"name": "add", "arguments": {"a": 5}}
    one_a_turn = form.call_between is None

    def grammar(mode, function="", parallel=True, answer=None) -> str:
        source = tool_calls.native_grammar(form, [WEATHER, ADD], mode, function, parallel, answer)
        violations = Violations()
        compiled = grammar_of(sampling_pb2.OutputConstraint(lark_grammar=source), violations)
        assert not violations.items, violations.items
        return compiled

    auto, required = grammar(Mode.MODE_AUTO), grammar(Mode.MODE_REQUIRED)
    assert _matches(auto, vocabulary, written([weather]))
    assert _matches(auto, vocabulary, "It is sunny.")
    assert not _matches(auto, vocabulary, written([{"name": "get_weather", "arguments": {}}]))
    assert not _matches(auto, vocabulary, written([{**add, "arguments": {"a": 500}}]))
    assert _matches(required, vocabulary, written([add]))
    assert not _matches(required, vocabulary, "It is sunny.")
    if one_a_turn:  # parallel or not, one call
        assert not _matches(required, vocabulary, written([add]) + written([add]))
        wrong_key = json.dumps({"name": "add", "arguments": {"a": 5}})
        assert not _matches(required, vocabulary, wrong_key)
    else:
        assert _matches(auto, vocabulary, written([weather, add]))
        one = grammar(Mode.MODE_REQUIRED, parallel=False)
        assert _matches(one, vocabulary, written([add]))
        assert not _matches(one, vocabulary, written([add, add]))
    named = grammar(Mode.MODE_REQUIRED, function="add")
    assert not _matches(named, vocabulary, written([weather]))
    if form.calls_open:  # a JSON answer beside calls: see the plan's test below
        shaped = grammar(Mode.MODE_AUTO, answer={"type": "object", "required": ["ok"]})
        assert _matches(shaped, vocabulary, '{"ok": true}')
        assert not _matches(shaped, vocabulary, "It is sunny.")


def test_a_template_that_knows_tools_gets_the_turns_and_tools_as_they_came():
    messages = [
        common_pb2.ChatMessage(role="user", content="2 + 2?"),
        common_pb2.ChatMessage(
            role="assistant",
            tool_calls=[common_pb2.ToolCall(id="call_1", name="add", arguments='{"a": 2}')],
        ),
        common_pb2.ChatMessage(role="tool", tool_call_id="call_1", content="4"),
    ]
    request = generation_pb2.ChatRequest(messages=messages, tools=[WEATHER, ADD])
    native = tool_calls.plan(request, tool_format=1)  # TOOL_FORMAT_HERMES
    assert native.messages == messages and native.format is tool_calls.HERMES
    assert native.constraint.WhichOneof("kind") == "lark_grammar"
    offered = json.loads(native.tools)
    assert [t["function"]["name"] for t in offered] == ["get_weather", "add"]
    assert offered[1] == {
        "type": "function",
        "function": {"name": "add", "description": "", "parameters": json.loads(ADD.parameters)},
    }
    llama = tool_calls.plan(request, tool_format=2)  # TOOL_FORMAT_LLAMA3
    assert llama.messages == messages and llama.format is tool_calls.LLAMA3
    assert '\\"parameters' in llama.constraint.lark_grammar and llama.tools == native.tools
    # Llama's calls and a JSON answer both begin with `{"`: the generic format keeps them
    # apart.
    shaped = generation_pb2.ChatRequest(messages=messages, tools=[WEATHER, ADD])
    shaped.sampling.constraint.json_object = True
    assert tool_calls.plan(shaped, tool_format=2).format is tool_calls.GENERIC
    assert tool_calls.plan(shaped, tool_format=1).format is tool_calls.HERMES
    generic = tool_calls.plan(request, tool_format=0)
    assert generic.format is tool_calls.GENERIC and generic.tools == ""
    assert [m.role for m in generic.messages] == ["system", "user", "assistant", "user"]
    # A template without system turns (Mistral's): the tools come before the question.
    folded = tool_calls.plan(request, tool_format=0, system_turn=False)
    assert [m.role for m in folded.messages] == ["user", "assistant", "user"]
    assert folded.messages[0].content.startswith("You can call these tools")
    assert folded.messages[0].content.endswith("\n\n2 + 2?")


def test_only_schema_positions_are_rehomed():
    """A property named `definitions` is a property, and a `const` holding a `$ref` is
    data: both stay as written while the real `$defs` move."""
    parameters = {
        "type": "object",
        "properties": {
            "definitions": {"type": "array", "items": {"type": "string"}},
            "marker": {"const": {"$ref": "#/$defs/Day"}},
            "day": {"$ref": "#/$defs/Day"},
        },
        "required": ["definitions", "marker", "day"],
        "$defs": {"Day": {"type": "integer"}},
    }
    tool = generation_pb2.ToolDefinition(name="f", parameters=json.dumps(parameters))
    schema = tool_calls.envelope([tool], Mode.MODE_REQUIRED, "", True, None)
    arguments = schema["properties"]["tool_calls"]["items"]["properties"]["arguments"]
    assert arguments["properties"]["definitions"] == parameters["properties"]["definitions"]
    assert arguments["properties"]["marker"] == {"const": {"$ref": "#/$defs/Day"}}
    assert arguments["properties"]["day"] == {"$ref": "#/$defs/tool0_Day"}
    assert schema["$defs"] == {"tool0_Day": {"type": "integer"}}
    arguments = {"definitions": ["a"], "marker": {"$ref": "#/$defs/Day"}, "day": 1}
    jsonschema.validate({"tool_calls": [{"name": "f", "arguments": arguments}]}, schema)
    wrong = {**arguments, "definitions": [1]}
    with pytest.raises(jsonschema.ValidationError):  # the property's type still binds
        jsonschema.validate({"tool_calls": [{"name": "f", "arguments": wrong}]}, schema)


def test_a_pydantic_style_schema_with_defs_compiles_nested_in_the_envelope():
    schema = tool_calls.envelope([WEATHER, ADD], Mode.MODE_AUTO, "", True, None)
    violations = Violations()
    assert grammar_of(sampling_pb2.OutputConstraint(json_schema=json.dumps(schema)), violations)
    assert not violations.items
    call = {"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C", "when": 3}}
    jsonschema.validate({"tool_calls": [call]}, schema)
    jsonschema.validate({"response": "hi"}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"tool_calls": [{**call, "arguments": {"city": "Oslo"}}]}, schema)


@pytest.mark.parametrize("seed", range(4))
def test_every_output_under_the_envelope_parses_into_valid_calls(model_dir: Path, seed):
    """Random logits stand in for any model: whatever it writes under a named choice
    (one call, not parallel) parses into a call whose arguments fit the schema."""
    config = json.loads((model_dir / "config.json").read_text())
    vocabulary = Vocabulary(model_dir / "tokenizer.json", config["vocab_size"], [2])
    schema = tool_calls.envelope([WEATHER, ADD], Mode.MODE_REQUIRED, "get_weather", False, None)
    violations = Violations()
    grammar = grammar_of(sampling_pb2.OutputConstraint(json_schema=json.dumps(schema)), violations)
    guide = vocabulary.guide(grammar, violations)
    assert guide is not None
    ids, ended = walk(guide, vocabulary, seed, eos=2)
    from services.llm.artifacts import load_tokenizer

    output = load_tokenizer(model_dir).decode(ids)
    parser, answer, _ = parsed(output, seed)
    assert ended and answer == "" and len(parser.calls) == 1
    (call,) = parser.calls
    assert call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), json.loads(WEATHER.parameters))


def test_the_conversation_renders_calls_and_results_for_any_template():
    messages = [
        common_pb2.ChatMessage(role="system", content="Be brief."),
        common_pb2.ChatMessage(role="user", content="Weather in Oslo, and 2 + 2?"),
        common_pb2.ChatMessage(
            role="assistant",
            tool_calls=[
                common_pb2.ToolCall(id="c1", name="get_weather", arguments='{"city": "Oslo"}'),
                common_pb2.ToolCall(id="c2", name="add", arguments="not json"),
            ],
        ),
        common_pb2.ChatMessage(role="tool", tool_call_id="c1", content="4 C"),
        common_pb2.ChatMessage(role="tool", tool_call_id="c2", content="4"),
    ]
    request = generation_pb2.ChatRequest(messages=messages, tools=[WEATHER, ADD])
    violations = Violations()
    tool_calls.check(request, violations)
    assert not violations.items
    plan = tool_calls.plan(request)
    assert plan is not None and plan.constraint is not None
    roles = [m.role for m in plan.messages]
    assert roles == ["system", "user", "assistant", "user"]
    assert plan.messages[0].content.startswith("Be brief.\n\nYou can call these tools")
    assert json.loads(plan.messages[2].content) == {
        "tool_calls": [
            {"name": "get_weather", "arguments": {"city": "Oslo"}},
            {"name": "add", "arguments": "not json"},
        ]
    }
    assert json.loads(plan.messages[3].content)["tool_results"] == [
        {"tool_call_id": "c1", "name": "get_weather", "content": "4 C"},
        {"tool_call_id": "c2", "name": "add", "content": "4"},
    ]


@pytest.mark.parametrize(
    ("request_fields", "field"),
    [
        ({"tools": [generation_pb2.ToolDefinition(name="a b")]}, "tools[0].name"),
        ({"tools": [ADD, ADD]}, "tools[1].name"),
        (
            {"tools": [generation_pb2.ToolDefinition(name="f", parameters="[1]")]},
            "tools[0].parameters",
        ),
        (
            {"tools": [ADD], "tool_choice": generation_pb2.ToolChoice(function="nope")},
            "tool_choice.function",
        ),
        ({"tool_choice": generation_pb2.ToolChoice(mode=Mode.MODE_REQUIRED)}, "tool_choice"),
        ({"tools": [ADD], "tool_choice": generation_pb2.ToolChoice(mode=9)}, "tool_choice.mode"),
        (
            {"tools": [ADD], "tool_choice": generation_pb2.ToolChoice(function="")},
            "tool_choice.function",
        ),
        (
            {"tools": [ADD], "stopping": sampling_pb2.StoppingCriteria(ignore_eos=True)},
            "stopping.ignore_eos",
        ),
        (
            {
                "tools": [
                    generation_pb2.ToolDefinition(
                        name="deep", parameters='{"a": ' * 100 + "1" + "}" * 100
                    )
                ]
            },
            "tools[0].parameters",
        ),
        (
            {"tools": [generation_pb2.ToolDefinition(name="f", parameters="[" * 5000)]},
            "tools[0].parameters",
        ),
        (
            {
                "tools": [
                    generation_pb2.ToolDefinition(name=f"f{i}", description="d" * 4000)
                    for i in range(100)
                ]
            },
            "tools",
        ),
        (
            {
                "tools": [ADD],
                "sampling": sampling_pb2.SamplingParameters(
                    constraint=sampling_pb2.OutputConstraint(regex="a+")
                ),
            },
            "sampling.constraint",
        ),
        (
            {"messages": [common_pb2.ChatMessage(role="tool", content="4")]},
            "messages[0].tool_call_id",
        ),
        (
            {
                "messages": [
                    common_pb2.ChatMessage(
                        role="user", tool_calls=[common_pb2.ToolCall(id="c", name="add")]
                    )
                ]
            },
            "messages[0].tool_calls",
        ),
    ],
)
def test_bad_tool_fields_are_refused_naming_them(request_fields, field):
    request_fields.setdefault("messages", [common_pb2.ChatMessage(role="user", content="hi")])
    violations = Violations()
    tool_calls.check(generation_pb2.ChatRequest(**request_fields), violations)
    assert field in {v.field for v in violations.items}
