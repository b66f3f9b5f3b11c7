"""Stand-ins for the generation service and the embedder, served by real MeshServers on
loopback: the gateway's HTTP surface is checked against scripted streams, statuses and
cancellations that the real model cannot be made to produce on demand.

The last message (chat) or the prompt (completions) picks the script:
  "refuse:<CODE>"  the call fails at once with that gRPC code (RetryInfo on
                   RESOURCE_EXHAUSTED, a field violation on INVALID_ARGUMENT)
  "quota:<REASON>" the router's refusal of a tenant past a limit (mesh/metering.py), with
                   RetryInfo for RATE_LIMIT_EXCEEDED
  "midstream"      one chunk, then UNAVAILABLE
  "forever"        a chunk every 20 ms until cancelled
  "stall"          nothing until cancelled
  anything else    "Hello, world!" in four chunks (two with max_new_tokens=2), with
                   made-up logprobs when sampling.logprobs asks; each of sampling.n
                   choices so, their chunks interleaved, their ends in reverse order

The fake diffusion draws `num_images` tiny PNGs whose pixel is its seed's low byte, after
a queued and a progress event; a prompt that is not a single digit is refused as the
digits model refuses it (a field violation on `prompt`), "stall" waits until cancelled.
"""

from __future__ import annotations

import asyncio
import io
from collections.abc import AsyncIterator

import grpc
from PIL import Image

from aimesh.common.v1 import common_pb2
from aimesh.diffusion.v1 import diffusion_pb2, diffusion_pb2_grpc
from aimesh.llm.v1 import generation_pb2, generation_pb2_grpc, sampling_pb2
from aimesh.retrieval.v1 import embedder_pb2, embedder_pb2_grpc
from mesh.config import MeshSettings, ServiceSettings
from mesh.errors import abort, status, status_for_failure
from mesh.failures import FieldViolation, InvalidInput, QuotaExceeded
from mesh.info import ModelInfo
from mesh.server import MeshServer

LLM = "fake-llm"
EMBEDDING_MODEL = "fake-embed"
WORDS = ["Hello", ",", " world", "!"]
GENERATION = generation_pb2.DESCRIPTOR.services_by_name["GenerationService"]
EMBEDDER = embedder_pb2.DESCRIPTOR.services_by_name["EmbedderService"]
IMAGE_MODEL = "fake-digits"
DIFFUSION = diffusion_pb2.DESCRIPTOR.services_by_name["DiffusionService"]


def vector(text: str) -> list[float]:
    return [float(len(text)), float(sum(map(ord, text)) % 97), 0.5]


class FakeGeneration(generation_pb2_grpc.GenerationServiceServicer):
    def __init__(self) -> None:
        self.requests: list[object] = []
        self.metadata: list[dict[str, str]] = []
        self.cancelled = 0
        self.running = 0

    async def Chat(self, request, context):
        async for message in self._script(request.messages[-1].content, request, context):
            yield generation_pb2.ChatResponse(**message)

    async def Generate(self, request, context):
        async for message in self._script(request.prompt, request, context):
            yield generation_pb2.GenerateResponse(**message)

    async def _script(self, text: str, request, context) -> AsyncIterator[dict]:
        self.requests.append(request)
        self.metadata.append(dict(context.invocation_metadata()))
        self.running += 1
        try:
            async for message in self._messages(text, request, context):
                yield message
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.running -= 1

    async def _messages(self, text: str, request, context) -> AsyncIterator[dict]:
        if text.startswith("refuse:"):
            code = grpc.StatusCode[text.removeprefix("refuse:")]
            await abort(context, refusal(code))
        if text.startswith("quota:"):
            reason = text.removeprefix("quota:")
            wait_s = 2.5 if reason == "RATE_LIMIT_EXCEEDED" else None
            refused = QuotaExceeded("tenant past a limit", reason=reason, retry_after_s=wait_s)
            await abort(context, status_for_failure(refused))
        if text == "stall":
            await asyncio.Event().wait()
        if text == "forever":
            while True:
                yield {"chunk": generation_pb2.GenerationChunk(text="la ", token_ids=[1])}
                await asyncio.sleep(0.02)
        if text.startswith("call:"):  # the router's tool-call stream, for the tool named
            arguments = ['{"city": ', '"Oslo"}']
            yield {"chunk": generation_pb2.GenerationChunk(
                token_ids=[7],
                tool_calls=[generation_pb2.ToolCallDelta(index=0, id="call_1", name=text[5:])],
            )}  # fmt: skip
            for fragment in arguments:
                delta = generation_pb2.ToolCallDelta(index=0, arguments=fragment)
                yield {"chunk": generation_pb2.GenerationChunk(token_ids=[7], tool_calls=[delta])}
            call = common_pb2.ToolCall(id="call_1", name=text[5:], arguments="".join(arguments))
            yield {"complete": generation_pb2.GenerationComplete(
                finish_reason=sampling_pb2.FINISH_REASON_TOOL_CALLS,
                usage=common_pb2.Usage(prompt_tokens=3, completion_tokens=3, total_tokens=6),
                tool_calls=[call],
            )}  # fmt: skip
            return
        if text == "midstream":
            yield {"chunk": generation_pb2.GenerationChunk(text="partial", token_ids=[1])}
            await abort(context, status(grpc.StatusCode.UNAVAILABLE, "decode died", reason="GONE"))
        limit = (
            request.stopping.max_new_tokens if request.stopping.HasField("max_new_tokens") else 9
        )
        words = WORDS[:limit]
        choices = range(request.sampling.n or 1)
        for word in words:
            for index in choices:
                chunk = generation_pb2.GenerationChunk(text=word, token_ids=[7], index=index)
                if request.sampling.logprobs:
                    chunk.logprobs.append(token_logprob(word, request.sampling.top_logprobs))
                yield {"chunk": chunk}
        reason = (
            sampling_pb2.FINISH_REASON_LENGTH
            if len(words) < len(WORDS)
            else sampling_pb2.FINISH_REASON_EOS
        )
        prompt_tokens = len(text.split())
        for index in reversed(choices):  # out of order: the gateway answers in order
            yield {
                "complete": generation_pb2.GenerationComplete(
                    finish_reason=reason,
                    usage=common_pb2.Usage(
                        prompt_tokens=prompt_tokens,
                        completion_tokens=len(words),
                        total_tokens=prompt_tokens + len(words),
                        # As if every prompt token but the last had been in prefill's cache.
                        cached_tokens=max(prompt_tokens - 1, 0),
                    ),
                    model=LLM,
                    index=index,
                )
            }


