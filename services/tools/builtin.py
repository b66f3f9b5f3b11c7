"""The built-in tools: knowledge_search, python_doc, generate_image, calculator."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc

from aimesh.diffusion.v1 import diffusion_pb2, diffusion_pb2_grpc
from aimesh.retrieval.v1 import retrieval_pb2, retrieval_pb2_grpc
from aimesh.tools.v1 import tools_pb2
from mesh.errors import field_violations
from services.shared.calculator import (
    EXPRESSION_PATTERN,
    MAX_EXPRESSION,
    CalculationError,
    calculate,
)
from services.tools.tool import ToolContext, ToolDefinition, ToolError, ToolEvent, ToolOutput

PASSAGE_CHARS = 700  # of each passage's text shown to the model
RETRIEVAL = retrieval_pb2.DESCRIPTOR.services_by_name["RetrievalService"]
DIFFUSION = diffusion_pb2.DESCRIPTOR.services_by_name["DiffusionService"]


def unavailable(what: str, error: grpc.aio.AioRpcError) -> ToolError:
    problems = "; ".join(f"{v.field}: {v.description}" for v in field_violations(error))
    return ToolError(f"{what} failed ({error.code().name}): {problems or error.details()}")


async def search(context: ToolContext, what: str, **request: Any) -> retrieval_pb2.SearchResponse:
    """A search of the knowledge collection; a failure is a ToolError saying `what` failed."""
    retrieval = retrieval_pb2_grpc.RetrievalServiceStub(context.channel("retrieval", RETRIEVAL))
    collection = context.settings.knowledge_collection
    try:
        return await retrieval.Search(retrieval_pb2.SearchRequest(collection=collection, **request))
    except grpc.aio.AioRpcError as error:
        raise unavailable(what, error) from None


async def knowledge_search(
    arguments: dict[str, Any], context: ToolContext
) -> AsyncIterator[ToolEvent]:
    """Hybrid search, reranked by retrieval itself; when rerank is down, retrieval answers
    in its own order with a note, passed on to the model."""
    query = arguments["query"]
    yield tools_pb2.Progress(progress=0, total=1, message="searching the knowledge base")
    found = await search(
        context,
        "knowledge search",
        query=query,
        top_k=int(arguments.get("top_k", 5)),
        mode=retrieval_pb2.SEARCH_MODE_HYBRID,
        rerank=arguments.get("rerank", True),
    )
    passages = [{"id": h.id, "text": h.text, "score": h.score} for h in found.hits]
    if not passages:
        raise ToolError(f"no passage in the knowledge base matches {query!r}")
    text = "\n\n".join(f"[{p['id']}] {p['text'][:PASSAGE_CHARS]}" for p in passages)
    if found.note:
        yield ToolOutput(f"{found.note}\n\n{text}", {"passages": passages, "note": found.note})
    else:
        yield ToolOutput(text, {"passages": passages})


async def python_doc(arguments: dict[str, Any], context: ToolContext) -> AsyncIterator[ToolEvent]:
    name = arguments["name"]
    title = retrieval_pb2.Condition(key="title", keyword=name)
    stdlib = retrieval_pb2.Condition(key="source", keyword="stdlib")
    yield tools_pb2.Progress(progress=0, total=1, message=f"looking up {name}")
    found = await search(
        context,
        "documentation lookup",
        query=name,
        top_k=50,
        filter=retrieval_pb2.Filter(must=[title, stdlib]),
        with_payload=True,
        mode=retrieval_pb2.SEARCH_MODE_DENSE,
    )
    if not found.hits:
        raise ToolError(f"the stdlib has no documented name {name!r}; try knowledge_search")
    parts = sorted(found.hits, key=lambda h: h.payload.fields["part"].number_value)
    text = "\n\n".join(h.text for h in parts)
    yield ToolOutput(text, {"name": name, "passage_ids": [h.id for h in parts], "text": text})


async def generate_image(
    arguments: dict[str, Any], context: ToolContext
) -> AsyncIterator[ToolEvent]:
    model = arguments.get("model", "digits")
    request = diffusion_pb2.GenerateRequest(
        model=model,
        prompt=arguments.get("prompt", ""),
        num_images=int(arguments.get("num_images", 1)),
    )
    if "seed" in arguments:
        request.seed = int(arguments["seed"])
    if "difficulty" in arguments:
        request.conditioning["difficulty"] = float(arguments["difficulty"])
    stub = diffusion_pb2_grpc.DiffusionServiceStub(context.channel("diffusion", DIFFUSION))
    images: list[diffusion_pb2.Image] = []
    job_id = ""
    try:
        async for event in stub.Generate(request):
            kind = event.WhichOneof("event")
            if kind == "queued":
                job_id = event.queued.job_id
                position = event.queued.position
                where = f"queued, position {position}" if position else "running"
                yield tools_pb2.Progress(progress=0, message=f"image job {where}")
            elif kind == "progress":
                step = event.progress
                yield tools_pb2.Progress(
                    progress=step.step,
                    total=step.total_steps,
                    message=f"denoising step {step.step}/{step.total_steps}",
                )
            elif kind == "image":
                images.append(event.image)
    except grpc.aio.AioRpcError as error:
        raise unavailable("image generation", error) from None
    seeds = [image.seed for image in images]
    width, height = images[0].width, images[0].height
    described = f"{len(images)} {model} image(s) of {width}x{height}, seeds {seeds}"
    yield ToolOutput(
        described,
        {
            "job_id": job_id,
            "model": model,
            "seeds": [float(s) for s in seeds],
            "width": width,
            "height": height,
        },
        [(image.png, "image/png") for image in images],
    )


def evaluate(expression: str) -> ToolOutput:
    """The calculator's result. Evaluating and writing out an exact value of thousands of
    digits are CPU work, so it runs in a thread, never on the event loop."""
    try:
        value = calculate(expression)
        as_float = float(value)
    except CalculationError as error:
        raise ToolError(str(error)) from None
    except OverflowError:
        raise ToolError(f"{expression!r} is too large to report") from None
    exact = str(value)
    return ToolOutput(
        f"{expression} = {exact}", {"expression": expression, "value": as_float, "exact": exact}
    )


async def calculator(arguments: dict[str, Any], context: ToolContext) -> AsyncIterator[ToolEvent]:
    yield await asyncio.to_thread(evaluate, arguments["expression"])


def _object(properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    """A closed object schema; every property is required unless `required` names some."""
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
        "additionalProperties": False,
    }


def _array(items: dict[str, Any]) -> dict[str, Any]:
    return {"type": "array", "items": items}


STRING = {"type": "string"}
NUMBER = {"type": "number"}
INTEGER = {"type": "integer"}
PASSAGE = _object({"id": STRING, "text": STRING, "score": NUMBER})
READ_ONLY = tools_pb2.ToolAnnotations(read_only=True, idempotent=True)

BUILTIN = (
    ToolDefinition(
        name="knowledge_search",
        title="Search the knowledge base",
        description=(
            "Searches the Python standard library documentation (hybrid dense + keyword "
            "search, then rerank) and returns the best passages with their ids. Use it for "
            "any question about Python; cite the ids of the passages you use."
        ),
        input_schema=_object(
            {
                "query": {"type": "string", "minLength": 1, "maxLength": 1000},
                "top_k": {"type": "integer", "minimum": 1, "maximum": 20, "default": 5},
                "rerank": {"type": "boolean", "default": True},
            },
            ["query"],
        ),
        output_schema=_object({"passages": _array(PASSAGE), "note": STRING}, ["passages"]),
        annotations=READ_ONLY,
        body=knowledge_search,
        timeout_s=20,
        idle_timeout_s=10,
    ),
    ToolDefinition(
        name="python_doc",
        title="Python documentation for one name",
        description=(
            "Returns the full documentation of one exact standard-library name, such as "
            "'copy.deepcopy' or 'json.loads'. Use knowledge_search when the name is unknown."
        ),
        input_schema=_object(
            {"name": {"type": "string", "pattern": r"^[A-Za-z_][A-Za-z0-9_.]*$", "maxLength": 200}},
        ),
        output_schema=_object({"name": STRING, "passage_ids": _array(STRING), "text": STRING}),
        annotations=READ_ONLY,
        body=python_doc,
        timeout_s=10,
        idle_timeout_s=10,
    ),
    ToolDefinition(
        name="generate_image",
        title="Generate an image",
        description=(
            "Draws a handwritten digit (model 'digits', prompt a digit 0-9) or a terrain "
            "heightfield (model 'terrain', difficulty 1-100) with the diffusion service."
        ),
        input_schema=_object(
            {
                "model": {"enum": ["digits", "terrain"], "default": "digits"},
                "prompt": {"type": "string", "maxLength": 64},
                "difficulty": {"type": "integer", "minimum": 1, "maximum": 100},
                "seed": {"type": "integer", "minimum": 0, "maximum": 2**53},
                "num_images": {"type": "integer", "minimum": 1, "maximum": 4, "default": 1},
            },
            [],
        ),
        output_schema=_object(
            {
                "job_id": STRING,
                "model": STRING,
                "seeds": _array(NUMBER),
                "width": INTEGER,
                "height": INTEGER,
            }
        ),
        annotations=tools_pb2.ToolAnnotations(read_only=True, idempotent=False),
        body=generate_image,
        timeout_s=120,
        idle_timeout_s=30,
    ),
    ToolDefinition(
        name="calculator",
        title="Calculator",
        description=(
            "Evaluates arithmetic exactly: + - * / // % ^ (power), parentheses, sqrt, log, "
            "exp, sin, cos, tan, abs, round, floor, ceil, min, max, pi, e. No variables or "
            "code. Use it for any computation instead of doing it in your head."
        ),
        input_schema=_object(
            {
                "expression": {
                    "type": "string",
                    "minLength": 1,
                    "maxLength": MAX_EXPRESSION,
                    "pattern": EXPRESSION_PATTERN,
                }
            }
        ),
        output_schema=_object({"expression": STRING, "value": NUMBER, "exact": STRING}),
        annotations=READ_ONLY,
        body=calculator,
        timeout_s=5,
        idle_timeout_s=5,
    ),
)
