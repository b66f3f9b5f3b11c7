"""A real out-of-memory error fails its job alone and the worker keeps serving.

The worker runs as a real `aimesh serve diffusion` process; once it is ready its address
space is capped (RLIMIT_AS, set from outside with prlimit) a little above what it uses,
so a 2048x2048 x 16 terrain batch really cannot be allocated while small jobs still can.
The job's memory estimate passes admission (the default budget is half the free RAM):
this is the estimate being wrong, the case the estimate cannot prevent.
"""

from __future__ import annotations

import resource

import grpc
import pytest

from aimesh.diffusion.v1 import diffusion_pb2, diffusion_pb2_grpc
from mesh import errors
from tests.services.diffusion.conftest import events, of_kind

pytestmark = pytest.mark.service

HEADROOM = 96 * 2**20


def address_space_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        (line,) = [line for line in status if line.startswith("VmSize:")]
    return int(line.split()[1]) * 1024


@pytest.mark.system  # ~9 s of a process under a memory limit: in the full run, not make test-fast
async def test_an_allocation_failure_fails_one_job_and_the_worker_serves_on(serve_process):
    worker = await serve_process("diffusion")
    limit = address_space_bytes(worker.pid) + HEADROOM
    resource.prlimit(worker.pid, resource.RLIMIT_AS, (limit, limit))
    huge = diffusion_pb2.GenerateRequest(model="terrain", width=2048, height=2048, num_images=16)
    async with grpc.aio.insecure_channel(worker.target) as channel:
        stub = diffusion_pb2_grpc.DiffusionServiceStub(channel)
        for _ in range(2):  # and again: the first failure freed what it took
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await events(stub.Generate(huge))
            assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert errors.error_info(caught.value).reason == "OUT_OF_MEMORY"
            assert "ran out of memory" in caught.value.details()
            for small in (
                diffusion_pb2.GenerateRequest(model="digits", prompt="9", num_images=4),
                diffusion_pb2.GenerateRequest(model="terrain"),
            ):
                assert of_kind(await events(stub.Generate(small)), "summary")
    assert worker.returncode is None
