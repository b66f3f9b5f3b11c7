"""LLM test fixtures: the converted model, transformers as the reference, and a whole LLM
mesh (tokenizer, prefill, two decode replicas, generation) as separate processes."""

from __future__ import annotations

import re
import urllib.request
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch

from aimesh.llm.v1 import (
    decode_pb2,
    decode_pb2_grpc,
    generation_pb2,
    generation_pb2_grpc,
    prefill_pb2_grpc,
    sampling_pb2,
)
from mesh.client import create_channel
from mesh.config import MeshSettings
from mesh.ledger import MemoryStore
from mesh.metering import Meter, TenantsFile
from services.generation.servicer import GENERATION
from services.llm.artifacts import resolve_model
from tests.conftest import free_port, subprocess_env
from tests.harness import ServiceProcesses

MAX_SEQ_LEN = 512
MAX_BATCH = 8


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """The embedded model, converted once per machine into the default cache."""
    return resolve_model(None, MeshSettings().cache_dir)


@pytest.fixture(scope="session")
def reference(model_dir: Path):
    """transformers' own model and tokenizer: the ground truth for every output."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="session")
def bfloat16_reference(model_dir: Path, reference):
    """transformers in bfloat16, the ground truth for the served bfloat16 model."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    return model, reference[1]


