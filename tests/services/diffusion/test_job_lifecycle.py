"""A job's slot, memory, events and cancel on every path, driven through the servicer in
process so that each race lands exactly where the test puts it."""

from __future__ import annotations

import asyncio
import threading

import pytest
import pytest_asyncio

from aimesh.diffusion.v1 import diffusion_pb2
from mesh.failures import Cancelled
from services.diffusion import runner
from services.diffusion.events import PREVIEW_ROUNDS, JobEvents
from services.diffusion.jobs import Job, JobQueue
from services.diffusion.requests import plan_job
from services.diffusion.runner import Throttle, run_job
from tests.conftest import eventually
from tests.services.diffusion.conftest import of_kind

pytestmark = [pytest.mark.service, pytest.mark.asyncio(loop_scope="module")]

Request = diffusion_pb2.GenerateRequest
SHORT = Request(model="digits", prompt="6", steps=10, seed=5)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def diffusion(start_diffusion):
    return await start_diffusion(
        models="digits", slots=1, preview_min_interval_s=0, progress_min_interval_s=0
    )


def held(queue: JobQueue) -> tuple[int, int, int]:
    return queue.running, queue.waiting, queue.reserved_bytes


async def completes(servicer) -> bool:
    responses = [event async for event in servicer.Generate(SHORT, None)]
    return responses[-1].WhichOneof("event") == "summary"


@pytest.mark.parametrize("how", ["closed", "cancelled"])
async def test_a_caller_leaving_as_its_job_is_admitted_frees_the_slot(diffusion, how):
    """gRPC closes a handler's stream at the yield it was suspended at when its caller
    goes away; here that yield is the Queued(0) that says the job holds the slot."""
    queue = diffusion.servicer.queue
    idle = held(queue)
    stream = diffusion.servicer.Generate(SHORT, None)
    assert (await anext(stream)).queued.position == 0
    assert queue.running == 1
    if how == "closed":
        await stream.aclose()
    else:
        with pytest.raises(asyncio.CancelledError):
            await stream.athrow(asyncio.CancelledError())
    assert held(queue) == idle
    assert await completes(diffusion.servicer)
    assert held(queue) == idle


async def test_a_caller_leaving_while_queued_or_running_frees_everything(diffusion):
    queue = diffusion.servicer.queue
    idle = held(queue)
    long = Request(model="digits", prompt="2", num_images=100, steps=200)
    running = diffusion.servicer.Generate(long, None)
    assert (await anext(running)).queued.position == 0
    await anext(running)  # a Progress: the worker is under way
    waiting = diffusion.servicer.Generate(SHORT, None)
    assert (await anext(waiting)).queued.position == 1
    await waiting.aclose()
    assert queue.waiting == 0 and queue.running == 1
    await running.aclose()
    await eventually(lambda: held(queue) == idle, timeout_s=10)
    assert await completes(diffusion.servicer)


async def test_a_cancel_as_the_job_is_admitted_stops_it_and_frees_the_slot(diffusion):
    queue = diffusion.servicer.queue
    idle = held(queue)
    stream = diffusion.servicer.Generate(SHORT, None)
    first = await anext(stream)
    assert first.queued.position == 0
    assert queue.cancel(first.queued.job_id, "") is True
    with pytest.raises(Cancelled):
        await anext(stream)
    await eventually(lambda: held(queue) == idle)
    assert await completes(diffusion.servicer)


async def test_a_cancel_after_the_last_unit_says_it_stopped_nothing(diffusion):
    """The worker has done all its work, but has not handed back its slot yet."""
    servicer = diffusion.servicer
    queue = JobQueue(slots=1, budget_bytes=2**30, max_queue=1)
    model, plan = plan_job(SHORT, servicer.models)
    job = Job(model, plan, 1)
    queue.submit(job)
    assert await queue.next_position(job, None) == 0
    events: list[diffusion_pb2.GenerateResponse] = []
    await asyncio.to_thread(run_job, job, events.append, preview_every=0, throttle=Throttle(0, 0))
    assert len(of_kind(events, "image")) == 1
    assert queue.cancel(job.id, "") is False
    queue.release(job)
    assert held(queue) == (0, 0, 0)


async def test_a_job_cancelled_before_its_last_unit_ends_cancelled(diffusion):
    model, plan = plan_job(SHORT, diffusion.servicer.models)
    job = Job(model, plan, 1)

    def cancel_at_the_image(event: diffusion_pb2.GenerateResponse) -> None:
        if event.WhichOneof("event") == "image":
            assert job.cancel() is True

    with pytest.raises(Cancelled):
        run_job(job, cancel_at_the_image, preview_every=0, throttle=Throttle(0, 0))


async def test_a_slow_reader_gets_the_newest_progress_and_bounded_previews(diffusion):
    queue = diffusion.servicer.queue
    request = Request(
        model="digits",
        prompt="3",
        steps=200,
        seed=1,
        sampler=diffusion_pb2.SAMPLER_DDPM,
        preview_every_steps=1,
    )
    stream = diffusion.servicer.Generate(request, None)
    assert (await anext(stream)).queued.position == 0
    await anext(stream)  # the worker runs from here on, and this reader stops reading
    await eventually(lambda: queue.running == 0, timeout_s=60)
    rest = [event async for event in stream]
    assert len(of_kind(rest, "preview")) <= PREVIEW_ROUNDS
    assert of_kind(rest, "progress")[-1].step == 200
    assert len(of_kind(rest, "image")) == 1
    assert rest[-1].WhichOneof("event") == "summary"


async def test_events_waiting_for_a_reader_stay_bounded_and_keep_every_image():
    events = JobEvents(asyncio.get_running_loop(), images=3)
    for step in range(1, 10_001):
        progress = diffusion_pb2.Progress(step=step, total_steps=10_000)
        events.push(diffusion_pb2.GenerateResponse(progress=progress))
        for index in range(3):
            preview = diffusion_pb2.Preview(index=index, step=step, png=b"x")
            events.push(diffusion_pb2.GenerateResponse(preview=preview))
    for index in range(3):
        events.push(diffusion_pb2.GenerateResponse(image=diffusion_pb2.Image(index=index)))
    assert events.pending <= 1 + PREVIEW_ROUNDS * 3 + 3
    events.close()
    drained = [event async for event in events.drain()]
    assert [p.step for p in of_kind(drained, "preview")] == [
        step for step in range(10_001 - PREVIEW_ROUNDS, 10_001) for _ in range(3)
    ]
    assert [p.step for p in of_kind(drained, "progress")] == [10_000]
    assert [i.index for i in of_kind(drained, "image")] == [0, 1, 2]
    assert drained[-1].WhichOneof("event") == "image"


async def test_sampling_and_png_encoding_never_run_on_the_event_loop(diffusion, monkeypatch):
    loop_thread = threading.get_ident()
    threads: set[int] = set()
    encode_png = runner.encode_png

    def recording_encode(pixels):
        threads.add(threading.get_ident())
        return encode_png(pixels)

    model = diffusion.servicer.models["digits"]
    start = model.start

    def recording_start(plan):
        threads.add(threading.get_ident())
        return start(plan)

    monkeypatch.setattr(runner, "encode_png", recording_encode)
    monkeypatch.setattr(model, "start", recording_start)
    request = Request(model="digits", prompt="1", steps=4, num_images=2, preview_every_steps=1)
    responses = [event async for event in diffusion.servicer.Generate(request, None)]
    assert of_kind(responses, "preview") and of_kind(responses, "image")
    assert threads and loop_thread not in threads
