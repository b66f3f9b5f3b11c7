"""What `aimesh up` refuses before any LLM service starts (services/llm/preflight.py): an
engine given a model it cannot run, and a model whose memory estimate exceeds the budget,
each as one line naming what to change; the default mesh passes."""

from __future__ import annotations

import json

import pytest

from mesh.config import MeshSettings
from services.llm.artifacts import gguf_path
from services.llm.gguf import read_facts
from services.llm.memory_plan import need
from services.llm.preflight import problems

pytestmark = pytest.mark.unit


def with_llm(**llm: object) -> MeshSettings:
    return MeshSettings(engines={"llm": llm})


def test_the_default_mesh_passes():
    assert problems(MeshSettings()) == []


def test_the_torch_engine_refuses_a_gguf_alone_naming_its_architecture():
    (problem,) = problems(with_llm(gguf=str(gguf_path()), engine="torch"))
    assert "(llama) is a GGUF alone" in problem and "llama.cpp" in problem


def test_the_torch_engine_refuses_a_directory_of_another_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    (problem,) = problems(with_llm(model=str(tmp_path), engine="torch"))
    assert "not 'qwen3'" in problem and "gguf" in problem


def test_a_model_over_the_budget_is_refused_with_its_size():
    facts = read_facts(gguf_path())
    one_slot = need(facts, 1, 2048).total
    llm = {"engine": "llama.cpp", "max_batch_size": 1}
    (problem,) = problems(with_llm(memory_budget_bytes=one_slot - 1, **llm))
    assert "needs about" in problem and "GiB budget" in problem
    assert problems(with_llm(memory_budget_bytes=one_slot * 4, **llm)) == []


def test_a_gguf_given_twice_differently_is_a_settings_problem(tmp_path):
    (problem,) = problems(with_llm(model=str(gguf_path()), gguf=str(tmp_path / "other.gguf")))
    assert "model names one GGUF and gguf another" in problem
