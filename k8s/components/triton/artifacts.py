"""Writes what each model of aimesh's Triton model repository (k8s/triton-model-repository)
needs beside its model.py, taken from the code and packages that run the same models in
process, so Triton serves the very files the services would. The Dockerfile beside this
file runs it in the aimesh image and copies the result over the repository's layout.

    python artifacts.py OUT    # OUT/<model>/1/...; AIMESH_CACHE_DIR holds (or gets) the builds

Every model directory of the repository has an entry here, even one that needs nothing:
tests/k8s fails for a directory without one.
"""

from __future__ import annotations

import argparse
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path

from mesh.config import MeshSettings

VERSION = "1"


# Imports inside the functions: each pulls in its model's stack (torch for most). Each
# returns the name its artifact takes in the version directory and the file or folder,
# built into the cache on first use.
def _sentence_embedding(cache_dir: Path) -> tuple[str, Path]:
    from services.embedder.backends import onnx_graph
    from services.embedder.model import default_model

    return "model.onnx", onnx_graph(default_model(), cache_dir)


def _terrain_denoiser(cache_dir: Path) -> tuple[str, Path]:
    from services.diffusion.terrain import bundled_onnx

    return "model.onnx", bundled_onnx()


def _text_generation(cache_dir: Path) -> tuple[str, Path]:
    from services.llm.artifacts import default_model

    return "model", default_model(cache_dir)


def _token_embedding(cache_dir: Path) -> tuple[str, Path]:
    from services.embedder.model import default_model
    from services.rerank.token_model import token_graph

    return "model.onnx", token_graph(default_model().path, cache_dir)


# Model directory name -> its artifact.
ARTIFACTS: dict[str, Callable[[Path], tuple[str, Path]]] = {
    "sentence_embedding": _sentence_embedding,
    "terrain_denoiser": _terrain_denoiser,
    "text_generation": _text_generation,
    "token_embedding": _token_embedding,
}


def write(
    out: Path, cache_dir: Path, models: Iterable[str] = ARTIFACTS, *, link: bool = False
) -> None:
    """Each model's artifact into OUT/<model>/1/: copied for an image, or symlinked where
    the cache stays beside the server (tests, benchmarks)."""
    for model in models:
        version = out / model / VERSION
        version.mkdir(parents=True, exist_ok=True)
        name, source = ARTIFACTS[model](cache_dir)
        if link:
            (version / name).symlink_to(source)
        elif source.is_dir():
            shutil.copytree(source, version / name)
        else:
            shutil.copyfile(source, version / name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="a directory to create, laid out like /models")
    args = parser.parse_args()
    write(args.out, MeshSettings().cache_dir)


if __name__ == "__main__":
    main()
