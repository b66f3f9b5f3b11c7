"""llama.cpp's process-wide start: its log into ours, and the CPU kernels this machine runs.

aimesh builds llama.cpp as its releases are built (Makefile): every x86-64 CPU variant of
ggml's CPU backend as a library of its own (GGML_CPU_ALL_VARIANTS with GGML_BACKEND_DL),
and at run time ggml scores each against the CPU's features and loads the best one the
machine can execute - AVX2 on one machine, AVX-512 BF16 or AMX on another, never an
instruction the CPU refuses. ggml looks for those libraries beside the executable (here the
Python interpreter), so they are loaded from where the wheel installed them. A build with
the CPU backend linked in (no GGML_BACKEND_DL) needs none of this and is reported so.
"""

from __future__ import annotations

import ctypes
import logging
import re
import sysconfig
import threading
from pathlib import Path

import llama_cpp as lib

log = logging.getLogger(__name__)

# ggml_log_level: only warnings and errors reach the service's log; the rest is load chatter.
_LOG_LEVELS = {3: logging.WARNING, 4: logging.ERROR}
_GGML_LOG_ERROR = 4
_LOADED = re.compile(r"loaded CPU backend from (\S+)")
_VARIANT = re.compile(r"libggml-cpu-?([\w.]*)\.so$")
_started = threading.Lock()
_state: dict[str, str] = {}


@lib.llama_log_callback
def _forward_log(level: int, text: bytes, _user_data: ctypes.c_void_p) -> None:
    if not text:
        return
    line = text.decode(errors="replace").rstrip()
    if loaded := _LOADED.search(line):
        _state["library"] = loaded.group(1)
    if level in _LOG_LEVELS:
        log.log(_LOG_LEVELS[level], "llama.cpp: %s", line)
    if level == _GGML_LOG_ERROR:
        # Imported here: gguf imports this module.
        from services.llm.gguf import note_error

        note_error(line)


def variant_directories() -> list[Path]:
    """Where a wheel puts the CPU variant libraries: llama-cpp-python's own lib folder, or
    (its 0.3.x wheels, abetlen/llama-cpp-python#2069) the environment's bin folder."""
    package = Path(lib.__file__).parent / "lib"
    scripts = Path(sysconfig.get_path("scripts"))
    purelib = Path(sysconfig.get_path("purelib"))
    candidates = [package, purelib / "bin", scripts]
    return [d for d in candidates if any(d.glob("libggml-cpu-*.so"))]


def _linked_ggml() -> Path:
    """The libggml file libllama was linked to, as mapped into this process. A wheel holds
    copies of it under several names (libggml.so, .so.0, .so.0.25.3), and each copy loaded
    keeps a backend registry of its own: backends loaded through another copy are not seen
    by llama.cpp ("no backends are loaded")."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            if len(fields) >= 6 and Path(fields[-1]).name.startswith("libggml.so"):
                return Path(fields[-1])
    return Path(lib.__file__).parent / "lib" / "libggml.so"


def start() -> None:
    """Once per process, before any model loads."""
    with _started:
        if _state.get("started"):
            return
        lib.llama_log_set(_forward_log, ctypes.c_void_p())
        ggml = ctypes.CDLL(str(_linked_ggml()))
        ggml.ggml_backend_reg_by_name.argtypes = [ctypes.c_char_p]
        ggml.ggml_backend_reg_by_name.restype = ctypes.c_void_p
        ggml.ggml_backend_load_all_from_path.argtypes = [ctypes.c_char_p]
        directories = variant_directories()
        # A build with its CPU backend linked in has one already: variants found elsewhere
        # (another build's, in the same environment) must not load beside it.
        if directories and not ggml.ggml_backend_reg_by_name(b"CPU"):
            ggml.ggml_backend_load_all_from_path(str(directories[0]).encode())
        lib.llama_backend_init()
        _state["started"] = "yes"


def cpu_variant() -> str:
    """The CPU kernels in use: the variant ggml picked (e.g. "haswell", "sapphirerapids"),
    or "built-in" when the CPU backend is linked into the library."""
    start()
    library = _state.get("library")
    if library is None:
        return "built-in"
    found = _VARIANT.search(library)
    return found.group(1) if found and found.group(1) else Path(library).name


def cpu_features() -> str:
    """llama.cpp's own line of the CPU features its kernels use (AVX2 = 1 | AVX512 = 1...)."""
    start()
    return lib.llama_print_system_info().decode(errors="replace").strip()
