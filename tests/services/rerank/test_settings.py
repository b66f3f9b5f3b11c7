"""The rerank backend choice is checked when the settings load, not at the first call."""

from __future__ import annotations

import subprocess
import sys

import pytest
from pydantic import ValidationError

from mesh.config import MeshSettings
from services.rerank.settings import RerankSettings

pytestmark = pytest.mark.unit

TRITON = {"url": "triton:8001", "model": "token_embedding"}


def test_the_default_scores_in_process():
    settings = RerankSettings()
    assert settings.backend == "torch" and settings.triton is None


def test_the_triton_backend_reads_its_section_from_the_mesh_config():
    mesh = MeshSettings(services={"rerank": {"backend": "triton", "triton": TRITON}})
    settings = RerankSettings.of(mesh, "rerank")
    assert settings.triton is not None
    assert (settings.triton.url, settings.triton.model) == ("triton:8001", "token_embedding")
    assert settings.triton.timeout_s == 30.0


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"backend": "triton"}, r"needs a \[services\.rerank\.triton\] section"),
        ({"triton": TRITON}, r"\[services\.rerank\.triton\] is read only with backend"),
        (
            {"backend": "triton", "triton": TRITON, "cross_encoder": "/models/ce"},
            "cross_encoder runs in process",
        ),
        ({"backend": "triton", "triton": {"url": "triton:8001"}}, "model"),
        ({"backend": "onnx"}, "backend"),
    ],
)
def test_a_backend_that_cannot_run_as_configured_is_refused(fields, message):
    with pytest.raises(ValidationError, match=message):
        RerankSettings.model_validate(fields)


def test_the_service_module_loads_without_torch():
    """A rerank whose transformer runs on Triton must not pay torch's import (seconds,
    hundreds of MB): only the in-process scorers import it, when they load."""
    probe = (
        "import sys, services.rerank.servicer, services.rerank.triton_scorer; "
        "sys.exit('torch' in sys.modules or 'transformers' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
