"""What the llama.cpp engine's 4-bit weights cost in quality: top-1 agreement with the fp32
reference (the torch engine, greedy-equal to transformers) along the reference's own greedy
continuation, on the benchmark prompts; for llama.cpp prefilling, and for the torch engine
prefilling (float32 and bfloat16) with its KV written as llama.cpp's state for decode.

At every step both engines see the same tokens (the reference's), so one disagreement does
not carry into the next steps: the figure is the share of steps at which llama.cpp would
pick the reference's next token.

    python -m loadtest.llm_quality --out docs/benchmarks.md
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import torch

from loadtest.llm import PROMPTS
from loadtest.mesh_overhead import write
from mesh.config import MeshSettings
from services.llm.artifacts import gguf_path, load_tokenizer, resolve_model
from services.llm.kv_codec import SequenceState
from services.llm.llama import Llama, TorchSlots
from services.llm.llama_cpp import ENGINE_VERSION, LlamaCpp

BEGIN, END = "<!-- llm-quality:begin -->", "<!-- llm-quality:end -->"
STEPS = 64
MAX_LEN = 512


def reference_continuation(model: Llama, prompt_ids: list[int]) -> list[int]:
    """The fp32 torch engine's greedy tokens after `prompt_ids`."""
    slots = TorchSlots(model, 1, MAX_LEN)
    logits, kv = model.prefill(prompt_ids)
    slots.load(0, kv)
    tokens = [int(logits.argmax())]
    while len(tokens) < STEPS:
        position = len(prompt_ids) + len(tokens) - 1
        tokens.append(int(slots.decode([tokens[-1]], [position], [0])[0].argmax()))
    return tokens


def llama_cpp_picks(
    prefilled: tuple[torch.Tensor, SequenceState],
    decode: LlamaCpp,
    prompt_ids: list[int],
    forced: list[int],
) -> list[int]:
    """llama.cpp decode's greedy pick at each step after a prefill's (logits, state), fed
    the reference's tokens."""
    logits, state = prefilled
    decode.load(0, state)
    picks = [int(logits.argmax())]
    for step, token in enumerate(forced[:-1]):
        picks.append(int(decode.decode([token], [len(prompt_ids) + step], [0])[0].argmax()))
    decode.free(0)
    return picks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, help="markdown file to write the section into")
    args = parser.parse_args()
    torch.set_num_threads(1)
    directory = resolve_model(None, MeshSettings().cache_dir)
    tokenizer = load_tokenizer(directory)
    reference = Llama.load(directory)

    def llama_cpp() -> LlamaCpp:
        return LlamaCpp(gguf_path(), reference.config, sequences=1, max_seq_len=MAX_LEN, threads=1)

    prefill, decode = llama_cpp(), llama_cpp()
    bfloat16 = Llama.load(directory, torch.bfloat16)

    def on_torch(model: Llama, ids: list[int]) -> tuple[torch.Tensor, SequenceState]:
        logits, kv = model.prefill(ids)
        return logits, decode.state_of(kv)

    prefills: dict[str, Callable[[list[int]], tuple[torch.Tensor, SequenceState]]] = {
        "llama.cpp": prefill.prefill,
        "torch float32": lambda ids: on_torch(reference, ids),
        "torch bfloat16": lambda ids: on_torch(bfloat16, ids),
    }
    rows = ["| prompt | " + " | ".join(prefills) + " |", "|---" * (len(prefills) + 1) + "|"]
    agreed = dict.fromkeys(prefills, 0)
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt).ids
        expected = reference_continuation(reference, ids)
        cells = []
        for name, prefilled in prefills.items():
            picks = llama_cpp_picks(prefilled(ids), decode, ids, expected)
            same = sum(p == e for p, e in zip(picks, expected, strict=True))
            agreed[name] += same
            cells.append(f"{same} / {STEPS}")
        rows.append(f"| {prompt[:48]} | " + " | ".join(cells) + " |")
    total = STEPS * len(PROMPTS)
    markdown = "\n".join(
        [
            BEGIN,
            "## LLM quality: the llama.cpp engine against the fp32 reference",
            "",
            "Command: `python -m loadtest.llm_quality`. SmolLM2-135M-Instruct: the torch engine "
            "in float32 (greedy-equal to transformers) against llama.cpp decode on the "
            f"shipped Q4_1 GGUF ({ENGINE_VERSION}), {STEPS} steps per prompt along the "
            "reference's greedy continuation, both fed the reference's tokens. Columns: "
            "which engine prefilled the prompt (torch's KV written as llama.cpp's state, "
            "`[engines.llm] prefill_engine`).",
            "",
            *rows,
            "",
            "Top-1 agreement: "
            + "; ".join(
                f"{name} prefill **{count} / {total} = {count / total:.1%}**"
                for name, count in agreed.items()
            )
            + ".",
            END,
        ]
    )
    print(markdown)
    if args.out:
        write(markdown, args.out)
    prefill.close()
    decode.close()


if __name__ == "__main__":
    main()
