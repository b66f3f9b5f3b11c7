"""POST /v1/images/generations against a scripted diffusion service: OpenAI's shape with
PNGs in b64_json, n/size/seed passed through, the diffusion service's refusals in the
request's words, the images scope, the ledger's image count, and cancellation when the
client goes away."""

from __future__ import annotations

import asyncio
import base64
import io

import openai
import pytest
from PIL import Image

from tests.conftest import eventually, metric
from tests.services.gateway.fakes import IMAGE_MODEL

pytestmark = pytest.mark.service


def pixels(b64: str) -> tuple[str, tuple[int, int], int]:
    image = Image.open(io.BytesIO(base64.b64decode(b64)))
    return image.format, image.size, image.getpixel((0, 0))


async def test_the_sdk_gets_pngs_in_openais_shape(gateway):
    before = metric("aimesh_tenant_images_total", tenant="acme", model=IMAGE_MODEL)
    answer = await gateway.sdk().images.generate(
        model=IMAGE_MODEL,
        prompt="7",
        n=3,
        size="16x16",
        response_format="b64_json",
        extra_body={"seed": 40},
    )
    assert answer.created > 0
    assert [pixels(image.b64_json) for image in answer.data] == [
        ("PNG", (16, 16), 40),
        ("PNG", (16, 16), 41),
        ("PNG", (16, 16), 42),
    ]
    sent = gateway.diffusion.requests[-1]
    assert (sent.model, sent.prompt, sent.num_images, sent.seed) == (IMAGE_MODEL, "7", 3, 40)
    assert (sent.width, sent.height) == (16, 16)
    assert sent.request_id
    assert metric("aimesh_tenant_images_total", tenant="acme", model=IMAGE_MODEL) == before + 3
    async with gateway.http() as client:
        usage = (await client.get("/v1/usage")).json()["data"]
    assert [(r["model"], r["requests"], r["images"]) for r in usage] == [(IMAGE_MODEL, 1, 3)]
    # The defaults: one image at the model's own size, b64_json.
    one = await gateway.sdk().images.generate(model=IMAGE_MODEL, prompt="3")
    assert len(one.data) == 1 and pixels(one.data[0].b64_json)[1] == (8, 8)


async def test_images_need_the_images_scope(gateway):
    with pytest.raises(openai.PermissionDeniedError):
        await gateway.sdk("sk-embed-only").images.generate(model=IMAGE_MODEL, prompt="1")
    assert not gateway.diffusion.requests


async def test_a_client_that_goes_away_cancels_the_job(gateway):
    async with gateway.http() as client:
        request = client.build_request(
            "POST", "/v1/images/generations", json={"model": IMAGE_MODEL, "prompt": "stall"}
        )
        sending = asyncio.create_task(client.send(request))
        await eventually(lambda: gateway.diffusion.running == 1)
        sending.cancel()
    await eventually(lambda: gateway.diffusion.running == 0)
    assert gateway.diffusion.cancelled == 1
