"""Diffusion servers over real loopback gRPC, each with the settings a test needs."""

from __future__ import annotations

import io
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable

import numpy as np
import pytest
import pytest_asyncio
from PIL import Image
from sklearn.datasets import load_digits
from sklearn.svm import SVC

from aimesh.diffusion.v1 import diffusion_pb2, diffusion_pb2_grpc
from mesh.config import MeshSettings
from services.diffusion.servicer import SERVICE, DiffusionServicer
from tests.harness import InProcess


class Diffusion:
    """A running diffusion server's stub, its servicer (to watch slots free) and address."""

    def __init__(
        self,
        stub: diffusion_pb2_grpc.DiffusionServiceStub,
        servicer: DiffusionServicer,
        target: str,
    ) -> None:
        self.stub = stub
        self.servicer = servicer
        self.target = target


StartDiffusion = Callable[..., Awaitable[Diffusion]]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def start_diffusion() -> AsyncIterator[StartDiffusion]:
    async with InProcess() as services:

        async def start(**engine_settings: object) -> Diffusion:
            settings = MeshSettings(services={"diffusion": {"device": "cpu", **engine_settings}})
            served = await services.start("diffusion", settings)
            channel = services.channel(served.target, SERVICE, settings=settings)
            return Diffusion(
                diffusion_pb2_grpc.DiffusionServiceStub(channel), served.servicer, served.target
            )

        yield start


async def events(call) -> list[diffusion_pb2.GenerateResponse]:
    return [event async for event in call]


def of_kind(responses, kind: str) -> list:
    return [getattr(r, kind) for r in responses if r.WhichOneof("event") == kind]


@pytest.fixture(scope="session")
def digit_classifier() -> Callable[[Iterable[bytes]], np.ndarray]:
    """An SVM trained on the real digits: PNG bytes -> the digit each one shows."""
    digits = load_digits()
    classifier = SVC(gamma=0.001).fit(digits.data, digits.target)

    def classify(pngs: Iterable[bytes]) -> np.ndarray:
        rows = [np.array(Image.open(io.BytesIO(png)), float).reshape(64) / 255 * 16 for png in pngs]
        return classifier.predict(np.stack(rows))

    return classify
