"""The diffusion service with the terrain UNet's passes on a real Triton server: the same
heightfield as in process for a seed, a cancel between passes, and Triton's outage as the
mesh's own UNAVAILABLE and readiness, recovered without restarting the service."""

from __future__ import annotations

import asyncio
import io
import time
from collections.abc import AsyncIterator

import grpc
import numpy as np
import pytest
import pytest_asyncio
from PIL import Image

from aimesh.diffusion.v1 import diffusion_pb2, diffusion_pb2_grpc
from mesh import deadline
from mesh.errors import error_info
from mesh.health import probe, wait_until_serving
from mesh.triton import TritonModel, TritonSettings
from services.diffusion.denoisers import TritonDenoiser
from services.diffusion.engine import Plan
from services.diffusion.terrain import TerrainModel
from tests.conftest import VENV_BIN, free_port, subprocess_env
from tests.triton.conftest import until

pytestmark = [pytest.mark.system, pytest.mark.asyncio(loop_scope="package")]

MODEL = "terrain_denoiser"
DIFFICULTY = 37
# 4 images of 3 x 3 tiles: 36 passes of about a second each on 2 busy cores, so a cancel or
# an outage a second or two in lands mid-job, with most of the job still to run.
LONG = diffusion_pb2.GenerateRequest(model="terrain", width=256, height=256, num_images=4, seed=5)


@pytest_asyncio.fixture(scope="module", loop_scope="package")
async def diffusion(triton, tmp_path_factory) -> AsyncIterator[str]:
    """`aimesh serve diffusion` with terrain alone, its passes on Triton; quick breaker."""
    log = tmp_path_factory.mktemp("diffusion") / "diffusion.log"
    port = free_port()
    process = await asyncio.create_subprocess_exec(
        str(VENV_BIN / "aimesh"), "serve", "diffusion",
        env=subprocess_env(
            AIMESH_SERVICES__DIFFUSION__PORT=str(port),
            AIMESH_SERVICES__DIFFUSION__METRICS_PORT="0",
            AIMESH_SERVICES__DIFFUSION__MODELS="terrain",
            AIMESH_SERVICES__DIFFUSION__DEVICE="cpu",
            AIMESH_SERVICES__DIFFUSION__TERRAIN_BACKEND="triton",
            AIMESH_SERVICES__DIFFUSION__TRITON__URL=triton.url,
            AIMESH_SERVICES__DIFFUSION__TRITON__MODEL=MODEL,
            AIMESH_CLIENT__BREAKER__OPEN_WAIT_S="1",
        ),
        stderr=log.open("wb"),
    )  # fmt: skip
    target = f"127.0.0.1:{port}"
    try:
        assert await wait_until_serving(target, "diffusion", timeout_s=120), log.read_text()[-3000:]
        yield target
    finally:
        if process.returncode is None:
            process.kill()
        await process.wait()


def heights(png: bytes) -> np.ndarray:
    return np.array(Image.open(io.BytesIO(png)))


async def generate(target: str, request: diffusion_pb2.GenerateRequest) -> list:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = diffusion_pb2_grpc.DiffusionServiceStub(channel)
        return [event async for event in stub.Generate(request, timeout=120)]


async def started(call) -> str:
    """Reads the stream until the job holds its slot; its id."""
    async for event in call:
        if event.WhichOneof("event") == "queued" and event.queued.position == 0:
            return event.queued.job_id
    raise AssertionError("the stream ended before the job started")


async def test_a_heightfield_through_triton_equals_the_in_process_one(diffusion):
    request = diffusion_pb2.GenerateRequest(
        model="terrain", width=256, height=256, seed=21, conditioning={"difficulty": DIFFICULTY}
    )
    images = [e.image for e in await generate(diffusion, request) if e.HasField("image")]
    assert [(image.index, image.seed) for image in images] == [(0, 21)]
    served = heights(images[0].png)

    local = TerrainModel(device="cpu")
    plan = Plan(DIFFICULTY, 256, 1, diffusion_pb2.Sampler.SAMPLER_CONSISTENCY, None, (21,))
    sampling = local.start(plan)
    await asyncio.to_thread(sampling.advance, 0, lambda: None)
    assert served.dtype == np.uint16 and served.shape == (256, 256)
    assert served.max() > 255, "a real heightfield, not a blank one"
    # Within one level of 65535, not bit-exact: Triton's environment has ONNX Runtime
    # 1.23 (the newest for numpy<2) and this one 1.31, whose kernels round a pass's
    # outputs differently by ~1e-6; measured, 18 to 45 of 65,536 pixels differ, by 1.
    difference = np.abs(served.astype(np.int32) - sampling.result(0))
    assert difference.max() <= 1
    assert np.count_nonzero(difference) < served.size // 200


