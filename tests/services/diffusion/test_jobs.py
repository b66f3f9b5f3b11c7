"""Job scoping over real gRPC: queue positions, cancels that hit one job only, slots that
free at once, memory-aware admission, a full queue."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
import pytest_asyncio

from aimesh.diffusion.v1 import diffusion_pb2
from mesh import caller, errors
from tests.conftest import eventually, metric
from tests.services.diffusion.conftest import events, of_kind

pytestmark = [pytest.mark.service, pytest.mark.asyncio(loop_scope="module")]

Request = diffusion_pb2.GenerateRequest
# Each image takes a while (200 steps): long enough to act on while it runs.
LONG = Request(
    model="digits", prompt="2", num_images=100, steps=200, sampler=diffusion_pb2.SAMPLER_DDPM
)
SHORT = Request(model="digits", prompt="6", steps=10, seed=5)


def _fields(request: Request) -> dict:
    return {f.name: v for f, v in request.ListFields()}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def diffusion(start_diffusion):
    return await start_diffusion(slots=1, max_queued_jobs=2)


async def until(call, kind: str) -> diffusion_pb2.GenerateResponse:
    async for event in call:
        if event.WhichOneof("event") == kind:
            return event
    raise AssertionError(f"the stream ended before a {kind} event")


async def cancel(diffusion, job_id: str) -> bool:
    response = await diffusion.stub.Cancel(diffusion_pb2.CancelRequest(job_id=job_id))
    return response.cancelled


async def test_cancelling_a_queued_job_leaves_the_running_one_alone(diffusion):
    running = diffusion.stub.Generate(Request(**{**_fields(LONG), "num_images": 8}))
    first = await until(running, "queued")
    await until(running, "progress")
    waiting = diffusion.stub.Generate(SHORT)
    queued = await until(waiting, "queued")
    assert queued.queued.position == 1
    assert await cancel(diffusion, queued.queued.job_id) is True
    assert await cancel(diffusion, queued.queued.job_id) is False  # idempotent
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await events(waiting)
    assert caught.value.code() == grpc.StatusCode.CANCELLED
    rest = await events(running)
    assert len(of_kind(rest, "image")) == 8 and rest[-1].summary.job_id == first.queued.job_id
    assert await cancel(diffusion, first.queued.job_id) is False  # finished already


def jobs_ended(outcome: str) -> float:
    return metric("aimesh_diffusion_jobs_total", model="digits", outcome=outcome)


async def test_cancelling_the_running_job_starts_the_next_one(diffusion):
    cancelled, completed = jobs_ended("cancelled"), jobs_ended("completed")
    running = diffusion.stub.Generate(LONG)
    job_id = (await until(running, "queued")).queued.job_id
    await until(running, "progress")
    waiting = diffusion.stub.Generate(SHORT)
    assert (await until(waiting, "queued")).queued.position == 1
    cancelled_at = time.perf_counter()
    assert await cancel(diffusion, job_id) is True
    started = await until(waiting, "queued")
    freed_s = time.perf_counter() - cancelled_at
    assert started.queued.position == 0 and freed_s < 5
    assert of_kind(await events(waiting), "summary")
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await events(running)
    assert caught.value.code() == grpc.StatusCode.CANCELLED
    assert errors.error_info(caught.value).reason == "CANCELLED"
    await eventually(lambda: jobs_ended("cancelled") == cancelled + 1)
    await eventually(lambda: jobs_ended("completed") == completed + 1)


async def test_a_caller_that_goes_away_frees_the_slot(diffusion):
    queue = diffusion.servicer.queue
    running = diffusion.stub.Generate(LONG)
    await until(running, "progress")
    assert queue.running == 1
    running.cancel()
    await eventually(lambda: queue.running == 0, timeout_s=5)
    waiting_call = diffusion.stub.Generate(LONG)
    await until(waiting_call, "progress")
    queued_call = diffusion.stub.Generate(SHORT)
    await until(queued_call, "queued")
    assert queue.waiting == 1
    queued_call.cancel()
    await eventually(lambda: queue.waiting == 0, timeout_s=5)
    waiting_call.cancel()
    await eventually(lambda: queue.running == 0, timeout_s=5)


async def test_an_expired_deadline_stops_the_job(diffusion):
    queue = diffusion.servicer.queue
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await events(diffusion.stub.Generate(LONG, timeout=0.5))
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    await eventually(lambda: queue.running == 0, timeout_s=5)
    assert of_kind(await events(diffusion.stub.Generate(SHORT)), "summary")


async def test_past_the_queue_a_job_is_refused_with_a_retry_hint(start_diffusion):
    """On a server of its own: the refusal's retry hint makes its channel hold calls back,
    which must not reach the tests that share the module's server."""
    diffusion = await start_diffusion(slots=1, max_queued_jobs=2)
    running = diffusion.stub.Generate(LONG)
    await until(running, "progress")
    # One after the other: two calls started at once may reach the server in either order.
    queued, positions = [], []
    for _ in range(2):
        queued.append(diffusion.stub.Generate(SHORT))
        positions.append((await until(queued[-1], "queued")).queued.position)
    assert positions == [1, 2]
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await events(diffusion.stub.Generate(SHORT))
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert errors.error_info(caught.value).reason == "QUEUE_FULL"
    assert errors.retry_delay_s(caught.value) > 0
    running.cancel()
    # The line moves up as the running job goes away.
    assert (await until(queued[1], "queued")).queued.position == 1
    for call in queued:
        assert of_kind(await events(call), "summary")


