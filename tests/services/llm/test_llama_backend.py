"""llama.cpp's CPU kernels as loaded here: the variant ggml picked for this CPU is one the
CPU can execute (every instruction set its build needs is in /proc/cpuinfo's flags), and
GetInfo's name for it is what was loaded."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.llm import llama_backend

pytestmark = pytest.mark.unit

# What each x86-64 variant of GGML_CPU_ALL_VARIANTS is compiled for (its features in
# ggml/src/CMakeLists.txt), as /proc/cpuinfo names them.
_FLAG = {
    "SSE42": "sse4_2", "AVX": "avx", "F16C": "f16c", "FMA": "fma", "AVX2": "avx2",
    "BMI2": "bmi2", "AVX512": "avx512f", "AVX512_VBMI": "avx512vbmi",
    "AVX512_VNNI": "avx512_vnni", "AVX512_BF16": "avx512_bf16", "AVX_VNNI": "avx_vnni",
    "AMX_TILE": "amx_tile", "AMX_INT8": "amx_int8",
}  # fmt: skip
_HASWELL = "SSE42 AVX F16C FMA AVX2 BMI2"
_VARIANTS = {
    "x64": "",
    "sse42": "SSE42",
    "sandybridge": "SSE42 AVX",
    "ivybridge": "SSE42 AVX F16C",
    "piledriver": "SSE42 AVX F16C FMA",
    "haswell": _HASWELL,
    "skylakex": f"{_HASWELL} AVX512",
    "cannonlake": f"{_HASWELL} AVX512 AVX512_VBMI",
    "cascadelake": f"{_HASWELL} AVX512 AVX512_VNNI",
    "icelake": f"{_HASWELL} AVX512 AVX512_VBMI AVX512_VNNI",
    "cooperlake": f"{_HASWELL} AVX512 AVX512_VNNI AVX512_BF16",
    "zen4": f"{_HASWELL} AVX512 AVX512_VBMI AVX512_VNNI AVX512_BF16",
    "alderlake": f"{_HASWELL} AVX_VNNI",
    "sapphirerapids": f"{_HASWELL} AVX512 AVX512_VBMI AVX512_VNNI AVX512_BF16 AMX_TILE AMX_INT8",
}
REQUIRES = {name: {_FLAG[f] for f in features.split()} for name, features in _VARIANTS.items()}


def cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def test_the_loaded_variant_is_the_best_this_cpu_executes():
    built = {
        path.name.removeprefix("libggml-cpu-").removesuffix(".so")
        for directory in llama_backend.variant_directories()
        for path in directory.glob("libggml-cpu-*.so")
    }
    variant = llama_backend.cpu_variant()
    if not built:  # a build with its CPU backend linked in (no GGML_BACKEND_DL)
        assert variant == "built-in"
        return
    assert built <= REQUIRES.keys(), built - REQUIRES.keys()
    flags = cpu_flags()
    runnable = {name for name in built if REQUIRES[name] <= flags}
    assert variant in runnable
    # ggml scores a variant by the features it uses: none runnable here needs a superset
    # of what the loaded one needs (the loaded one is the most capable).
    assert not any(REQUIRES[name] > REQUIRES[variant] for name in runnable)
    assert "AVX2 = 1" in llama_backend.cpu_features() or "avx2" not in REQUIRES[variant]
