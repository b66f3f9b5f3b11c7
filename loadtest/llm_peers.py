"""LLM serving peers: the aimesh mesh (on its llama.cpp and torch engines) beside in-process
transformers (fp32, bf16) and llama.cpp's `llama-server` on the same GGUF, in one run on
the same prompts.

Every engine decodes greedily, ignores EOS so every stream has the same length, and reuses
no earlier prompt's KV, except where measured: TTFT for a short (~9-token) and a 256-token
prompt, the same 256 tokens followed by a new question once they were seen (the mesh's
prefix cache, llama-server's `cache_prompt`), inter-token latency, and per-stream and
aggregate tokens/s with 1, 4, 8 and 16 concurrent streams; beside them the
memory-bandwidth floor (every weight read once per decode step). Transformers runs static batches
with `generate` (a batch of c prompts stands for c streams), as ANCHORS.md measured it;
the mesh and llama-server stream over loopback (gRPC, HTTP) with continuous batching.
Writes a section of docs/benchmarks.md and a plot of aggregate tokens/s against
concurrency next to it.

    python -m loadtest.llm_peers --llama-server var/llama-build/bin/llama-server \\
        --out docs/benchmarks.md      # `make bench-llm-peers`
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import statistics
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx
import torch

from aimesh.llm.v1 import generation_pb2, generation_pb2_grpc, sampling_pb2
from loadtest.llm import PORTS, PROMPTS, Run, pct, start_mesh, wait_mesh
from loadtest.mesh_overhead import write
from mesh.config import MeshSettings
from services.llm.artifacts import gguf_path, resolve_model

BEGIN, END = "<!-- llm-peers:begin -->", "<!-- llm-peers:end -->"
SHORT_PROMPT = "Explain what a hash table is in one paragraph."
LONG_TOKENS = 256
LLAMA_PORT = 50770
# Weight bytes per parameter for the floor; Q4_1 is taken from the GGUF file's size.
BYTES_PER_PARAM = {"float32": 4, "bfloat16": 2}

# The mesh's [engines.llm] engine (decode), prefill_engine, dtype (torch only) and threads
# per process (0: every core), one run each; the first is the default configuration.
MESH_VARIANTS = (
    ("llama.cpp", "torch", "auto", 0),
    ("llama.cpp", "torch", "auto", 1),
    ("llama.cpp", "llama.cpp", "auto", 0),
    ("torch", "torch", "float32", 0),
)

# One streamed request (prompt, new tokens, whether it may reuse an earlier prompt's KV):
# yields how many tokens each arrival carried.
Stream = Callable[[str, int, bool], AsyncIterator[int]]


@dataclass
class Engine:
    """One engine's results: TTFT per prompt length, and a Run per concurrency."""

    name: str
    weight_bytes: int
    ttft_short: float = float("nan")
    ttft_long: float = float("nan")
    ttft_cached: float = float("nan")
    runs: dict[int, Run] = field(default_factory=dict)


@dataclass(frozen=True)
class Plan:
    """What to measure: quick smoke runs shrink every dimension."""

    concurrency: tuple[int, ...]
    new_tokens: int
    rounds: int
    ttft_repeats: int


FULL = Plan(concurrency=(1, 4, 8, 16), new_tokens=64, rounds=3, ttft_repeats=5)
QUICK = Plan(concurrency=(1, 4), new_tokens=16, rounds=1, ttft_repeats=1)


def long_prompts(model_dir: Path, count: int) -> list[str]:
    """`count` prompts of exactly LONG_TOKENS tokens (in the shared SmolLM2 tokenizer), no
    two starting alike, so that no prompt's KV can stand for another's."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = []
    for start in range(count):
        words = " ".join((PROMPTS[start % len(PROMPTS) :] + PROMPTS) * 40)
        ids = tokenizer(f"{start}. {words}", add_special_tokens=False)["input_ids"]
        prompts.append(tokenizer.decode(ids[:LONG_TOKENS]))
    return prompts


def prompts_for(clients: int, rounds: int) -> list[list[str]]:
    """Each client's prompts: the same set for every engine at a given concurrency."""
    return [[PROMPTS[(i + r) % len(PROMPTS)] for r in range(rounds)] for i in range(clients)]


# ---- in-process transformers: static batches ----


