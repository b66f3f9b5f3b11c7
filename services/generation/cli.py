"""`aimesh generate`: stream a completion from the running mesh to the terminal."""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer
from google.protobuf import json_format

from aimesh.llm.v1 import generation_pb2, generation_pb2_grpc, sampling_pb2
from mesh.client import create_channel
from mesh.commands import run_command
from mesh.config import MeshSettings
from mesh.timing import timing_ms
from services.generation import SPEC

# From the generated code, not the servicer: a command must not import the engine.
GENERATION = generation_pb2.DESCRIPTOR.services_by_name["GenerationService"]


async def _generate(request, chat: bool, as_json: bool) -> dict:
    settings = MeshSettings()
    target = settings.target_of(SPEC.name, SPEC.default_port)
    text = ""
    complete = None
    async with create_channel(target, settings, services=[GENERATION]) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        call = stub.Chat(request) if chat else stub.Generate(request)
        async for message in call:
            if message.HasField("chunk"):
                text += message.chunk.text
                if not as_json:
                    sys.stdout.write(message.chunk.text)
                    sys.stdout.flush()
            else:
                complete = message.complete
    return {
        "text": text,
        "finish_reason": sampling_pb2.FinishReason.Name(complete.finish_reason),
        "usage": json_format.MessageToDict(complete.usage, preserving_proto_field_name=True),
        "timing": timing_ms(complete.timing),
        "model": complete.model,
    }


def generate(
    prompt: Annotated[str, typer.Argument(help="the prompt, or the user message with --chat")],
    chat: Annotated[bool, typer.Option(help="apply the model's chat template")] = False,
    max_new_tokens: Annotated[int | None, typer.Option(help="default: the server's")] = None,
    temperature: Annotated[float, typer.Option(help="0 = greedy")] = 0.0,
    seed: Annotated[int | None, typer.Option(help="makes sampling reproducible")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="one JSON object at the end")] = False,
    timeout: Annotated[float, typer.Option(help="seconds for the whole request")] = 120.0,
) -> None:
    """Generate text through the mesh: tokenizer -> prefill -> decode -> the router's text."""
    # None leaves a field unset: the server's default.
    sampling = sampling_pb2.SamplingParameters(temperature=temperature, seed=seed)
    stopping = sampling_pb2.StoppingCriteria(max_new_tokens=max_new_tokens)
    if chat:
        request = generation_pb2.ChatRequest(
            messages=[{"role": "user", "content": prompt}], sampling=sampling, stopping=stopping
        )
    else:
        request = generation_pb2.GenerateRequest(
            prompt=prompt, sampling=sampling, stopping=stopping
        )

    result, trace_id = run_command(
        "generate", lambda: _generate(request, chat, as_json), timeout_s=timeout
    )
    result["trace_id"] = trace_id
    if as_json:
        typer.echo(json.dumps(result))
    else:
        usage = result["usage"]
        typer.echo(
            f"\n[{result['finish_reason']}, {usage.get('prompt_tokens', 0)} prompt + "
            f"{usage.get('completion_tokens', 0)} completion tokens, "
            f"{result['timing']['total']:.0f} ms, trace {result['trace_id']}]",
            err=True,
        )