async def test_a_job_that_can_never_fit_is_refused_before_it_queues(start_diffusion):
    small = await start_diffusion(memory_budget_mb=64)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await events(small.stub.Generate(Request(model="terrain")))
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert errors.error_info(caught.value).reason == "JOB_TOO_LARGE"
    assert errors.retry_delay_s(caught.value) is None
    assert small.servicer.queue.waiting == 0
    assert of_kind(await events(small.stub.Generate(SHORT)), "summary")


@pytest.mark.system  # 512 px terrain jobs
async def test_a_job_waits_for_memory_even_with_a_free_slot(start_diffusion):
    # Room for one terrain job's estimate (~260 MiB at 512x512) but not two.
    tight = await start_diffusion(slots=2, memory_budget_mb=400)
    big = Request(model="terrain", width=512, height=512, num_images=3)
    first = tight.stub.Generate(big)
    assert (await until(first, "queued")).queued.position == 0
    second = tight.stub.Generate(big)
    assert (await until(second, "queued")).queued.position == 1
    assert tight.servicer.queue.running == 1
    assert of_kind(await events(first), "summary")
    rest = await events(second)
    assert of_kind(rest, "queued")[-1].position == 0 and of_kind(rest, "summary")


async def test_jobs_on_two_slots_run_side_by_side(start_diffusion):
    wide = await start_diffusion(slots=2)
    calls = [wide.stub.Generate(Request(**{**_fields(LONG), "num_images": 4})) for _ in range(2)]
    firsts = await asyncio.gather(*(until(call, "queued") for call in calls))
    assert [f.queued.position for f in firsts] == [0, 0]
    for call in calls:
        assert of_kind(await events(call), "summary")


async def test_a_long_tiled_image_stops_between_tiles(diffusion):
    """One 2048x2048 heightfield is ~440 tiles (tens of seconds on a CPU): a cancel must
    not wait for the whole image."""
    queue = diffusion.servicer.queue
    call = diffusion.stub.Generate(Request(model="terrain", width=2048, height=2048))
    job_id = (await until(call, "queued")).queued.job_id
    await eventually(lambda: queue.running == 1, timeout_s=5)
    await asyncio.sleep(0.5)
    assert await cancel(diffusion, job_id) is True
    await eventually(lambda: queue.running == 0, timeout_s=10)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await events(call)
    assert caught.value.code() == grpc.StatusCode.CANCELLED


async def test_only_the_client_a_job_is_for_may_cancel_it(diffusion):
    """The edge sets x-aimesh-client to the key's tenant: another tenant that learns a
    job id (it travels in events and logs) cannot stop the job."""

    def as_(tenant: str) -> tuple[tuple[str, str], ...]:
        return ((caller.METADATA_KEY, tenant),)

    job = diffusion.stub.Generate(Request(**{**_fields(LONG), "num_images": 4}), metadata=as_("a"))
    queued = await until(job, "queued")
    await until(job, "progress")
    job_id = queued.queued.job_id
    stub = diffusion.stub
    other = await stub.Cancel(diffusion_pb2.CancelRequest(job_id=job_id), metadata=as_("b"))
    unnamed = await stub.Cancel(diffusion_pb2.CancelRequest(job_id=job_id))
    assert not other.cancelled and not unnamed.cancelled
    await until(job, "progress")  # still running
    owner = await stub.Cancel(diffusion_pb2.CancelRequest(job_id=job_id), metadata=as_("a"))
    assert owner.cancelled
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await events(job)
    assert caught.value.code() == grpc.StatusCode.CANCELLED
