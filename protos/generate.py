"""Regenerate the Python modules of every `.proto` under `protos/` (run from anywhere).

    python protos/generate.py            # rewrite the generated files
    python protos/generate.py --check    # exit 1 if they are stale

grpc_tools writes `from pagefleet.v1 import pagefleet_pb2`, which would resolve to our
`pagefleet` package (the Python face), not to `protos/pagefleet`; the imports are rewritten to
`from protos.pagefleet.v1 import ...` so that the modules import as `protos.pagefleet.v1.*`.
The descriptors keep their proto paths (`pagefleet/v1/pagefleet.proto`), which is what
reflection and other languages see.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

PROTOS = Path(__file__).resolve().parent
SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")
# "from pagefleet.v1 import x_pb2" / "import pagefleet.v1.x_pb2" at the start of a line
_IMPORT = re.compile(r"^(from|import) (pagefleet\.)", re.MULTILINE)
# The tool versions stamped into the files: a newer grpcio-tools changes only these, so the
# freshness check ignores them (the runtime floors they imply belong in pyproject.toml).
_VERSION_STAMPS = re.compile(
    r"# Protobuf Python Version: .*|GRPC_GENERATED_VERSION = .*|ValidateProtobufRuntimeVersion\([^)]*\)"
)


def proto_files(root: Path = PROTOS) -> list[Path]:
    """Every .proto under `root`, relative to it, in a stable order."""
    return sorted(p.relative_to(root) for p in root.rglob("*.proto"))


def generate(out_dir: Path, root: Path = PROTOS) -> list[Path]:
    """Run protoc for every .proto under `root` into `out_dir`; returns the files written
    (relative to `out_dir`), with their imports rewritten to the `protos.` package."""
    from grpc_tools import protoc  # a test extra: only needed to regenerate

    protos = [str(p) for p in proto_files(root)]
    include = str(Path(protoc.__file__).parent / "_proto")  # google/protobuf/*.proto
    args = [
        "grpc_tools.protoc",
        f"-I{root}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {protos}")
    written = sorted(p.relative_to(out_dir) for p in out_dir.rglob("*") if p.name.endswith(SUFFIXES))
    for rel in written:
        path = out_dir / rel
        path.write_text(_IMPORT.sub(r"\1 protos.\2", path.read_text()))
    return written


def stale_files(root: Path = PROTOS) -> list[str]:
    """Generated files that differ from a fresh generation (or are missing)."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = Path(tmp)
        stale = []
        for rel in generate(fresh, root):
            current = root / rel
            if not current.exists() or _unstamped(current) != _unstamped(fresh / rel):
                stale.append(str(rel))
        return stale


def _unstamped(path: Path) -> str:
    return _VERSION_STAMPS.sub("<version>", path.read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the files are stale")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_files()
        for name in stale:
            print(f"stale: protos/{name}", file=sys.stderr)
        return 1 if stale else 0
    for rel in generate(PROTOS):
        print(f"wrote protos/{rel}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
