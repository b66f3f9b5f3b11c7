"""POST /v1/images/generations on the diffusion service's Generate stream.

OpenAI's request becomes one diffusion job: `n` -> num_images, `size` ("WxH") -> width
and height, and aimesh's extensions `seed` (image k uses seed + k), `steps` and
`conditioning` (terrain's difficulty) pass through. The diffusion service validates the
rest (the digits model's prompt is the digit to draw: 0-9 or its English word; terrain
takes no prompt) and its field paths come back in OpenAI's words. Images are PNGs, only
as `b64_json` (there is no store to serve a `url` from); progress and preview events
are dropped. A client that goes away cancels the stream, and with it the job.
"""

from __future__ import annotations

import base64
import time

import grpc
from fastapi.responses import JSONResponse

from aimesh.diffusion.v1 import diffusion_pb2, diffusion_pb2_grpc
from mesh import caller, request_id
from services.gateway.errors import ApiError, from_rpc
from services.gateway.keys import Principal
from services.gateway.openai_types import ImageRequest
from services.gateway.responses import Exchange, Guarded
from services.gateway.shared import Shared

DIFFUSION = diffusion_pb2.DESCRIPTOR.services_by_name["DiffusionService"]
ROUTE = "/v1/images/generations"
# The diffusion service's field paths in OpenAI's words.
PARAMS = {
    "model": "model",
    "prompt": "prompt",
    "num_images": "n",
    "width": "size",
    "height": "size",
    "seed": "seed",
    "steps": "steps",
    "conditioning": "conditioning",
}


def generate_request(body: ImageRequest) -> diffusion_pb2.GenerateRequest:
    request = diffusion_pb2.GenerateRequest(
        request_id=request_id.current(),
        model=body.model,
        prompt=body.prompt,
        num_images=body.n,
        conditioning=body.conditioning or {},
    )
    size = body.dimensions()
    if size is not None:
        request.width, request.height = size
    if body.seed is not None:
        request.seed = body.seed
    if body.steps is not None:
        request.steps = body.steps
    return request


class Images:
    def __init__(self, stub: diffusion_pb2_grpc.DiffusionServiceStub, shared: Shared) -> None:
        self.stub = stub
        self.shared = shared

    def generate(self, body: ImageRequest, principal: Principal) -> Guarded:
        body.refuse_unsupported()
        self.shared.catalog.require("image", body.model)
        request = generate_request(body)

        async def work(exchange: Exchange) -> None:
            # Images cost no tokens: only requests_per_minute applies.
            async with self.shared.admitted(principal, ROUTE, model=body.model) as charge:
                images = await self._images(request, principal)
                charge.images = len(images)
            data = [{"b64_json": base64.b64encode(image.png).decode()} for image in images]
            await exchange.whole(JSONResponse({"created": int(time.time()), "data": data}))

        return Guarded(work, route=ROUTE, send_timeout_s=self.shared.send_timeout_s)

    async def _images(
        self, request: diffusion_pb2.GenerateRequest, principal: Principal
    ) -> list[diffusion_pb2.Image]:
        call = self.stub.Generate(request, metadata=((caller.METADATA_KEY, principal.tenant),))
        images: dict[int, diffusion_pb2.Image] = {}
        try:
            async for event in call:
                if event.HasField("image"):
                    images[event.image.index] = event.image
        except grpc.aio.AioRpcError as error:
            raise from_rpc(error, PARAMS) from None
        finally:
            call.cancel()  # a no-op once the call ended; else the job stops now
        if len(images) != request.num_images:
            raise ApiError(
                502, "the diffusion stream ended without all its images", type="server_error"
            )
        return [images[index] for index in sorted(images)]
