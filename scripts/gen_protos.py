"""Regenerate the Python stubs of every contract: `make protos`.

protoc writes `pipelinerl/<service>/v1/*_pb2*.py` under a scratch folder; the files are then moved
to `services/<service>/v1/`, because the package `pipelinerl` is the folder `services/`. The
vendored `google/rpc/status.proto` and `error_details.proto` are not generated: googleapis-common-protos
provides them.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from importlib import resources
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTOS = ROOT / "protos"
SERVICES = ROOT / "services"


def main() -> int:
    sources = sorted(str(p.relative_to(PROTOS)) for p in (PROTOS / "pipelinerl").rglob("*.proto"))
    well_known = str(resources.files("grpc_tools") / "_proto")
    with tempfile.TemporaryDirectory() as out:
        args = [
            "protoc",
            f"-I{PROTOS}",
            f"-I{well_known}",
            f"--python_out={out}",
            f"--pyi_out={out}",
            f"--grpc_python_out={out}",
            *sources,
        ]
        if protoc.main(args) != 0:
            return 1
        for generated in sorted((Path(out) / "pipelinerl").rglob("*.py*")):
            target = SERVICES / generated.relative_to(Path(out) / "pipelinerl")
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(generated, target)
    return 0


if __name__ == "__main__":
    sys.exit(main())
