"""POST /v1/images/generations in front of the real diffusion service (the digits
DDPM, on the CPU, in this process): the openai SDK's images decode as PNGs of the digit
asked for, a seed reproduces them, and the model's own refusal names `prompt`."""

from __future__ import annotations

import base64
import io
from collections.abc import AsyncIterator

import numpy as np
import pytest
import pytest_asyncio
from PIL import Image
from sklearn.datasets import load_digits
from sklearn.svm import SVC

from mesh.config import MeshSettings
from tests.harness import InProcess
from tests.services.gateway.conftest import Gateway, start_gateway

pytestmark = pytest.mark.system


@pytest_asyncio.fixture
async def real_gateway(tmp_path) -> AsyncIterator[Gateway]:
    async with InProcess() as services:
        settings = MeshSettings(
            services={"diffusion": {"device": "cpu", "models": ["digits"], "metrics_port": 0}}
        )
        diffusion = await services.start("diffusion", settings)
        gateway, servers = await start_gateway(
            tmp_path, dependencies={"diffusion": diffusion.target}
        )
        try:
            yield gateway
        finally:
            for client in gateway.clients:
                await client.close()
            for server in servers:
                await server.drain(0)


def classify(pngs: list[bytes]) -> list[int]:
    """The digit each 8x8 PNG shows, by an SVM trained on scikit-learn's digits."""
    digits = load_digits()
    classifier = SVC(gamma=0.001).fit(digits.data, digits.target)
    rows = [np.array(Image.open(io.BytesIO(png)), float).reshape(64) / 255 * 16 for png in pngs]
    return [int(d) for d in classifier.predict(np.stack(rows))]


async def test_the_sdk_draws_the_digit_asked_for(real_gateway):
    client = real_gateway.sdk()
    assert "digits" in [model.id for model in (await client.models.list()).data]
    answer = await client.images.generate(
        model="digits", prompt="seven", n=4, response_format="b64_json", extra_body={"seed": 11}
    )
    pngs = [base64.b64decode(image.b64_json) for image in answer.data]
    assert all(png.startswith(b"\x89PNG\r\n\x1a\n") for png in pngs)
    assert {Image.open(io.BytesIO(png)).size for png in pngs} == {(8, 8)}
    assert sum(digit == 7 for digit in classify(pngs)) >= 3
    again = await client.images.generate(model="digits", prompt="7", extra_body={"seed": 11})
    assert base64.b64decode(again.data[0].b64_json) == pngs[0]  # seed k draws image k

    async with real_gateway.http() as http:
        refused = await http.post(
            "/v1/images/generations", json={"model": "digits", "prompt": "a cat"}
        )
        too_many = await http.post(
            "/v1/images/generations", json={"model": "digits", "prompt": "1", "size": "64x64"}
        )
    assert (refused.status_code, refused.json()["error"]["param"]) == (400, "prompt")
    assert "digit" in refused.json()["error"]["message"]
    assert (too_many.status_code, too_many.json()["error"]["param"]) == (400, "size")