def token_logprob(word: str, alternatives: int) -> generation_pb2.TokenLogprob:
    """A word as one token, as likely as its length says, with made-up alternatives."""
    logprob = -0.1 * len(word)
    likely = [
        generation_pb2.TopLogprob(
            token=f"{word}{k}", bytes=f"{word}{k}".encode(), logprob=logprob - k
        )
        for k in range(alternatives)
    ]
    return generation_pb2.TokenLogprob(
        token_id=7, token=word, bytes=word.encode(), logprob=logprob, top_logprobs=likely
    )


def refusal(code: grpc.StatusCode) -> grpc.Status:
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        violation = FieldViolation("stopping.max_new_tokens", "exceeds the context window")
        return status(code, "bad", reason="INVALID_INPUT", violations=[violation])
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return status(code, "busy", reason="QUEUE_FULL", retry_after_s=2.5)
    return status(code, f"secret internals of {code.name}", reason=code.name)


class FakeEmbedder(embedder_pb2_grpc.EmbedderServiceServicer):
    def __init__(self) -> None:
        self.calls = 0

    async def Embed(self, request, context):
        self.calls += 1
        for i, text in enumerate(request.inputs):
            if text == "refuse":
                raise InvalidInput([FieldViolation(f"inputs[{i}]", "must not say refuse")])
        return embedder_pb2.EmbedResponse(
            embeddings=[embedder_pb2.Embedding(values=vector(t)) for t in request.inputs],
            dimensions=3,
            model=EMBEDDING_MODEL,
            usage=common_pb2.Usage(prompt_tokens=len(request.inputs)),
        )


async def serve_fake(name: str, register, servicer, service, model: str) -> MeshServer:
    settings = MeshSettings(services={name: ServiceSettings(metrics_port=0)})
    server = MeshServer(name, settings, port=0, default_max_concurrency=64)
    server.add_service(register, servicer, service)
    server.describe(ModelInfo(name=model))
    await server.start()
    return server


async def fake_generation(servicer: FakeGeneration) -> MeshServer:
    register = generation_pb2_grpc.add_GenerationServiceServicer_to_server
    return await serve_fake("generation", register, servicer, GENERATION, LLM)


async def fake_embedder(servicer: FakeEmbedder) -> MeshServer:
    register = embedder_pb2_grpc.add_EmbedderServiceServicer_to_server
    return await serve_fake("embedder", register, servicer, EMBEDDER, EMBEDDING_MODEL)


def png(seed: int, side: int) -> bytes:
    out = io.BytesIO()
    Image.new("L", (side, side), seed % 256).save(out, format="PNG")
    return out.getvalue()


class FakeDiffusion(diffusion_pb2_grpc.DiffusionServiceServicer):
    def __init__(self) -> None:
        self.requests: list[diffusion_pb2.GenerateRequest] = []
        self.running = 0
        self.cancelled = 0

    async def Generate(self, request, context):
        self.requests.append(request)
        self.running += 1
        try:
            if request.prompt == "stall":
                await asyncio.Event().wait()
            if not (len(request.prompt) == 1 and request.prompt.isdigit()):
                raise InvalidInput([FieldViolation("prompt", "must be a digit 0-9")])
            side = request.width or 8
            if side not in (8, 16) or request.height not in (0, side):
                raise InvalidInput([FieldViolation("width", "sizes: 8x8, 16x16")])
            yield diffusion_pb2.GenerateResponse(queued=diffusion_pb2.Queued(job_id="job-1"))
            yield diffusion_pb2.GenerateResponse(
                progress=diffusion_pb2.Progress(step=1, total_steps=1)
            )
            seed = request.seed if request.HasField("seed") else 1000
            count = request.num_images if request.HasField("num_images") else 1
            for index in reversed(range(count)):  # out of order: the gateway sorts them
                image = diffusion_pb2.Image(
                    index=index, seed=seed + index, png=png(seed + index, side), width=side
                )
                yield diffusion_pb2.GenerateResponse(image=image)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.running -= 1


async def fake_diffusion(servicer: FakeDiffusion) -> MeshServer:
    register = diffusion_pb2_grpc.add_DiffusionServiceServicer_to_server
    return await serve_fake("diffusion", register, servicer, DIFFUSION, IMAGE_MODEL)