def transformers_engine(model_dir: Path, dtype: str, plan: Plan, long: list[str]) -> Engine:
    """`generate` on batches of c prompts; TTFT is the batch's first token (prefill + 1)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    params = sum(p.numel() for p in model.parameters())
    engine = Engine(f"transformers {dtype} `generate`", params * BYTES_PER_PARAM[dtype])

    def generate(prompts: list[str], new_tokens: int) -> float:
        inputs = tokenizer(prompts, return_tensors="pt", padding=True)
        started = time.perf_counter()
        model.generate(
            **inputs,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )
        return time.perf_counter() - started

    with torch.inference_mode():
        generate(["warm up"], 4)
        engine.ttft_short = min(generate([SHORT_PROMPT], 1) for _ in range(plan.ttft_repeats))
        engine.ttft_long = min(generate([prompt], 1) for prompt in long)
        for clients in plan.concurrency:
            run = Run()
            for batch in zip(*prompts_for(clients, plan.rounds), strict=True):
                first = generate(list(batch), 1)
                total = generate(list(batch), plan.new_tokens)
                run.ttft += [first] * clients
                run.itl += [(total - first) / max(plan.new_tokens - 1, 1)] * clients
                run.e2e += [total] * clients
                run.tokens += clients * plan.new_tokens
                run.seconds += total
            engine.runs[clients] = run
    return engine


# ---- streaming engines: the mesh and llama-server ----


async def timed(
    stream: Stream, prompt: str, new_tokens: int, run: Run, reuse: bool = False
) -> None:
    """One request into `run`: TTFT, the gap per token after it, end to end."""
    started = time.perf_counter()
    last = None
    async for count in stream(prompt, new_tokens, reuse):
        last = run.arrived(count, started, last)
    run.e2e.append(time.perf_counter() - started)


async def closed_loop(stream: Stream, clients: int, plan: Plan) -> Run:
    """`clients` streams at once, each sending its prompts back to back."""
    run = Run()

    async def client(prompts: list[str]) -> None:
        for prompt in prompts:
            await timed(stream, prompt, plan.new_tokens, run)

    started = time.perf_counter()
    await asyncio.gather(*(client(p) for p in prompts_for(clients, plan.rounds)))
    run.seconds = time.perf_counter() - started
    return run


async def first_token(stream: Stream, prompts: list[str], reuse: bool = False) -> float:
    """Best TTFT of single requests, one per prompt (best: the least disturbed)."""
    run = Run()
    for prompt in prompts:
        await timed(stream, prompt, 2, run, reuse)
    return min(run.ttft)


async def measure_stream(engine: Engine, stream: Stream, plan: Plan, long: list[str]) -> Engine:
    """Warm up, then TTFT (short, long, long after its prefix was seen) and every
    concurrency, one after another."""
    await closed_loop(stream, 1, Plan((1,), 4, 1, 1))
    engine.ttft_short = await first_token(stream, [SHORT_PROMPT] * plan.ttft_repeats)
    engine.ttft_long = await first_token(stream, long)
    questions = [f"{long[0]}\nQuestion {n}: what comes next?" for n in range(plan.ttft_repeats)]
    await first_token(stream, [long[0]], reuse=True)  # seen once
    engine.ttft_cached = await first_token(stream, questions, reuse=True)
    for clients in plan.concurrency:
        engine.runs[clients] = await closed_loop(stream, clients, plan)
    return engine


@contextlib.contextmanager
def environment(**values: str) -> Iterator[None]:
    """Temporarily set variables that child processes inherit (start_mesh copies os.environ)."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def stop(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        process.terminate()
    for process in processes:
        process.wait(timeout=30)


def mesh_engine(
    variant: tuple[str, str, str, int], weight_bytes: int, plan: Plan, long: list[str]
) -> Engine:
    """The four-process mesh as loadtest.llm runs it, with [engines.llm] engine,
    prefill_engine, dtype and threads."""
    kind, prefill_kind, dtype, threads = variant

    async def measure() -> Engine:
        await wait_mesh()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{PORTS['generation']}") as channel:
            stub = generation_pb2_grpc.GenerationServiceStub(channel)

            async def stream(prompt: str, new_tokens: int, reuse: bool) -> AsyncIterator[int]:
                # The prefix cache is always on; only prompts meant to share a prefix do.
                request = generation_pb2.GenerateRequest(
                    prompt=prompt,
                    stopping=sampling_pb2.StoppingCriteria(
                        max_new_tokens=new_tokens, ignore_eos=True
                    ),
                )
                async for message in stub.Generate(request, timeout=600):
                    if message.HasField("chunk") and message.chunk.token_ids:
                        yield len(message.chunk.token_ids)

            weights = "Q4_1" if kind == "llama.cpp" else dtype
            cores = f"{threads} thread(s)" if threads else "all cores"
            name = f"aimesh mesh, {prefill_kind} prefill, {kind} {weights} decode, {cores}"
            return await measure_stream(
                Engine(name, weight_bytes),
                stream,
                plan,
                long,
            )

    with tempfile.TemporaryDirectory() as root:
        with environment(
            AIMESH_ENGINES__LLM__ENGINE=kind,
            AIMESH_ENGINES__LLM__PREFILL_ENGINE=prefill_kind,
            AIMESH_ENGINES__LLM__DTYPE=dtype,
            AIMESH_ENGINES__LLM__THREADS=str(threads),
        ):
            processes = start_mesh(Path(root))
        try:
            return asyncio.run(measure())
        finally:
            stop(processes)


