"""Generate over real gRPC: the event stream, seeds, previews, both models, ListModels."""

from __future__ import annotations

import io

import numpy as np
import pytest
import pytest_asyncio
from PIL import Image

from aimesh.diffusion.v1 import diffusion_pb2
from mesh.artifacts import sha256_of
from mesh.info import get_info
from services.diffusion.digits import SHIPPED
from services.diffusion.terrain import ONNX_SHA256
from services.diffusion.train_digits import WEIGHTS
from tests.services.diffusion.conftest import events, of_kind

pytestmark = [pytest.mark.service, pytest.mark.asyncio(loop_scope="module")]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def diffusion(start_diffusion):
    return await start_diffusion(preview_min_interval_s=0, progress_min_interval_s=0)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stub(diffusion):
    return diffusion.stub


def pixels(png: bytes) -> np.ndarray:
    return np.array(Image.open(io.BytesIO(png)))


async def test_a_job_streams_queued_progress_images_then_summary(stub):
    request = diffusion_pb2.GenerateRequest(
        model="digits", prompt="3", num_images=2, steps=20, seed=11
    )
    responses = await events(stub.Generate(request))
    kinds = [r.WhichOneof("event") for r in responses]
    assert kinds[0] == "queued" and kinds[-1] == "summary"
    assert kinds.count("image") == 2
    assert "preview" not in kinds  # previews are off unless asked for
    job_id = responses[0].queued.job_id
    assert len(job_id) == 32 and of_kind(responses, "queued")[-1].position == 0
    progress = of_kind(responses, "progress")
    # Unthrottled here; a reader slower than the job may still see steps coalesced.
    steps = [p.step for p in progress]
    assert steps == sorted(set(steps)) and steps[-1] == 20 and len(steps) >= 2
    assert {p.total_steps for p in progress} == {20} and progress[-1].eta_ms == 0
    images = of_kind(responses, "image")
    assert [(i.index, i.seed) for i in images] == [(0, 11), (1, 12)]
    assert all(pixels(i.png).shape == (8, 8) and (i.width, i.height) == (8, 8) for i in images)
    summary = responses[-1].summary
    assert summary.job_id == job_id and list(summary.seeds) == [11, 12]
    assert [s.name for s in summary.timing.stages] == ["queue", "denoise", "encode"]
    assert summary.timing.total_ns >= sum(s.duration_ns for s in summary.timing.stages)


async def test_same_seed_same_bytes_and_image_k_reproducible_alone(stub):
    batch = diffusion_pb2.GenerateRequest(model="digits", prompt="five", num_images=4, seed=90)
    first = [i.png for i in of_kind(await events(stub.Generate(batch)), "image")]
    again = [i.png for i in of_kind(await events(stub.Generate(batch)), "image")]
    assert first == again
    assert len(set(first)) == 4  # different seeds, different digits
    alone = diffusion_pb2.GenerateRequest(model="digits", prompt="five", seed=92)
    (third,) = of_kind(await events(stub.Generate(alone)), "image")
    assert third.png == first[2] and third.seed == 92


async def test_an_unset_seed_is_random_and_reported(stub):
    request = diffusion_pb2.GenerateRequest(model="digits", prompt="1", steps=5)
    seeds = {of_kind(await events(stub.Generate(request)), "image")[0].seed for _ in range(2)}
    assert len(seeds) == 2


async def test_previews_are_throttled_to_every_n_steps(stub):
    request = diffusion_pb2.GenerateRequest(
        model="digits", prompt="8", num_images=2, steps=20, seed=1, preview_every_steps=5
    )
    responses = await events(stub.Generate(request))
    previews = of_kind(responses, "preview")
    assert [(p.step, p.index) for p in previews] == [
        (step, index) for step in (5, 10, 15) for index in (0, 1)
    ]
    assert all(pixels(p.png).shape == (8, 8) for p in previews)
    # Previews come before the images and converge toward them.
    final = pixels(of_kind(responses, "image")[0].png).astype(int)
    errors = [np.abs(pixels(p.png).astype(int) - final).mean() for p in previews if p.index == 0]
    assert errors[-1] <= errors[0]


async def test_ddpm_and_ddim_both_draw_the_digit_asked_for(stub, digit_classifier):
    for sampler, steps in ((diffusion_pb2.SAMPLER_DDPM, 100), (diffusion_pb2.SAMPLER_DDIM, 25)):
        request = diffusion_pb2.GenerateRequest(
            model="digits", prompt="4", num_images=5, steps=steps, seed=7, sampler=sampler
        )
        images = of_kind(await events(stub.Generate(request)), "image")
        assert list(digit_classifier(i.png for i in images)) == [4] * 5


async def test_terrain_heightfields_are_16_bit_and_follow_difficulty(stub):
    def request(difficulty: float, size: int = 0) -> diffusion_pb2.GenerateRequest:
        return diffusion_pb2.GenerateRequest(
            model="terrain",
            seed=3,
            width=size,
            height=size,
            conditioning={"difficulty": difficulty},
        )

    easy = of_kind(await events(stub.Generate(request(1))), "image")[0]
    hard = of_kind(await events(stub.Generate(request(100))), "image")[0]
    again = of_kind(await events(stub.Generate(request(100))), "image")[0]
    assert hard.png == again.png and easy.png != hard.png
    heights = pixels(hard.png)
    assert heights.shape == (128, 128) and heights.dtype == np.uint16 and heights.max() > 255
    big = of_kind(await events(stub.Generate(request(50, 256))), "image")[0]
    assert pixels(big.png).shape == (256, 256) and (big.width, big.height) == (256, 256)


async def test_list_models_gives_each_models_limits(stub):
    models = {m.name: m for m in (await stub.ListModels(diffusion_pb2.ListModelsRequest())).models}
    digits, terrain = models["digits"], models["terrain"]
    assert (digits.width, digits.max_steps, digits.max_images) == (8, 200, 100)
    assert list(digits.samplers) == [diffusion_pb2.SAMPLER_DDIM, diffusion_pb2.SAMPLER_DDPM]
    assert digits.HasField("default_guidance_scale")
    assert [s.width for s in terrain.sizes] == [128, 256, 512, 1024, 2048]
    assert terrain.max_steps == 1 and not terrain.HasField("default_guidance_scale")
    assert "difficulty" in terrain.conditioning


async def test_get_info_names_the_bytes_and_runtime_of_each_model(diffusion):
    info = await get_info(diffusion.target, timeout_s=5)
    models = {m.name: m for m in info.models}
    assert info.loaded and set(models) == {"digits", "terrain"}
    assert models["digits"].sha256 == sha256_of(SHIPPED / WEIGHTS)
    assert (models["digits"].engine, models["digits"].device) == ("torch", "cpu")
    assert models["terrain"].sha256 == ONNX_SHA256
    assert (models["terrain"].engine, models["terrain"].device) == ("onnxruntime", "cpu")
    assert models["terrain"].limits["max_images"] == "16"


@pytest.mark.system  # 100 digits classified
async def test_quality_gate_a_classifier_reads_the_requested_digit(stub, digit_classifier):
    """100 samples with the defaults, 10 per digit, prompts as digits and as words."""
    words = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
    agree = 0
    for digit in range(10):
        prompt = words[digit] if digit % 2 else str(digit)
        request = diffusion_pb2.GenerateRequest(
            model="digits", prompt=prompt, num_images=10, seed=1000 * digit
        )
        images = of_kind(await events(stub.Generate(request)), "image")
        agree += int((digit_classifier(i.png for i in images) == digit).sum())
    assert agree >= 95, f"{agree}/100 samples were read as the digit asked for"