def greedy_reference(reference, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers greedy generation, cut at (and without) the end-of-sequence token."""
    model, tokenizer = reference
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt_ids]),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.eos_token_id,
        )[0, len(prompt_ids) :].tolist()
    eos = tokenizer.eos_token_id
    return out[: out.index(eos)] if eos in out else out


@dataclass
class LlmMesh:
    ports: dict[str, int]
    decode_ports: list[int]
    processes: ServiceProcesses

    @property
    def env(self) -> dict[str, str]:
        """The environment its processes run with: for a client of this mesh too."""
        return self.processes.env

    @property
    def logs(self) -> Path:
        return self.processes.logs

    def target(self, name: str) -> str:
        return f"127.0.0.1:{self.ports[name]}"

    async def start(self, label: str, service: str, port: int, **env: str) -> None:
        await self.processes.start(label, service, port, **env)

    def metrics_url(self, name: str) -> str:
        """Decode replicas expose metrics on their gRPC port + 1000 (the default)."""
        if name.startswith("decode-"):
            return f"http://127.0.0.1:{self.decode_ports[int(name[-1])] + 1000}/metrics"
        return f"http://127.0.0.1:{self.ports[name + '_metrics']}/metrics"

    def stub(self) -> tuple[generation_pb2_grpc.GenerationServiceStub, object]:
        channel = create_channel(self.target("generation"), MeshSettings(), services=[GENERATION])
        return generation_pb2_grpc.GenerationServiceStub(channel), channel


def unlimited_meter() -> Meter:
    """A meter with no tenant limited and its ledger in memory: for a router in a test."""
    return Meter(MemoryStore(), TenantsFile(None))


@contextmanager
def running_llm_mesh(
    root: Path,
    dtype: str = "float32",
    engine: str = "torch",
    prefill_engine: str = "torch",
    extra_config: str = "",
    llm_config: str = "",
) -> Iterator[LlmMesh]:
    """Five processes, as `aimesh up` runs them: decode on `engine`, prefill on
    `prefill_engine`, torch in `dtype`. Pinned, not "auto": auto is llama.cpp decode on a
    CPU, and bfloat16 on a CPU with AVX-512 BF16, and the torch tests compare output with
    transformers float32 bit for bit. `extra_config` is TOML appended to the mesh's config
    (tables of its own: it comes last); `llm_config`, keys added to [engines.llm]."""
    ports = {name: free_port() for name in ("tokenizer", "prefill", "generation")}
    ports["tokenizer_metrics"] = free_port()
    ports["prefill_metrics"] = free_port()
    ports["generation_metrics"] = free_port()
    decode_ports = [free_port(), free_port()]
    decode_targets = ", ".join(f'"127.0.0.1:{port}"' for port in decode_ports)
    config = root / "aimesh.toml"
    config.write_text(
        f"[engines.llm]\nmax_seq_len = {MAX_SEQ_LEN}\nmax_batch_size = {MAX_BATCH}\n"
        f'engine = "{engine}"\nprefill_engine = "{prefill_engine}"\ndtype = "{dtype}"\n'
        f"{llm_config}"
        f"[services.tokenizer]\nport = {ports['tokenizer']}\n"
        f"metrics_port = {ports['tokenizer_metrics']}\n"
        f"[services.prefill]\nport = {ports['prefill']}\n"
        f"metrics_port = {ports['prefill_metrics']}\n"
        f"[services.generation]\nport = {ports['generation']}\n"
        f"metrics_port = {ports['generation_metrics']}\n"
        f'prefill = ["127.0.0.1:{ports["prefill"]}"]\n'
        f"decode = [{decode_targets}]\n"
        "[services.generation.dependencies]\n"
        f'tokenizer = "127.0.0.1:{ports["tokenizer"]}"\n' + extra_config
    )
    processes = ServiceProcesses(
        root, subprocess_env(AIMESH_CONFIG=str(config), OTEL_TRACES_EXPORTER="none")
    )
    try:
        processes.start_all(
            [
                ("tokenizer", "tokenizer", ports["tokenizer"], {}),
                ("prefill", "prefill", ports["prefill"], {}),
                ("decode-0", "decode", decode_ports[0], {}),
                ("decode-1", "decode", decode_ports[1], {}),
                ("generation", "generation", ports["generation"], {}),
            ]
        )
        yield LlmMesh(ports, decode_ports, processes)
    finally:
        processes.close()


@pytest.fixture(scope="module")
def llm_mesh(tmp_path_factory, model_dir) -> Iterator[LlmMesh]:
    """The LLM mesh in float32, started once per test module."""
    with running_llm_mesh(tmp_path_factory.mktemp("llm-mesh")) as mesh:
        yield mesh


@asynccontextmanager
async def prefill_and_decode(
    prefill_target: str, decode_target: str
) -> AsyncIterator[tuple[prefill_pb2_grpc.PrefillServiceStub, decode_pb2_grpc.DecodeServiceStub]]:
    """Stubs straight to one prefill and one decode, past the router: for the KV handoff."""
    settings = MeshSettings()
    async with (
        create_channel(prefill_target, settings) as prefill_channel,
        create_channel(decode_target, settings) as decode_channel,
    ):
        yield (
            prefill_pb2_grpc.PrefillServiceStub(prefill_channel),
            decode_pb2_grpc.DecodeServiceStub(decode_channel),
        )


async def decode_refusal(
    decode: decode_pb2_grpc.DecodeServiceStub,
    handle,
    prompt_ids: list[int],
    first_token_id: int,
    max_new_tokens: int = 8,
) -> grpc.aio.AioRpcError:
    """The error a Decode of `handle` ends with; the test fails if it streams to the end."""
    call = decode.Decode(
        decode_pb2.DecodeRequest(
            kv_handle=handle,
            prompt_token_ids=prompt_ids,
            first_token_id=first_token_id,
            max_new_tokens=max_new_tokens,
        ),
        timeout=30,
    )
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        async for _ in call:
            pass
    return caught.value


def metric_at(url: str, name: str) -> float:
    """One unlabelled sample from a service's /metrics."""
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    match = re.search(rf"^{name} ([0-9.e+-]+)$", text, re.MULTILINE)
    assert match, f"{name} not exposed at {url}"
    return float(match.group(1))


def stopping(max_new_tokens: int, **extra) -> sampling_pb2.StoppingCriteria:
    return sampling_pb2.StoppingCriteria(max_new_tokens=max_new_tokens, **extra)


async def collected(
    messages: AsyncIterator[generation_pb2.GenerateResponse],
) -> tuple[list[int], str, generation_pb2.GenerationComplete]:
    """A Generate stream, collected: token ids, text, and the final message."""
    ids: list[int] = []
    text = ""
    complete = None
    async for message in messages:
        if message.HasField("chunk"):
            ids += message.chunk.token_ids
            text += message.chunk.text
        else:
            complete = message.complete
    return ids, text, complete


async def generate(stub, **request) -> tuple[list[int], str, generation_pb2.GenerationComplete]:
    """One Generate call, collected."""
    return await collected(stub.Generate(generation_pb2.GenerateRequest(**request), timeout=120))


@pytest.fixture
def prompts() -> Iterator[list[str]]:
    yield [
        "The capital of France is",
        "def fibonacci(n):",
        "Once upon a time, in a land far away,",
        "List three colors:",
        "The quick brown fox",
        "In Python, a dictionary is",
        "1, 2, 3, 4,",
        "Water boils at",
    ]
