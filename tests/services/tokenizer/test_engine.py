"""The engine alone: incremental detokenization and the roles the chat template accepts."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from services.tokenizer.engine import DEFAULT_ROLES, TokenizerEngine

pytestmark = pytest.mark.unit


def _check_in_chunks(engine: TokenizerEngine, ids: list[int], data: st.DataObject) -> None:
    """Feeds `ids` in random-size chunks (empty ones too) and compares with one decode."""
    sizes = data.draw(st.lists(st.integers(min_value=0, max_value=6), max_size=len(ids)))
    detokenizer = engine.incremental_detokenizer(skip_special_tokens=False)
    deltas, start = [], 0
    for size in sizes:
        deltas.append(detokenizer.push(ids[start : start + size]))
        start += size
    deltas += [detokenizer.push(ids[start:]), detokenizer.finish()]
    whole = engine.detokenize(ids, skip_special_tokens=False)
    assert "".join(deltas) == whole
    if "\ufffd" not in whole:  # valid UTF-8: no delta may hold a broken character
        assert not any("\ufffd" in delta for delta in deltas)


@settings(max_examples=50, deadline=None)
@given(text=st.text(max_size=120), data=st.data())
def test_deltas_of_a_text_add_up_to_its_decode(engine: TokenizerEngine, text, data):
    ids = engine.tokenize(text, add_special_tokens=False, return_details=False).ids
    _check_in_chunks(engine, ids, data)


@settings(max_examples=50, deadline=None)
@given(ids=st.lists(st.integers(min_value=0, max_value=49_151), max_size=60), data=st.data())
def test_deltas_of_any_ids_add_up_to_their_decode(engine: TokenizerEngine, ids, data):
    """Ids a model samples need not form valid UTF-8; the deltas must still add up."""
    _check_in_chunks(engine, ids, data)


def test_a_broken_tail_is_flushed_as_a_replacement(engine: TokenizerEngine):
    ids = engine.tokenize("a🙂", add_special_tokens=False, return_details=False).ids
    detokenizer = engine.incremental_detokenizer(skip_special_tokens=False)
    assert detokenizer.push(ids[:-1]) == ""
    assert detokenizer.finish() == "a\ufffd"
    assert detokenizer.finish() == ""


def test_a_template_that_renders_any_role_accepts_the_usual_ones(engine: TokenizerEngine):
    assert engine.roles == DEFAULT_ROLES


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


@pytest.mark.parametrize(
    ("template_name", "tool_format", "markers"),
    [
        (
            "QWEN_TOOLS_TEMPLATE",
            "TOOL_FORMAT_HERMES",
            ['<tool_call>\n{"name": "get_weather"', "<tool_response>\nRain"],
        ),
        (
            "LLAMA31_TOOLS_TEMPLATE",
            "TOOL_FORMAT_LLAMA3",
            ['{"name": "get_weather", "parameters"', "ipython<|end_header_id|>\n\nRain"],
        ),
    ],
)
def test_a_template_that_knows_tools_renders_them_and_the_calls_as_transformers_does(
    model_dir, tmp_path, template_name, tool_format, markers
):
    """Qwen's tool format (Hermes's) and Llama 3.1's are recognised; the tools, an
    assistant's calls and the tool turns render exactly as transformers renders them,
    and SmolLM2's own template, which knows no tools, says so and renders the turns as
    it always did."""
    from aimesh.tokenizer.v1 import tokenizer_pb2
    from tests import gguf_models

    source = getattr(gguf_models, template_name)
    template = tmp_path / "tools.jinja"
    template.write_text(source)
    engine = TokenizerEngine.load(model_dir, template)
    assert engine.tool_format == tokenizer_pb2.ToolFormat.Value(tool_format)
    turns = [
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Oslo"}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "Rain"},
    ]
    rendered = engine.apply_chat_template(turns, True, False, [WEATHER_TOOL]).text
    reference = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    reference.chat_template = source
    expected = reference.apply_chat_template(
        turns, tools=[WEATHER_TOOL], tokenize=False, add_generation_prompt=True
    )
    assert rendered == expected
    assert all(marker in rendered for marker in markers), rendered

    smol = TokenizerEngine.load(model_dir)
    assert smol.tool_format == tokenizer_pb2.TOOL_FORMAT_UNSPECIFIED
    plain = [("user", "Weather in Oslo?")]
    assert (
        smol.apply_chat_template(plain, True, False, [WEATHER_TOOL]).text
        == smol.apply_chat_template(plain, True, False).text
    )


def test_a_template_that_renders_one_call_a_turn_refuses_two_as_the_callers_error(
    model_dir, tmp_path
):
    from mesh.failures import InvalidInput
    from tests.gguf_models import LLAMA31_TOOLS_TEMPLATE

    template = tmp_path / "llama.jinja"
    template.write_text(LLAMA31_TOOLS_TEMPLATE)
    llama = TokenizerEngine.load(model_dir, template)
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {}}}
    turns = [
        {"role": "user", "content": "Weather in Oslo and Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [{**call, "id": i} for i in "ab"]},
    ]
    with pytest.raises(InvalidInput) as refused:
        llama.apply_chat_template(turns, True, False, [WEATHER_TOOL])
    (violation,) = refused.value.violations
    assert violation.field == "messages" and "single tool-calls" in violation.description
