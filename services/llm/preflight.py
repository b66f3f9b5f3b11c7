"""What `aimesh up` checks of the LLM before any service starts (ServiceSpec.preflight):
that the model can be read and that prefill and decode fit in memory together. A GGUF that
is truncated, corrupt or of an architecture llama.cpp does not know, or a model too large
for the machine, stops the start with the reason, instead of four services each failing
their warm-up and restarting in a loop."""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import ValidationError

from mesh.config import MeshSettings
from mesh.failures import NotReady
from services.llm import memory_plan
from services.llm.engine_choice import engine_of, gguf_of
from services.llm.gguf import read_facts
from services.llm.settings import llm_settings

GIB = memory_plan.GIB


def torch_model_problem(directory: Path) -> None:
    """NotReady unless the torch engine can run the directory's model (a llama)."""
    try:
        model_type = json.loads((directory / "config.json").read_text()).get("model_type")
    except (OSError, ValueError) as error:
        raise NotReady(f"{directory} is not a Hugging Face model directory ({error})") from error
    if model_type != "llama":
        raise NotReady(
            f"{directory}: the torch engine runs llama models, not {model_type!r}; the "
            "llama.cpp engine runs it from its GGUF ([engines.llm] gguf = <the GGUF>)"
        )


def problems(settings: MeshSettings) -> list[str]:
    try:
        llm = llm_settings(settings)
        engines = (engine_of(llm, "prefill"), engine_of(llm, "decode"))
        if llm.model is not None and "torch" in engines:
            torch_model_problem(llm.model)
        gguf = gguf_of(llm)
        if gguf is None:
            return []
        facts = read_facts(gguf)
    except ValidationError as error:
        return [f"[engines.llm] {'.'.join(map(str, e['loc']))}: {e['msg']}" for e in error.errors()]
    except NotReady as error:
        return [f"[engines.llm] {error}"]
    if llm.gguf_only and "torch" in engines:
        return [
            f"[engines.llm] {gguf.name} ({facts.architecture}) is a GGUF alone, which only the "
            "llama.cpp engine serves: set engine and prefill_engine to 'auto' or 'llama.cpp'"
        ]
    # Prefill holds one sequence, decode every slot; both count their own weights (the
    # kernels repack some weight types into memory of their own).
    sequences = [
        count
        for phase, count in (("prefill", 1), ("decode", llm.max_batch_size))
        if engine_of(llm, phase) == "llama.cpp"
    ]
    needs = [memory_plan.need(facts, count, llm.max_seq_len) for count in sequences]
    limit = memory_plan.budget(llm)
    if any(need.total > limit for need in needs):
        return [
            f"[engines.llm] {gguf.name} needs about {max(n.total for n in needs) / GIB:.2f} GiB "
            f"in one process ({'; '.join(map(str, needs))}), more than the "
            f"{limit / GIB:.2f} GiB budget: lower max_seq_len or max_batch_size, or use a "
            "smaller quantization"
        ]
    total, available = sum(n.total for n in needs), memory_plan.available_bytes()
    if total > available:
        return [
            f"[engines.llm] {gguf.name} needs about {total / GIB:.2f} GiB for prefill and "
            f"decode together, more than the {available / GIB:.2f} GiB available: lower "
            "max_seq_len or max_batch_size, or use a smaller quantization"
        ]
    return []
