"""Download, here, the wheels a GPU machine without network lacks (`make gpu-wheels`).

Reads the pinned list in scripts/gpu-wheels.txt and fills one folder (default .gpu-wheels/) with
one wheel per entry for CPython 3.12 on manylinux x86_64, without dependencies. DeepSpeed has no
wheel on PyPI: it is built here from its sdist into a pure-Python wheel (DS_BUILD_OPS=0, so no CUDA
is needed to build it; its ops compile just in time on the machine that runs them). Then it checks
that every wheel installs on that target, that each package comes once and that the folder is small
enough to carry, and prints the command that installs them there.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.tags import compatible_tags, cpython_tags
from packaging.utils import canonicalize_name, parse_wheel_filename

ROOT = Path(__file__).resolve().parent.parent
PYTHON_VERSION = (3, 12)
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"]
# Built from source here: no wheel on PyPI.
BUILT_HERE = {"deepspeed"}


def read_list(path: Path) -> list[Requirement]:
    reqs = []
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            specs = list(req.specifier)
            if len(specs) != 1 or specs[0].operator != "==":
                sys.exit(f"{path}: {line!r} is not pinned to one version (name==version)")
            reqs.append(req)
    return reqs


def target_tags() -> set:
    # The tags pip accepts for CPython 3.12 on these platforms: cp312, abi3 and pure-Python wheels.
    abi = f"cp{PYTHON_VERSION[0]}{PYTHON_VERSION[1]}"
    tags = set(cpython_tags(PYTHON_VERSION, [abi], PLATFORMS))
    tags |= set(compatible_tags(PYTHON_VERSION, abi, PLATFORMS))
    return tags


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", type=Path, default=ROOT / "scripts" / "gpu-wheels.txt")
    parser.add_argument("--dest", type=Path, default=ROOT / ".gpu-wheels")
    parser.add_argument("--max-mib", type=float, default=60.0)
    args = parser.parse_args()

    reqs = read_list(args.list)
    names = [canonicalize_name(r.name) for r in reqs]
    if len(set(names)) != len(names):
        sys.exit(f"{args.list}: a package is listed twice")
    shutil.rmtree(args.dest, ignore_errors=True)
    args.dest.mkdir(parents=True)

    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    binary = [str(r) for r in reqs if canonicalize_name(r.name) not in BUILT_HERE]
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    subprocess.run(
        [*pip, "download", "-qq", "--dest", str(args.dest), "--no-deps", "--only-binary=:all:",
         *platforms, "--implementation", "cp", "--abi", f"cp{PYTHON_VERSION[0]}{PYTHON_VERSION[1]}",
         "--python-version", ".".join(map(str, PYTHON_VERSION)), *binary],
        check=True,
    )  # fmt: skip
    built = [str(r) for r in reqs if canonicalize_name(r.name) in BUILT_HERE]
    if built:
        # The running interpreter's setuptools builds it; no CUDA, no compiled op.
        env = {**os.environ, "DS_BUILD_OPS": "0"}
        subprocess.run(
            [*pip, "wheel", "-qq", "--no-deps", "--no-build-isolation", "--no-cache-dir",
             "--wheel-dir", str(args.dest), *built],
            check=True,
            env=env,
        )  # fmt: skip

    # Every file a wheel for the target, one per listed package, at the listed version.
    tags = target_tags()
    wanted = {canonicalize_name(r.name): next(iter(r.specifier)).version for r in reqs}
    found: dict[str, Path] = {}
    problems = []
    for path in sorted(args.dest.iterdir()):
        if path.suffix != ".whl":
            problems.append(f"{path.name}: not a wheel")
            continue
        name, version, _, wheel_tags = parse_wheel_filename(path.name)
        if name in found:
            problems.append(f"{name}: two wheels ({found[name].name}, {path.name})")
        found[name] = path
        if name not in wanted:
            problems.append(f"{path.name}: not in {args.list.name}")
        elif str(version).split("+")[0] != wanted[name]:
            problems.append(f"{path.name}: version {version}, listed {wanted[name]}")
        if not wheel_tags & tags:
            problems.append(f"{path.name}: does not install on CPython 3.12, manylinux x86_64")
        if name in BUILT_HERE and any(t.platform != "any" for t in wheel_tags):
            problems.append(f"{path.name}: built here but not pure Python")
    problems += [f"{name}: no wheel" for name in wanted if name not in found]

    total = 0
    for _name, path in sorted(found.items()):
        size = path.stat().st_size
        total += size
        print(f"{size / 2**20:8.2f} MiB  {path.name}")
    print(f"{total / 2**20:8.2f} MiB  total, {len(found)} wheels in {args.dest}")
    if total > args.max_mib * 2**20:
        problems.append(f"{total / 2**20:.1f} MiB in all, over {args.max_mib:g} MiB")
    if problems:
        sys.exit("gpu-wheels:\n  " + "\n  ".join(problems))
    rel = os.path.relpath(args.dest, ROOT)
    print(f"Install there: python3 -m pip install --no-index --find-links {rel} --no-deps {rel}/*.whl")


if __name__ == "__main__":
    main()