def start_llama_server(binary: Path, gguf: Path, slots: int, log: Path) -> subprocess.Popen:
    """llama-server on loopback: 2 threads, continuous batching, one slot per stream."""
    return subprocess.Popen(
        [
            str(binary),
            *("--model", str(gguf), "--host", "127.0.0.1", "--port", str(LLAMA_PORT)),
            *("--threads", "2", "--threads-batch", "2", "--parallel", str(slots)),
            # Every slot holds the long prompt plus the new tokens, with room to spare.
            *("--ctx-size", str(slots * 1024), "--cont-batching"),
            # No reuse of earlier prompts, in the slots or in host memory.
            *("--cache-reuse", "0", "--cache-ram", "0", "--no-webui"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=log.open("w"),
    )


async def wait_llama(client: httpx.AsyncClient, process: subprocess.Popen) -> None:
    """Until /health says the model is loaded (503 while loading)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"llama-server exited with {process.returncode}")
        with contextlib.suppress(httpx.TransportError):
            if (await client.get("/health")).status_code == 200:
                return
        await asyncio.sleep(0.5)
    raise SystemExit("llama-server did not become healthy")


def streamed_tokens(line: str) -> int:
    """Tokens in one server-sent event of /completion; the final (stop) event repeats none."""
    if not line.startswith("data: "):
        return 0
    event = json.loads(line.removeprefix("data: "))
    return 0 if event.get("stop") else len(event.get("tokens", []))


def llama_engine(binary: Path, plan: Plan, long: list[str], url: str | None = None) -> Engine:
    """llama-server's streaming /completion endpoint over HTTP: one started here, or the
    one already running at `url` (started as start_llama_server starts it)."""
    gguf = gguf_path()

    async def measure(process: subprocess.Popen | None) -> Engine:
        base = url or f"http://127.0.0.1:{LLAMA_PORT}"
        # A connection per request: llama-server's HTTP library closes a kept-alive one
        # after a few requests, and a request sent on it as it closes fails with
        # "Server disconnected" (it ended two runs here).
        no_reuse = httpx.Limits(max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=base, timeout=600, limits=no_reuse) as client:
            if process is not None:
                await wait_llama(client, process)

            async def stream(prompt: str, new_tokens: int, reuse: bool) -> AsyncIterator[int]:
                body = {
                    "prompt": prompt,
                    "n_predict": new_tokens,
                    "stream": True,
                    "ignore_eos": True,
                    "cache_prompt": reuse,
                    "temperature": 0.0,
                    "top_k": 1,
                    "return_tokens": True,
                }
                async with client.stream("POST", "/completion", json=body) as response:
                    response.raise_for_status()
                    async for line in response.aiter_lines():
                        if count := streamed_tokens(line):
                            yield count

            engine = Engine("llama.cpp `llama-server` Q4_1", gguf.stat().st_size)
            return await measure_stream(engine, stream, plan, long)

    if url:
        return asyncio.run(measure(None))
    with tempfile.TemporaryDirectory() as root:
        process = start_llama_server(binary, gguf, max(plan.concurrency), Path(root) / "log")
        try:
            return asyncio.run(measure(process))
        finally:
            stop([process])


# ---- report ----


def read_bandwidth_gbs() -> float:
    """What this machine's cores read from memory: best of 5 sums over 512 MB."""
    data = torch.ones(128 * 1024 * 1024)
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - started)
    return data.numel() * data.element_size() / best / 1e9


def floor_ms(weight_bytes: int, bandwidth_gbs: float) -> float:
    """Least time per decode step: every weight read once from memory."""
    return weight_bytes / (bandwidth_gbs * 1e9) * 1000


def per_stream(run: Run) -> float:
    """Median tokens/s one stream sees, end to end (TTFT included)."""
    return statistics.median(run.tokens / len(run.e2e) / e2e for e2e in run.e2e)


def plot(engines: list[Engine], path: Path) -> None:
    """Aggregate tokens/s against concurrency, one line per engine."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    figure, axes = pyplot.subplots(figsize=(7, 4.5))
    for engine in engines:
        levels = sorted(engine.runs)
        axes.plot(
            levels,
            [engine.runs[c].tokens_per_s for c in levels],
            marker="o",
            label=engine.name.replace("`", ""),
        )
    axes.set_xlabel("concurrent streams")
    axes.set_ylabel("aggregate tokens/s")
    axes.set_xticks(sorted({c for engine in engines for c in engine.runs}))
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    axes.set_title("SmolLM2-135M-Instruct, greedy, CPU")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    pyplot.close(figure)


def report(engines: list[Engine], plan: Plan, bandwidth_gbs: float, image: str) -> str:
    ms = 1000
    levels = plan.concurrency
    summary = [
        "| engine | TTFT ~9-token prompt ms | TTFT 256 ms | TTFT 256 seen + 9 ms "
        "| ITL p50 ms (c=1) | floor ms/token "
        + "".join(f"| agg tok/s c={c} " for c in levels)
        + "|",
        "|---|---|---|---|---|---" + "|---" * len(levels) + "|",
    ]
    detail = [
        "| engine | streams | TTFT p50/p99 ms | ITL p50/p99 ms | per-stream tok/s | agg tok/s |",
        "|---|---|---|---|---|---|",
    ]
    for engine in engines:
        summary.append(
            f"| {engine.name} | {engine.ttft_short * ms:.0f} | {engine.ttft_long * ms:.0f} | "
            f"{engine.ttft_cached * ms:.0f} | "
            f"{pct(engine.runs[levels[0]].itl, 0.5) * ms:.1f} | "
            f"{floor_ms(engine.weight_bytes, bandwidth_gbs):.1f} "
            + "".join(f"| {engine.runs[c].tokens_per_s:.1f} " for c in levels)
            + "|"
        )
        for clients, run in engine.runs.items():
            detail.append(
                f"| {engine.name} | {clients} | {pct(run.ttft, 0.5) * ms:.0f} / "
                f"{pct(run.ttft, 0.99) * ms:.0f} | {pct(run.itl, 0.5) * ms:.1f} / "
                f"{pct(run.itl, 0.99) * ms:.1f} | {per_stream(run):.1f} | "
                f"{run.tokens_per_s:.1f} |"
            )
    return "\n".join(
        [
            BEGIN,
            "## LLM serving against its peers: transformers and llama.cpp",
            "",
            f"Command: `python -m loadtest.llm_peers` (`make bench-llm-peers`). "
            f"SmolLM2-135M-Instruct, greedy, EOS ignored, {plan.new_tokens} new tokens per "
            f"request, {plan.rounds} request(s) per stream. Machine: "
            f"{os.cpu_count()} cores, Python {platform.python_version()}, torch "
            f"{torch.__version__}. Transformers runs static batches of c prompts in this "
            "process (TTFT: the batch's first token); the mesh (four processes) and "
            "llama-server (Q4_1 GGUF, 2 threads, continuous batching, a slot per stream) "
            "stream over loopback. TTFT columns: best of "
            f"{plan.ttft_repeats}, one request alone; no prompt starts like another but in "
            "'256 seen + 9': the 256-token prompt, already sent once, and a new question after "
            "it (the mesh's prefix cache; llama-server's `cache_prompt`; transformers has "
            "none, nan). Floor: all weights read once per decode "
            f"step at {bandwidth_gbs:.1f} GB/s (measured here: one pass over 512 MB).",
            "",
            *summary,
            "",
            *detail,
            "",
            f"![aggregate tokens/s against concurrency]({image})",
            END,
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, help="markdown file to write the section into")
    parser.add_argument("--plot", type=Path, help="PNG path (default: llm-peers.png by --out)")
    parser.add_argument(
        "--llama-server", type=Path, default=Path("var/llama-build/bin/llama-server")
    )
    parser.add_argument(
        "--llama-url", help="measure the llama-server running here instead of starting one"
    )
    parser.add_argument("--bandwidth-gbs", type=float, help="for the floor (default: measured)")
    parser.add_argument("--quick", action="store_true", help="smoke run: c=1,4; 16 tokens")
    args = parser.parse_args()
    plan = QUICK if args.quick else FULL
    model_dir = resolve_model(None, MeshSettings().cache_dir)
    long = long_prompts(model_dir, plan.ttft_repeats)
    engines = [transformers_engine(model_dir, dtype, plan, long) for dtype in BYTES_PER_PARAM]
    weights = dict(zip(BYTES_PER_PARAM, (e.weight_bytes for e in engines), strict=True))
    gguf_bytes = gguf_path().stat().st_size  # what llama.cpp decode reads per step
    engines += [
        mesh_engine(
            variant, gguf_bytes if variant[0] == "llama.cpp" else weights[variant[2]], plan, long
        )
        for variant in MESH_VARIANTS
    ]
    engines.append(llama_engine(args.llama_server, plan, long, args.llama_url))
    bandwidth = args.bandwidth_gbs or read_bandwidth_gbs()
    image = args.plot or (args.out.parent if args.out else Path(".")) / "llm-peers.png"
    markdown = report(engines, plan, bandwidth, image.name)
    print(markdown)  # before the plot: a plotting failure must not lose the measurements
    plot(engines, image)
    if args.out:
        write(markdown, args.out)


if __name__ == "__main__":
    main()
