"""Tool calls in the generic format (services/generation/tool_calls.py) as unit calls:
the envelope every output must fit, the conversation any template can render, and the
streaming parser that takes an output apart, however its text is split. The model
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


def parsed(output: str, seed: int, answer_is_text: bool = True):
    parser = CallParser(answer_is_text=answer_is_text)
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
