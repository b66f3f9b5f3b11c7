"""Model files: the shipped checkpoint matches its manifest, a damaged one is refused, the
training script reproduces it, and the terrain ONNX file is pinned."""

from __future__ import annotations

import itertools
import json
import shutil
import subprocess
import sys

import pytest
import torch

from mesh.artifacts import MANIFEST, manifest_problems
from mesh.failures import NotReady
from services.diffusion import schedule, terrain
from services.diffusion.digits import SHIPPED, DigitsModel
from services.diffusion.train_digits import WEIGHTS
from tests.conftest import ROOT

pytestmark = pytest.mark.unit


def test_the_shipped_checkpoint_is_small_fp16_and_matches_its_manifest():
    assert manifest_problems(SHIPPED) == []
    assert (SHIPPED / WEIGHTS).stat().st_size < 4 * 2**20
    files = json.loads((SHIPPED / MANIFEST).read_text())["files"]
    assert set(files) == {"model.safetensors", "config.json"}


@pytest.mark.parametrize("damage", ["flip a byte", "truncate", "drop the manifest"])
def test_a_damaged_checkpoint_is_refused(tmp_path, damage):
    copy = tmp_path / "digits"
    shutil.copytree(SHIPPED, copy)
    weights = copy / WEIGHTS
    data = bytearray(weights.read_bytes())
    if damage == "flip a byte":
        data[len(data) // 2] ^= 0xFF
        weights.write_bytes(bytes(data))
    elif damage == "truncate":
        weights.write_bytes(bytes(data[:-100]))
    else:
        (copy / MANIFEST).unlink()
    with pytest.raises(NotReady, match="not trustworthy"):
        DigitsModel(copy)


@pytest.mark.system  # the digits DDPM trained
def test_training_is_reproducible_from_its_seed(tmp_path):
    runs = []
    for name in ("first", "second"):
        out = tmp_path / name
        subprocess.run(
            [sys.executable, "-m", "services.diffusion.train_digits", "--out", str(out),
             "--steps", "40", "--batch", "64"],
            cwd=ROOT, check=True, capture_output=True, timeout=120,
        )  # fmt: skip
        assert manifest_problems(out) == []
        runs.append(json.loads((out / MANIFEST).read_text())["files"][WEIGHTS]["sha256"])
    assert runs[0] == runs[1]
    DigitsModel(tmp_path / "first")  # what it writes, the service loads


def test_a_terrain_model_file_that_differs_from_the_pinned_one_is_refused(tmp_path, monkeypatch):
    damaged = tmp_path / "terrain.onnx"
    data = bytearray(terrain.bundled_onnx().read_bytes())
    data[-1] ^= 0xFF
    damaged.write_bytes(bytes(data))
    monkeypatch.setattr(terrain, "bundled_onnx", lambda: damaged)
    with pytest.raises(NotReady, match="sha256"):
        terrain.TerrainModel(device="cpu")


def test_respacing_visits_evenly_spaced_timesteps_ending_at_zero():
    assert schedule.respaced(200, 1) == [199]
    assert schedule.respaced(200, 200) == list(range(199, -1, -1))
    fifty = schedule.respaced(200, 50)
    assert len(fifty) == 50 and fifty[0] == 199 and fifty[-1] == 0
    assert all(a > b for a, b in itertools.pairwise(fifty))
    for bad in (0, 201):
        with pytest.raises(ValueError):
            schedule.respaced(200, bad)


def test_the_last_ddim_step_lands_on_the_predicted_clean_image():
    x, eps = torch.randn(1, 64), torch.randn(1, 64)
    alpha_bar = float(schedule.cosine_alpha_bars(200)[0])
    landed = schedule.ddim_step(x, eps, alpha_bar, 1.0)
    assert torch.allclose(landed, schedule.predict_clean(x, eps, alpha_bar), atol=1e-6)


def test_tiles_cover_the_canvas_with_overlap():
    assert terrain.tile_starts(128) == [0]
    starts = terrain.tile_starts(512)
    assert starts[0] == 0 and starts[-1] == 512 - terrain.NATIVE
    assert all(b - a <= terrain.NATIVE - terrain.OVERLAP for a, b in itertools.pairwise(starts))
