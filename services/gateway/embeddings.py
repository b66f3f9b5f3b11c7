"""POST /v1/embeddings on the embedder's Embed.

The embedder takes at most 32 texts a call (TEI's default client batch); OpenAI allows
far more, so a longer input is sent as several calls at once, and the embedder's
micro-batching joins them again. Vectors come back unit-normalised, as OpenAI's are;
`encoding_format: base64` (the openai SDK's default) is little-endian float32.
"""

from __future__ import annotations

import asyncio
import base64

import grpc
import numpy as np
from fastapi.responses import JSONResponse

from aimesh.retrieval.v1 import embedder_pb2, embedder_pb2_grpc
from mesh import caller
from services.gateway.errors import from_rpc, unsupported
from services.gateway.keys import Principal
from services.gateway.openai_types import EmbeddingRequest
from services.gateway.responses import Exchange, Guarded
from services.gateway.shared import Shared, prompt_estimate

EMBEDDER = embedder_pb2.DESCRIPTOR.services_by_name["EmbedderService"]
ROUTE = "/v1/embeddings"
# EmbedRequest.inputs holds 1 to 32 texts.
BATCH = 32


def _params(offset: int, count: int) -> dict[str, str]:
    """The embedder's `inputs[j]` of one call is the request's `input[offset + j]`."""
    return {"inputs": "input", **{f"inputs[{j}]": f"input[{offset + j}]" for j in range(count)}}


def _encoded(values: list[float], encoding: str) -> list[float] | str:
    if encoding == "base64":
        return base64.b64encode(np.asarray(values, dtype="<f4").tobytes()).decode()
    return values


class Embeddings:
    def __init__(self, stub: embedder_pb2_grpc.EmbedderServiceStub, shared: Shared) -> None:
        self.stub = stub
        self.shared = shared

    def embed(self, body: EmbeddingRequest, principal: Principal) -> Guarded:
        self.shared.catalog.require("embedding", body.model)
        texts = body.texts()
        metadata = ((caller.METADATA_KEY, principal.tenant),)

        async def one(offset: int) -> embedder_pb2.EmbedResponse:
            batch = texts[offset : offset + BATCH]
            try:
                return await self.stub.Embed(
                    embedder_pb2.EmbedRequest(inputs=batch), metadata=metadata
                )
            except grpc.aio.AioRpcError as error:
                raise from_rpc(error, _params(offset, len(batch))) from None

        estimate = prompt_estimate(sum(map(len, texts)))

        async def work(exchange: Exchange) -> None:
            admitted = self.shared.admitted(principal, ROUTE, model=body.model, tokens=estimate)
            async with admitted as charge:
                try:
                    async with asyncio.TaskGroup() as group:
                        calls = [group.create_task(one(o)) for o in range(0, len(texts), BATCH)]
                except ExceptionGroup as failed:
                    raise failed.exceptions[0] from None
                responses = [call.result() for call in calls]
                used = charge.prompt_tokens = sum(r.usage.prompt_tokens for r in responses)
            dimensions = responses[0].dimensions
            if body.dimensions not in (None, dimensions):
                raise unsupported("dimensions", f"this model's vectors have {dimensions}")
            vectors = [list(e.values) for response in responses for e in response.embeddings]
            data = [
                {"object": "embedding", "index": i, "embedding": _encoded(v, body.encoding_format)}
                for i, v in enumerate(vectors)
            ]
            usage = {"prompt_tokens": used, "total_tokens": used}
            answer = {"object": "list", "data": data, "model": responses[0].model, "usage": usage}
            await exchange.whole(JSONResponse(answer))

        return Guarded(work, route=ROUTE, send_timeout_s=self.shared.send_timeout_s)
