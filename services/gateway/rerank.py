"""POST /v1/rerank on the rerank service's Rerank, in the shape Cohere, Jina and vLLM
share (what LangChain's and LlamaIndex's rerankers send).

Every result carries `index` (into the request's documents) and `relevance_score` in
[0, 1], best first, with `document.text` unless `return_documents` is false; `usage`
counts the tokens of every (query, document) pair, as Jina and vLLM do. The rerank
service validates the texts (its field paths are this API's own) and cuts pairs longer
than its model, as the peers do.
"""

from __future__ import annotations

import grpc
from fastapi.responses import JSONResponse

from aimesh.rerank.v1 import rerank_pb2, rerank_pb2_grpc
from mesh import caller, request_id
from services.gateway.errors import from_rpc
from services.gateway.keys import Principal
from services.gateway.openai_types import RerankRequest
from services.gateway.responses import Exchange, Guarded
from services.gateway.shared import Shared, prompt_estimate

RERANK = rerank_pb2.DESCRIPTOR.services_by_name["RerankService"]
ROUTE = "/v1/rerank"
# The rerank service's field paths are this API's own (`documents[3].text`).
PARAMS: dict[str, str] = {}


class Rerank:
    def __init__(self, stub: rerank_pb2_grpc.RerankServiceStub, shared: Shared) -> None:
        self.stub = stub
        self.shared = shared

    def rerank(self, body: RerankRequest, principal: Principal) -> Guarded:
        body.refuse_unsupported()
        self.shared.catalog.require("rerank", body.model)
        texts = body.texts()
        request = rerank_pb2.RerankRequest(
            request_id=request_id.current(),
            query=body.query,
            documents=[rerank_pb2.Document(text=text) for text in texts],
            top_n=body.top_n or 0,
            truncate=True,
        )
        # Each document is read beside the query.
        estimate = prompt_estimate(sum(map(len, texts)) + len(texts) * len(body.query))

        async def work(exchange: Exchange) -> None:
            admitted = self.shared.admitted(principal, ROUTE, model=body.model, tokens=estimate)
            async with admitted as charge:
                response = await self._call(request, principal)
                used = charge.prompt_tokens = response.usage.prompt_tokens
            results = []
            for result in response.results:
                entry: dict[str, object] = {"index": result.index, "relevance_score": result.score}
                if body.return_documents:
                    entry["document"] = {"text": texts[result.index]}
                results.append(entry)
            answer = {
                "id": f"rerank-{request.request_id}",
                "model": response.model,
                "results": results,
                "usage": {"prompt_tokens": used, "total_tokens": used},
            }
            await exchange.whole(JSONResponse(answer))

        return Guarded(work, route=ROUTE, send_timeout_s=self.shared.send_timeout_s)

    async def _call(
        self, request: rerank_pb2.RerankRequest, principal: Principal
    ) -> rerank_pb2.RerankResponse:
        try:
            return await self.stub.Rerank(
                request, metadata=((caller.METADATA_KEY, principal.tenant),)
            )
        except grpc.aio.AioRpcError as error:
            raise from_rpc(error, PARAMS) from None
