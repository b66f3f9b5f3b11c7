"""Properties over arbitrary requests through the real servicer and engines on a loopback
server: no input makes the service fail otherwise than INVALID_ARGUMENT naming fields
(never INTERNAL or UNKNOWN), and no caller leaving at any point keeps a slot."""

from __future__ import annotations

import grpc
import pytest
import pytest_asyncio
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from aimesh.diffusion.v1 import diffusion_pb2
from mesh.errors import field_violations
from tests.conftest import eventually
from tests.services.diffusion.conftest import events

pytestmark = [pytest.mark.service, pytest.mark.asyncio(loop_scope="module")]

Request = diffusion_pb2.GenerateRequest
INT32_EDGES = [-(2**31), -1, 0, 2**31 - 1]
HUGE = "x" * 300_000

texts = st.one_of(
    st.text(max_size=40),
    st.sampled_from(["", "7", " seven ", "²", "٣", "\x00", "difficulty", HUGE]),
)
floats = st.floats(allow_nan=True, allow_infinity=True, allow_subnormal=True)


def optional(values: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(st.none(), values)


# Per field: (a value valid for digits, for terrain, anything). A request is valid but for
# a few fields drawn from "anything", so the engines run as often as validation refuses.
FIELDS = {
    "model": (st.just("digits"), st.just("terrain"), texts),
    "prompt": (st.sampled_from(["", "7", " seven ", "ZERO"]), st.just(""), texts),
    "request_id": (st.text(max_size=20), st.text(max_size=20), st.just(HUGE)),
    "sampler": (st.sampled_from([0, 1, 2]), st.sampled_from([0, 3]), st.integers(-1, 5)),
    "preview_every_steps": (
        st.integers(0, 3),
        st.integers(0, 3),
        st.one_of(st.integers(-2, 3), st.sampled_from(INT32_EDGES)),
    ),
    "conditioning": (
        st.just({}),
        optional(st.integers(1, 100)).map(lambda d: {} if d is None else {"difficulty": d}),
        st.one_of(
            st.dictionaries(st.one_of(st.just("difficulty"), texts), floats, max_size=3),
            st.just({f"k{i}": 1.0 for i in range(100)}),
        ),
    ),
    "size": (
        st.sampled_from([(0, 0), (8, 8)]),
        st.sampled_from([(0, 0), (128, 128)]),
        st.tuples(*[st.sampled_from([0, 8, 64, 128, -128, 2**31 - 1])] * 2),
    ),
    "num_images": (
        optional(st.integers(1, 2)),
        optional(st.just(1)),  # a terrain image is a 128x128 UNet pass: the slow part
        st.sampled_from([*INT32_EDGES, 101]),
    ),
    "steps": (optional(st.integers(1, 3)), optional(st.just(1)), st.sampled_from(INT32_EDGES)),
    "seed": (
        optional(st.integers(0, 2**64 - 3)),
        optional(st.integers(0, 2**64 - 3)),
        st.just(2**64 - 1),
    ),
    "guidance_scale": (optional(st.floats(0, 20, width=32)), st.none(), st.floats(width=32)),
}


@st.composite
def generate_requests(draw: st.DrawFn) -> Request:
    """A small valid job (a few steps, one or two images, the native size) for one of the
    models, with up to two fields set to anything."""
    terrain = draw(st.sampled_from([False, False, True]))  # its jobs take longer
    wild = draw(st.sets(st.sampled_from(sorted(FIELDS)), max_size=2))
    values = {
        name: draw(choices[2] if name in wild else choices[terrain])
        for name, choices in FIELDS.items()
    }
    width, height = values.pop("size")
    conditioning = values.pop("conditioning")
    request = Request(width=width, height=height, conditioning=conditioning)
    for name, value in values.items():
        if value is not None:
            setattr(request, name, value)
    return request


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def diffusion(start_diffusion):
    return await start_diffusion()


@settings(
    max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(request=generate_requests())
# Found before: int() refused what str.isdigit() let through (INTERNAL); a refusal that
# echoed its 300 KB value outgrew the client's metadata limit.
@example(request=Request(model="digits", prompt="²"))
@example(request=Request(model=HUGE))
@example(request=Request(model="terrain", conditioning={HUGE: 1.0}))
async def test_any_generate_request_completes_or_gets_field_violations(diffusion, request):
    """Small jobs here cannot outgrow the memory budget, and one call at a time cannot
    fill the queue: every request is either served or refused as invalid."""
    queue = diffusion.servicer.queue
    try:
        responses = await events(diffusion.stub.Generate(request, timeout=120))
    except grpc.aio.AioRpcError as error:
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
        assert field_violations(error)
    else:
        assert responses[-1].WhichOneof("event") == "summary"
    await eventually(lambda: queue.running == queue.waiting == 0)


@settings(
    max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(job_id=texts)
async def test_no_cancel_request_breaks_the_service(diffusion, job_id):
    try:
        response = await diffusion.stub.Cancel(diffusion_pb2.CancelRequest(job_id=job_id))
    except grpc.aio.AioRpcError as error:
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
        assert [v.field for v in field_violations(error)] == ["job_id"]
    else:
        assert response.cancelled is False


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(read=st.integers(0, 8), previews=st.booleans())
async def test_leaving_after_any_event_frees_the_slot(diffusion, read, previews):
    """The caller goes away after `read` events, wherever that leaves the job."""
    queue = diffusion.servicer.queue
    request = Request(
        model="digits", prompt="4", num_images=2, steps=6, preview_every_steps=int(previews)
    )
    stream = diffusion.servicer.Generate(request, None)
    async for _ in stream:
        read -= 1
        if read < 0:
            break
    await stream.aclose()
    await eventually(lambda: (queue.running, queue.waiting, queue.reserved_bytes) == (0, 0, 0))
