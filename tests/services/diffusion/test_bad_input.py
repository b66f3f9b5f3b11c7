"""Every malformed GenerateRequest and CancelRequest gets INVALID_ARGUMENT naming its fields."""

from __future__ import annotations

import math

import grpc
import pytest
import pytest_asyncio

from aimesh.diffusion.v1 import diffusion_pb2
from mesh.errors import field_violations
from tests.services.diffusion.conftest import events

pytestmark = [pytest.mark.service, pytest.mark.asyncio(loop_scope="module")]

Request = diffusion_pb2.GenerateRequest


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def diffusion(start_diffusion):
    return await start_diffusion()


CASES = {
    "unknown model": (Request(model="sdxl"), ["model"]),
    "no model": (Request(), ["model"]),
    "a word digits cannot draw": (Request(model="digits", prompt="eleven"), ["prompt"]),
    "a prompt for terrain": (Request(model="terrain", prompt="mountains"), ["prompt"]),
    "a huge prompt": (Request(model="digits", prompt="7" * 2000), ["prompt"]),
    "zero steps": (Request(model="digits", prompt="1", steps=0), ["steps"]),
    "10^5 steps": (Request(model="digits", prompt="1", steps=100_000), ["steps"]),
    "negative steps": (Request(model="digits", prompt="1", steps=-5), ["steps"]),
    "two terrain steps": (Request(model="terrain", steps=2), ["steps"]),
    "zero images": (Request(model="digits", prompt="1", num_images=0), ["num_images"]),
    "10^4 images": (Request(model="digits", prompt="1", num_images=10_000), ["num_images"]),
    "NaN guidance": (Request(model="digits", guidance_scale=math.nan), ["guidance_scale"]),
    "infinite guidance": (Request(model="digits", guidance_scale=math.inf), ["guidance_scale"]),
    "negative guidance": (Request(model="digits", guidance_scale=-1), ["guidance_scale"]),
    "guidance for terrain": (Request(model="terrain", guidance_scale=3), ["guidance_scale"]),
    "unsupported size": (Request(model="digits", width=64, height=64), ["width"]),
    "not square": (Request(model="terrain", width=128, height=256), ["width"]),
    "negative size": (Request(model="terrain", width=-128, height=-128), ["width"]),
    "a sampler the model lacks": (
        Request(model="digits", sampler=diffusion_pb2.SAMPLER_CONSISTENCY),
        ["sampler"],
    ),
    "an unknown sampler number": (Request(model="digits", sampler=42), ["sampler"]),
    "difficulty 0": (Request(model="terrain", conditioning={"difficulty": 0}), None),
    "difficulty 101": (Request(model="terrain", conditioning={"difficulty": 101}), None),
    "difficulty NaN": (Request(model="terrain", conditioning={"difficulty": math.nan}), None),
    "a fractional difficulty": (
        Request(model="terrain", conditioning={"difficulty": 50.5}),
        None,
    ),
    "an unknown conditioning key": (
        Request(model="terrain", conditioning={"roughness": 1}),
        ["conditioning[roughness]"],
    ),
    "conditioning for digits": (
        Request(model="digits", conditioning={"difficulty": 5}),
        ["conditioning[difficulty]"],
    ),
    "a seed past 2^64": (Request(model="digits", seed=2**64 - 1, num_images=2), ["seed"]),
    # Refusals travel in trailing metadata, which clients cap at 16 KiB: none may echo these.
    "a 300 KB model name": (Request(model="x" * 300_000), ["model"]),
    "a 300 KB prompt": (Request(model="digits", prompt="7" * 300_000), ["prompt"]),
    "a 300 KB request id": (
        Request(model="digits", prompt="1", request_id="r" * 300_000),
        ["request_id"],
    ),
    "a 300 KB conditioning key": (
        Request(model="terrain", conditioning={"k" * 300_000: 1}),
        ["conditioning"],
    ),
    "10^4 conditioning keys": (
        Request(model="terrain", conditioning={f"k{i}": 1 for i in range(10_000)}),
        ["conditioning"],
    ),
    "a non-ASCII conditioning key": (
        Request(model="terrain", conditioning={"сложность": 5}),
        ["conditioning[сложность]"],
    ),
    # str.isdigit() holds for these; int() refuses "²".
    "a superscript digit": (Request(model="digits", prompt="²"), ["prompt"]),
    "an Arabic-Indic digit": (Request(model="digits", prompt="٣"), ["prompt"]),
    "int32 max steps": (Request(model="digits", prompt="1", steps=2**31 - 1), ["steps"]),
    "int32 min images": (Request(model="digits", prompt="1", num_images=-(2**31)), ["num_images"]),
    "int32 max size": (Request(model="terrain", width=2**31 - 1, height=2**31 - 1), ["width"]),
    "difficulty 1e308": (Request(model="terrain", conditioning={"difficulty": 1e308}), None),
    "a subnormal difficulty": (Request(model="terrain", conditioning={"difficulty": 5e-324}), None),
    "difficulty -inf": (Request(model="terrain", conditioning={"difficulty": -math.inf}), None),
    "a subnormal guidance": (
        Request(model="digits", guidance_scale=-1e-45),
        ["guidance_scale"],
    ),
    "negative previews": (Request(model="digits", preview_every_steps=-1), ["preview_every_steps"]),
    "everything at once": (
        Request(model="digits", prompt="cat", steps=0, num_images=0, guidance_scale=math.nan),
        ["num_images", "steps", "guidance_scale", "prompt"],
    ),
}


@pytest.mark.parametrize("request_, fields", CASES.values(), ids=CASES.keys())
async def test_bad_generate_requests_are_refused_with_field_violations(diffusion, request_, fields):
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await events(diffusion.stub.Generate(request_))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    reported = [v.field for v in field_violations(caught.value)]
    assert reported == (fields or ["conditioning[difficulty]"])
    assert diffusion.servicer.queue.waiting == diffusion.servicer.queue.running == 0


async def test_edge_values_that_are_valid_are_accepted(diffusion):
    for request in (
        Request(model="digits", prompt=" SEVEN ", steps=1, seed=2**64 - 1, guidance_scale=0),
        Request(model="digits", prompt="", num_images=1, steps=200, width=8, height=8),
        Request(model="terrain", conditioning={"difficulty": 100}, seed=0),
    ):
        responses = await events(diffusion.stub.Generate(request))
        assert responses[-1].WhichOneof("event") == "summary"


@pytest.mark.parametrize(
    ("job_id", "field"),
    [("", "job_id"), ("x" * 65, "job_id"), ("x" * 300_000, "job_id")],
    ids=["empty", "too long", "300 KB"],
)
async def test_bad_cancel_requests(diffusion, job_id, field):
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await diffusion.stub.Cancel(diffusion_pb2.CancelRequest(job_id=job_id))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert [v.field for v in field_violations(caught.value)] == [field]


@pytest.mark.parametrize("job_id", ["f" * 32, "задание", "\x00"], ids=["hex", "Cyrillic", "NUL"])
async def test_cancelling_an_unknown_job_says_so(diffusion, job_id):
    response = await diffusion.stub.Cancel(diffusion_pb2.CancelRequest(job_id=job_id))
    assert response.cancelled is False
