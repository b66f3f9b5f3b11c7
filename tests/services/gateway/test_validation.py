"""Bad values refused with a 400 (or 404) naming the parameter, before the mesh is
called: chat, completions and images, all against one gateway (and its stand-ins) per
module, since none of these requests changes it."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from tests.services.gateway.conftest import Gateway, start_gateway
from tests.services.gateway.fakes import IMAGE_MODEL, LLM

pytestmark = [pytest.mark.service, pytest.mark.asyncio(loop_scope="module")]


def chat(content: str = "hi there", **extra) -> dict:
    return {"model": LLM, "messages": [{"role": "user", "content": content}], **extra}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def shared_gateway(tmp_path_factory) -> AsyncIterator[Gateway]:
    gateway, servers = await start_gateway(tmp_path_factory.mktemp("validation"))
    try:
        yield gateway
    finally:
        for server in servers:
            await server.drain(0)


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"temperature": 1e9}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"seed": -1}, "seed"),
        ({"n": 17}, "n"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"logprobs": "yes please"}, "logprobs"),
        ({"logit_bias": {"1": 5}}, "logit_bias"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"frequency_penalty": 3}, "frequency_penalty"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"response_format": {"type": "text", "json_schema": {"name": "x"}}}, "response_format"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "a b"}}},
            "response_format.json_schema.name",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 1}}},
            "response_format.json_schema.schema",
        ),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages[0].content",
        ),
        ({"model": ""}, "model"),
    ],
)
async def test_bad_values_are_400_naming_the_parameter(shared_gateway, change, param):
    async with shared_gateway.http() as client:
        response = await client.post("/v1/chat/completions", json={**chat(), **change})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param)
    assert not shared_gateway.generation.requests  # refused before the mesh was called


async def test_nan_temperature_and_broken_json_are_400(shared_gateway):
    async with shared_gateway.http() as client:
        nan = await client.post(
            "/v1/chat/completions",
            content=json.dumps({**chat(), "temperature": float("nan")}).encode(),
            headers={"content-type": "application/json"},
        )
        broken = await client.post(
            "/v1/chat/completions", content=b"{nope", headers={"content-type": "application/json"}
        )
    assert (nan.status_code, nan.json()["error"]["param"]) == (400, "temperature")
    assert broken.status_code == 400 and broken.json()["error"]["type"] == "invalid_request_error"


async def test_completions_refuse_what_they_cannot_do(shared_gateway):
    async with shared_gateway.http() as client:
        for change, param in [
            ({"prompt": [1, 2, 3]}, "prompt"),
            ({"prompt": ["a", "b"]}, "prompt"),
            ({"echo": True}, "echo"),
            ({"suffix": "end"}, "suffix"),
            ({"best_of": 3}, "best_of"),
            ({"logprobs": 21}, "logprobs"),
            ({"logprobs": -1}, "logprobs"),
        ]:
            response = await client.post(
                "/v1/completions", json={"model": LLM, "prompt": "a", **change}
            )
            assert (response.status_code, response.json()["error"]["param"]) == (400, param)


@pytest.mark.parametrize(
    ("change", "status", "param"),
    [
        ({"prompt": "a cat"}, 400, "prompt"),  # the model's own refusal, mapped
        ({"size": "12x12"}, 400, "size"),
        ({"size": "big"}, 400, "size"),
        ({"response_format": "url"}, 400, "response_format"),
        ({"n": 0}, 400, "n"),
        ({"seed": -1}, 400, "seed"),
        ({"style": "vivid"}, 400, "style"),
        ({"quality": "hd"}, 400, "quality"),
        ({"model": "dall-e-3"}, 404, "model"),
    ],
)
async def test_bad_image_requests_name_the_parameter(shared_gateway, change, status, param):
    async with shared_gateway.http() as client:
        response = await client.post(
            "/v1/images/generations", json={"model": IMAGE_MODEL, "prompt": "1", **change}
        )
    assert response.status_code == status, response.text
    assert response.json()["error"]["param"] == param
    if param == "response_format":
        assert "url" in response.json()["error"]["message"]
