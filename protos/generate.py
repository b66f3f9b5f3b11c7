"""Regenerate the Python code for every .proto under protos/ into gen/.

One command (`make protos`) so that generated code is reproducible: the same grpcio-tools
version (pinned in pyproject.toml) always writes the same bytes, which is what lets
tests/test_generated_code.py fail when a .proto changed and the code did not.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import grpc_tools
from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
GOOGLEAPIS = ROOT / "third_party" / "googleapis"
DEFAULT_OUT = ROOT / "gen"
WELL_KNOWN = Path(grpc_tools.__file__).parent / "_proto"


def proto_files() -> list[Path]:
    return sorted(PROTO_ROOT.glob("aimesh/**/*.proto"))


def generate(out: Path) -> None:
    """Write *_pb2.py, *_pb2.pyi and *_pb2_grpc.py for every aimesh proto into `out`."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    files = [str(p.relative_to(PROTO_ROOT)) for p in proto_files()]
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{GOOGLEAPIS}",
        f"-I{WELL_KNOWN}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *files,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    package_root = out / "aimesh"
    for directory in [package_root, *(d for d in package_root.rglob("*") if d.is_dir())]:
        (directory / "__init__.py").touch()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    out = parser.parse_args().out
    generate(out)
    print(f"generated {len(proto_files())} protos into {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
