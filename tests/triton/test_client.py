"""mesh.triton against the real server: the caller's budget bounds the call, and Triton's
answers come back through the mesh's error table."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from mesh import deadline
from mesh.failures import NotReady
from mesh.triton import TritonModel, TritonSettings

pytestmark = pytest.mark.system

IDS = np.array([[101, 7592, 2088, 102]], dtype=np.int64)
INPUTS = {"input_ids": IDS, "attention_mask": np.ones_like(IDS)}


def model(triton, name: str = "sentence_embedding") -> TritonModel:
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
