"""mesh.triton against the real server: the caller's budget bounds the call, and Triton's
answers come back through the mesh's error table."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from tritonclient.grpc import aio as triton_aio
from tritonclient.utils import InferenceServerException

from loadtest.triton_server import ADMIN_HEADER
from mesh import deadline
from mesh.failures import NotReady
from mesh.triton import TritonModel, TritonSettings

pytestmark = pytest.mark.system

IDS = np.array([[101, 7592, 2088, 102]], dtype=np.int64)
INPUTS = {"input_ids": IDS, "attention_mask": np.ones_like(IDS)}

MODEL = "sentence_embedding"


def model(triton, name: str = MODEL) -> TritonModel:
    return TritonModel(TritonSettings(url=triton.url, model=name))


async def test_infer_returns_the_named_outputs(triton):
    embedding = model(triton)
    try:
        assert await embedding.ready()
        outputs = await embedding.infer(INPUTS, ["sentence_embedding"])
    finally:
        await embedding.close()
    assert outputs["sentence_embedding"].shape == (1, 384)
    assert np.isfinite(outputs["sentence_embedding"]).all()


async def test_a_spent_budget_is_deadline_exceeded_without_calling(triton):
    embedding = model(triton)
    try:
        with deadline.budget(0.0), pytest.raises(grpc.aio.AioRpcError) as late:
            await embedding.infer(INPUTS, ["sentence_embedding"])
    finally:
        await embedding.close()
    assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


async def test_an_unknown_model_is_not_ready(triton):
    missing = model(triton, "no_such_model")
    try:
        assert not await missing.ready()
        with pytest.raises(NotReady, match="no_such_model"):
            await missing.infer(INPUTS, ["sentence_embedding"])
    finally:
        await missing.close()


async def test_a_request_triton_refuses_is_our_internal_error(triton):
    embedding = model(triton)
    try:
        with pytest.raises(RuntimeError, match="INVALID_ARGUMENT"):
            await embedding.infer({"ids": IDS}, ["sentence_embedding"])
    finally:
        await embedding.close()


async def test_triton_admin_protocols_answer_only_its_admin_key(triton):
    """Statistics, model configs, the repository (load/unload), shared memory, trace and log
    settings: refused without the server's key, while health, metadata and inference, what
    the mesh calls, stay open (the tests above)."""
    admin = {ADMIN_HEADER: triton.admin_key}
    async with triton_aio.InferenceServerClient(triton.url) as client:
        calls = {
            "statistics": lambda headers: client.get_inference_statistics(headers=headers),
            "config": lambda headers: client.get_model_config(MODEL, headers=headers),
            "repository": lambda headers: client.get_model_repository_index(headers=headers),
        }
        for name, call in calls.items():
            with pytest.raises(InferenceServerException, match=r"restricted|header"):
                await call(None)
            assert await call(admin), name
        assert await client.is_model_ready(MODEL)
