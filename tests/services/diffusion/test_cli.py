"""`aimesh imagine` against a real diffusion worker process."""

from __future__ import annotations

import asyncio
import io
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.conftest import VENV_BIN, subprocess_env

pytestmark = pytest.mark.system


def read_all(paths: list[str]) -> list[bytes]:
    return [Path(path).read_bytes() for path in paths]


async def imagine(worker, *args: str) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        str(VENV_BIN / "aimesh"),
        "imagine",
        *args,
        env=subprocess_env(AIMESH_SERVICES__DIFFUSION__PORT=str(worker.port)),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), timeout=120)
    return process.returncode, out.decode(), err.decode()


async def test_imagine_saves_images_and_prints_json(serve_process, tmp_path, digit_classifier):
    worker = await serve_process("diffusion")
    code, out, _ = await imagine(
        worker, "--model", "digits", "--prompt", "7", "--n", "3", "--seed", "40",
        "--steps", "30", "--out", str(tmp_path), "--json",
    )  # fmt: skip
    assert code == 0
    result = json.loads(out)
    assert result["seeds"] == [40, 41, 42]
    assert result["images"] == [str(tmp_path / f"digits-{seed}.png") for seed in (40, 41, 42)]
    pngs = read_all(result["images"])
    assert list(digit_classifier(pngs)) == [7, 7, 7]
    assert {"queue", "denoise", "encode", "total"} <= set(result["timing"])
    assert len(result["trace_id"]) == 32

    heightfield = tmp_path / "hill.png"
    code, out, err = await imagine(
        worker, "--model", "terrain", "--condition", "difficulty=70", "--out", str(heightfield)
    )
    assert code == 0 and out.strip() == str(heightfield) and "trace" in err
    assert np.array(Image.open(io.BytesIO(heightfield.read_bytes()))).shape == (128, 128)

    code, _, err = await imagine(worker, "--model", "digits", "--prompt", "cat", "--steps", "0")
    assert code == 1
    assert "INVALID_ARGUMENT" in err and "prompt" in err and "steps" in err
