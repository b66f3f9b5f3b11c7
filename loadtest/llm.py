"""LLM serving benchmark: in-process transformers vs the aimesh LLM mesh, one run.

(a) transformers `generate` in this process (fp32, greedy); (b) the mesh with one
stream at a time; (c) the mesh with 1, 4, 8 and 16 clients in a closed loop (aggregate
throughput at that concurrency), then under open-loop Poisson arrivals at the rate that
keeps that many in flight (Little's law on the closed-loop latency), which is what
latency under load looks like when arrivals do not wait for answers. The mesh is
tokenizer, prefill, decode and the generation router, each its own process over loopback
gRPC, exactly as `aimesh up` runs them. Also measured: KV transfer throughput of
KvCache.Pull for long prompts.

    python -m loadtest.llm --out docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import torch

from aimesh.llm.v1 import (
    generation_pb2,
    generation_pb2_grpc,
    kv_cache_pb2,
    kv_cache_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
    sampling_pb2,
)
from loadtest.mesh_overhead import write
from mesh.config import MeshSettings
from mesh.health import wait_until_serving
from services.llm.artifacts import resolve_model

BEGIN, END = "<!-- llm:begin -->", "<!-- llm:end -->"
PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea:",
    "def quicksort(items):",
    "Explain what a hash table is in one paragraph.",
    "List five animals that live in the ocean:",
    "The history of the printing press begins",
    "In Python, the difference between a list and a tuple is",
    "Once upon a time, in a quiet village,",
]
NEW_TOKENS = 64
PORTS = {"tokenizer": 50761, "prefill": 50762, "decode": 50763, "generation": 50760}


@dataclass
class Run:
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)
    tokens: int = 0
    seconds: float = 0.0
    in_flight: list[int] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def arrived(self, count: int, started: float, last: float | None) -> float:
        """`count` tokens came in one message now: the first message is the TTFT, a later
        one's gap is spread over its tokens. Returns now, the next call's `last`."""
        now = time.perf_counter()
        if last is None:
            self.ttft.append(now - started)
        else:
            self.itl.extend([(now - last) / count] * count)
        self.tokens += count
        return now


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


# ---- (a) in-process transformers ----


def in_process(model_dir: Path) -> tuple[Run, float]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    run = Run()
    prefill_times = []
    with torch.inference_mode():
        model.generate(**tokenizer("warm up", return_tensors="pt"), max_new_tokens=4)
        for prompt in PROMPTS:
            inputs = tokenizer(prompt, return_tensors="pt")
            started = time.perf_counter()
            model(**inputs)
            prefill_times.append(time.perf_counter() - started)
            started = time.perf_counter()
            out = model.generate(
                **inputs,
                max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS,
                do_sample=False,
                pad_token_id=tokenizer.eos_token_id,
            )
            elapsed = time.perf_counter() - started
            generated = out.shape[1] - inputs["input_ids"].shape[1]
            run.e2e.append(elapsed)
            run.tokens += generated
            run.seconds += elapsed
            run.ttft.append(prefill_times[-1])
            run.itl.append((elapsed - prefill_times[-1]) / max(generated - 1, 1))
    return run, statistics.median(prefill_times)


# ---- the mesh ----


def start_mesh(root: Path) -> list[subprocess.Popen]:
    config = root / "aimesh.toml"
    config.write_text(
        "[engines.llm]\nmax_batch_size = 16\nmax_seq_len = 2048\n"
        + "".join(
            f"[services.{name}]\nport = {port}\nmetrics_port = 0\nmax_concurrency = 64\n"
            for name, port in PORTS.items()
        )
    )
    env = {
        **os.environ,
        "AIMESH_CONFIG": str(config),
        "GRPC_VERBOSITY": "ERROR",
        "AIMESH_LOG_LEVEL": "WARNING",
    }
    aimesh = Path(sys.executable).parent / "aimesh"
    return [
        subprocess.Popen(
            [str(aimesh), "serve", name], env=env, stderr=(root / f"{name}.log").open("w")
        )
        for name in PORTS
    ]


async def wait_mesh() -> None:
    for name, port in PORTS.items():
        if not await wait_until_serving(f"127.0.0.1:{port}", name, timeout_s=300):
            raise SystemExit(f"{name} did not start")


async def one_request(stub, prompt: str, run: Run, in_flight: list[int]) -> None:
    started = time.perf_counter()
    last = None
    in_flight[0] += 1
    run.in_flight.append(in_flight[0])
    try:
        async for message in stub.Generate(
            generation_pb2.GenerateRequest(
                prompt=prompt,
                stopping=sampling_pb2.StoppingCriteria(max_new_tokens=NEW_TOKENS, ignore_eos=True),
            ),
            timeout=300,
        ):
            if message.HasField("chunk") and message.chunk.token_ids:
                last = run.arrived(len(message.chunk.token_ids), started, last)
    finally:
        in_flight[0] -= 1
    run.e2e.append(time.perf_counter() - started)


async def single_stream(stub) -> Run:
    run = Run()
    started = time.perf_counter()
    for prompt in PROMPTS:
        await one_request(stub, prompt, run, [0])
    run.seconds = time.perf_counter() - started
    return run


async def closed_loop(stub, clients: int, requests_each: int) -> Run:
    run = Run()
    in_flight = [0]

    async def client(index: int) -> None:
        for i in range(requests_each):
            await one_request(stub, PROMPTS[(index + i) % len(PROMPTS)], run, in_flight)

    started = time.perf_counter()
    await asyncio.gather(*(client(i) for i in range(clients)))
    run.seconds = time.perf_counter() - started
    return run


async def open_loop(stub, target_in_flight: int, latency: float, requests: int) -> Run:
    """Poisson arrivals at rate target/latency: on average `target` in flight if requests
    take `latency` (measured closed-loop at that concurrency)."""
    rate = target_in_flight / latency
    rng = random.Random(target_in_flight)
    run = Run()
    in_flight = [0]
    tasks = []
    started = time.perf_counter()
    for i in range(requests):
        tasks.append(
            asyncio.create_task(one_request(stub, PROMPTS[i % len(PROMPTS)], run, in_flight))
        )
        await asyncio.sleep(rng.expovariate(rate))
    await asyncio.gather(*tasks)
    run.seconds = time.perf_counter() - started
    return run


async def kv_transfer(tokenizer_ids: list[int]) -> list[tuple[int, float, float]]:
    """(prompt tokens, MB, MB/s) of KvCache.Pull from the prefill worker, median of 5."""
    results = []
    target = f"127.0.0.1:{PORTS['prefill']}"
    async with grpc.aio.insecure_channel(
        target, options=[("grpc.max_receive_message_length", 32 * 1024 * 1024)]
    ) as channel:
        prefill = prefill_pb2_grpc.PrefillServiceStub(channel)
        pull = kv_cache_pb2_grpc.KvCacheServiceStub(channel)
        for length in (256, 1024):
            ids = (tokenizer_ids * (length // len(tokenizer_ids) + 1))[:length]
            response = await prefill.Prefill(prefill_pb2.PrefillRequest(token_ids=ids), timeout=60)
            times, size = [], 0
            for _ in range(5):
                started = time.perf_counter()
                size = 0
                async for message in pull.Pull(
                    kv_cache_pb2.PullRequest(
                        handle_id=response.kv_handle.id, max_chunk_bytes=4 * 1024 * 1024
                    )
                ):
                    size += len(message.chunk.data)
                times.append(time.perf_counter() - started)
            await pull.Release(kv_cache_pb2.ReleaseRequest(handle_id=response.kv_handle.id))
            seconds = statistics.median(times)
            results.append((length, size / 1e6, size / 1e6 / seconds))
    return results


async def mesh_runs(model_dir: Path) -> tuple[Run, dict[int, Run], dict[int, Run], list]:
    from transformers import AutoTokenizer

    await wait_mesh()
    ids = AutoTokenizer.from_pretrained(model_dir)(" ".join(PROMPTS))["input_ids"]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{PORTS['generation']}") as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        await single_stream(stub)  # warm every hop
        single = await single_stream(stub)
        closed = {c: await closed_loop(stub, c, requests_each=6) for c in (1, 4, 8, 16)}
        opened = {
            c: await open_loop(stub, c, statistics.median(closed[c].e2e), requests=4 * c + 8)
            for c in (1, 4, 8, 16)
        }
    return single, closed, opened, await kv_transfer(ids)


# ---- report ----


def report(
    inproc: Run,
    prefill_s: float,
    single: Run,
    closed: dict[int, Run],
    opened: dict[int, Run],
    kv: list,
) -> str:
    ms = 1000

    def row(name: str, load: str, run: Run) -> str:
        flight = statistics.mean(run.in_flight) if run.in_flight else 1
        return (
            f"| {name} | {load} | {flight:.1f} | {pct(run.ttft, 0.5) * ms:.0f} / "
            f"{pct(run.ttft, 0.99) * ms:.0f} | {pct(run.itl, 0.5) * ms:.1f} / "
            f"{pct(run.itl, 0.99) * ms:.1f} | {pct(run.e2e, 0.5):.2f} / {pct(run.e2e, 0.99):.2f} "
            f"| {run.tokens_per_s:.1f} |"
        )

    rows = [
        "| engine | load | in flight | TTFT p50/p99 ms | ITL p50/p99 ms | e2e p50/p99 s | tok/s |",
        "|---|---|---|---|---|---|---|",
        row("transformers `generate` in process (TTFT = prefill)", "1 stream", inproc),
    ]
    rows.append(row("aimesh (4 processes)", "1 stream", single))
    rows += [
        row("aimesh (4 processes)", f"{c} clients, closed loop", run) for c, run in closed.items()
    ]
    rows += [
        row("aimesh (4 processes)", f"open loop for {c} in flight", run)
        for c, run in opened.items()
    ]
    kv_rows = [f"| {n} | {mb:.1f} | {rate:,.0f} |" for n, mb, rate in kv]
    single_tps = single.tokens_per_s
    goals = [
        f"- single-stream tokens/s: mesh {single_tps:.1f} vs in-process {inproc.tokens_per_s:.1f}"
        f" = {single_tps / inproc.tokens_per_s:.2f}x (goal >= 0.9x)",
        f"- TTFT p50: mesh {pct(single.ttft, 0.5) * ms:.0f} ms vs in-process prefill "
        f"{prefill_s * ms:.0f} ms + 20 ms = {prefill_s * ms + 20:.0f} ms (goal: at most that)",
        f"- aggregate tokens/s with 8 concurrent streams: {closed[8].tokens_per_s:.1f} = "
        f"{closed[8].tokens_per_s / single_tps:.2f}x single stream (goal >= 4x)",
        f"- KV transfer: {max(rate for _, _, rate in kv):,.0f} MB/s at best (goal >= 1,000 MB/s)",
    ]
    return "\n".join(
        [
            BEGIN,
            "## LLM serving: in-process transformers vs the aimesh LLM mesh",
            "",
            f"Command: `python -m loadtest.llm` (`make bench-llm`). SmolLM2-135M-Instruct, fp32, "
            f"greedy, {len(PROMPTS)} prompts of 5-13 tokens, {NEW_TOKENS} new tokens each "
            f"(EOS ignored). Machine: {os.cpu_count()} cores, Python {platform.python_version()}, "
            f"torch {torch.__version__}. The mesh is tokenizer, prefill, decode and the router as "
            "four processes sharing those cores; the client is a fifth. ITL is the gap between "
            "streamed tokens; open-loop rows use Poisson arrivals at the rate that would keep "
            "the closed-loop concurrency in flight.",
            "",
            *rows,
            "",
            "KvCache.Pull from the prefill process, loopback, 4 MiB chunks (median of 5):",
            "",
            "| prompt tokens | KV MB (fp32) | MB/s |",
            "|---|---|---|",
            *kv_rows,
            "",
            *goals,
            END,
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    model_dir = resolve_model(None, MeshSettings().cache_dir)
    inproc, prefill_s = in_process(model_dir)
    with tempfile.TemporaryDirectory() as root:
        processes = start_mesh(Path(root))
        try:
            single, closed, opened, kv = asyncio.run(mesh_runs(model_dir))
        finally:
            for process in processes:
                process.terminate()
            for process in processes:
                process.wait(timeout=30)
    markdown = report(inproc, prefill_s, single, closed, opened, kv)
    print(markdown)
    if args.out:
        write(markdown, args.out)


if __name__ == "__main__":
    main()