async def test_listed_as_running_on_triton(diffusion):
    async with grpc.aio.insecure_channel(diffusion) as channel:
        stub = diffusion_pb2_grpc.DiffusionServiceStub(channel)
        listed = await stub.ListModels(diffusion_pb2.ListModelsRequest(), timeout=10)
    (terrain,) = listed.models
    assert "run on Triton Inference Server" in terrain.description


async def test_a_pass_runs_within_the_budget_of_the_thread_that_asks(triton):
    """The runner thread's deadline reaches the ModelInfer made for it on the event loop."""
    denoiser = TritonDenoiser(
        TritonModel(TritonSettings(url=triton.url, model=MODEL)), asyncio.get_running_loop()
    )
    feeds = {
        "noisy": np.zeros((1, 1, 128, 128), np.float32),
        "sigma": np.full(1, 80.0, np.float32),
        "difficulty": np.full(1, 0.5, np.float32),
    }

    def within(seconds: float) -> np.ndarray:
        with deadline.budget(seconds):
            return denoiser(feeds)

    try:
        assert (await asyncio.to_thread(within, 60.0)).shape == (1, 1, 128, 128)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await asyncio.to_thread(within, -1.0)
        assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert error_info(caught.value).reason == "BUDGET_SPENT"
        with pytest.raises(RuntimeError, match="from a thread"):
            denoiser(feeds)
    finally:
        await denoiser.model.close()


async def test_a_cancelled_job_stops_at_its_next_pass(diffusion):
    async with grpc.aio.insecure_channel(diffusion) as channel:
        stub = diffusion_pb2_grpc.DiffusionServiceStub(channel)
        call = stub.Generate(LONG, timeout=120)
        job_id = await started(call)
        await asyncio.sleep(1.5)
        cancelled_at = time.monotonic()
        assert (await stub.Cancel(diffusion_pb2.CancelRequest(job_id=job_id))).cancelled
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            async for event in call:
                assert not event.HasField("image"), "stopped long before its first image"
        assert caught.value.code() == grpc.StatusCode.CANCELLED
        # At most the pass in flight finishes: about a second, bounded generously.
        assert time.monotonic() - cancelled_at < 8


async def test_triton_down_fails_the_job_with_unavailable_and_the_service_recovers(
    diffusion, triton
):
    async with grpc.aio.insecure_channel(diffusion) as channel:
        stub = diffusion_pb2_grpc.DiffusionServiceStub(channel)
        call = stub.Generate(LONG, timeout=120)
        await started(call)
        await asyncio.sleep(1.5)

        async def rest() -> grpc.aio.AioRpcError:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                async for event in call:
                    assert not event.HasField("image"), "stopped long before its first image"
            return caught.value

        failing = asyncio.create_task(rest())
        stopping_at = time.monotonic()
        await asyncio.to_thread(triton.stop)
        error = await asyncio.wait_for(failing, timeout=30)
        # Triton's own shutdown (the pass in flight, then exit) and one refused pass; the
        # job's 30-odd remaining passes would take far longer.
        assert time.monotonic() - stopping_at < 15
    assert error.code() == grpc.StatusCode.UNAVAILABLE, error
    assert error_info(error).reason == "TRITON_UNAVAILABLE"

    async def not_ready() -> bool:
        return await probe(diffusion, "diffusion") == "NOT_SERVING"

    await until(not_ready, timeout_s=10)
    assert await probe(diffusion, "") == "SERVING", "alive all along"

    triton.start()
    await triton.wait_all_ready()
    assert await wait_until_serving(diffusion, "diffusion", timeout_s=30)

    async def serves() -> bool:
        small = diffusion_pb2.GenerateRequest(model="terrain", seed=3)
        try:
            return any(event.HasField("image") for event in await generate(diffusion, small))
        except grpc.aio.AioRpcError:
            return False

    await until(serves, timeout_s=30)
