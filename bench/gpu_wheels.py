"""Wheels this project needs on the GPU machine, for runs there through the device tool, in parts it can carry.

The GPU machine (CPython 3.12, torch 2.11, transformers 5.17, peft, accelerate; no internet) lacks most of the
project's dependencies. This downloads, for CPython 3.12 on x86_64 Linux, the exact versions installed in the
project's venv that a stack needs (the dependency closure of the project's extras, read from the venv's metadata)
minus what the GPU image already has, and writes them as parts (one device call carries one: 64 MiB with the working
tree: `PART_MIB`) with an install script:

    .venv/bin/python bench/gpu_wheels.py --stack trl .vc/trl      # ~1 min from the package index; git-ignore .vc/
    .venv/bin/python bench/gpu_wheels.py --stack verl .vc/verl    # + verl 0.9, ray, tensordict, transformers 5.10
    .venv/bin/python bench/gpu_wheels.py --stack trl --leave-out openai-agents .vc/trl   # 16 MiB, not 23 (below)
    # there, once every part is in /tmp/vc:  bash /tmp/vc/install.sh /tmp/proj
    #         export PYTHONPATH=/tmp/proj:/tmp/site  # /tmp/site: vLLM's bundle (bench/README.md)

/tmp/proj goes first on the path: vLLM's bundle carries openai 3, this project pins openai < 3 (vLLM accepts >= 2).

`--leave-out NAME`: a dependency left out with what only it needs, for runs that never import it (the device carries
the working tree and the parts together, at most 64 MiB a call, and committed results grow the tree): openai-agents
(agent=med_sql only) takes cryptography, mcp and their closure with it, about 7 MiB of the trl stack's 23.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tarfile
import tempfile
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

# The GPU image's packages (read there on 2026-11-17), dev tools, and what no benchmark imports.
ON_IMAGE = set(
    [
        "absl-py",
        "accelerate",
        "aiofiles",
        "aiohappyeyeballs",
        "aiohttp",
        "aiosignal",
        "anyio",
        "attrs",
        "certifi",
        "charset-normalizer",
        "click",
        "cloudpickle",
        "contourpy",
        "cycler",
        "execnet",
        "filelock",
        "fonttools",
        "fsspec",
        "h11",
        "hf-xet",
        "httpcore",
        "httpx",
        "huggingface-hub",
        "idna",
        "iniconfig",
        "jinja2",
        "joblib",
        "kiwisolver",
        "markdown-it-py",
        "markupsafe",
        "matplotlib",
        "mdurl",
        "mpmath",
        "networkx",
        "numpy",
        "packaging",
        "pandas",
        "peft",
        "pillow",
        "pip",
        "pluggy",
        "protobuf",
        "psutil",
        "pyarrow",
        "pygments",
        "pyparsing",
        "pytest",
        "pytest-xdist",
        "python-dateutil",
        "pyyaml",
        "regex",
        "requests",
        "rich",
        "safetensors",
        "scipy",
        "setuptools",
        "shellingham",
        "six",
        "sympy",
        "tabulate",
        "tokenizers",
        "torch",
        "tqdm",
        "transformers",
        "triton",
        "typer",
        "typing-extensions",
        "urllib3",
        "xxhash",
        "ruff",
        "wandb",
        "tzdata",
    ]
)
PLATFORMS = ["manylinux_2_35_x86_64", "manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"]
PROJECT = "agentic-rl"
# Each stack: the project's extras it installs, and what it carries although the image has it (in another version).
STACKS = {
    "trl": ({"trl"}, set()),
    "verl": ({"trl", "verl"}, {"transformers", "tokenizers"}),  # verl 0.9.1 needs transformers < 5.11; the image: 5.17
}
# a part's size by default: a device call carries at most 64 MiB with the working tree, which the device tool
# measured above 29 MB on 2026-11-28 (a 36 MiB part was refused, a 23 MiB one carried; run `git gc` too)
PART_MIB = 20


def closure(extras: set[str], leave_out: frozenset[str] = frozenset()) -> dict[str, str]:
    """name -> installed version of every distribution the project with `extras` needs, transitively (this venv's
    metadata; markers evaluated for this interpreter, with each requirement's extras), except `leave_out` and what
    only they need."""
    found: dict[str, str] = {}
    todo: list[tuple[str, frozenset[str]]] = [(PROJECT, frozenset(extras))]
    done: set[tuple[str, frozenset[str]]] = set()
    while todo:
        name, wanted = todo.pop()
        if (name, wanted) in done:
            continue
        done.add((name, wanted))
        dist = metadata.distribution(name)
        if name != PROJECT:
            found[name] = dist.version
        for line in dist.requires or []:
            requirement = Requirement(line)
            contexts = [{"extra": extra} for extra in wanted] or [{"extra": ""}]
            needed = requirement.marker is None or any(requirement.marker.evaluate(c) for c in contexts)
            if needed and canonicalize_name(requirement.name) not in leave_out:
                todo.append((canonicalize_name(requirement.name), frozenset(requirement.extras)))
    return found


def pinned(stack: str, leave_out: frozenset[str] = frozenset()) -> list[str]:
    """name==version of what `stack` needs that the GPU image lacks (or has in another version), without `leave_out`
    and what only they need."""
    extras, carried = STACKS[stack]
    return [
        f"{name}=={version.split('+')[0]}"
        for name, version in sorted(closure(extras, leave_out).items())
        if name not in ON_IMAGE or name in carried
    ]


def write_parts(tar: Path, out: Path, part_bytes: int) -> list[Path]:
    """`tar` cut into parts of `part_bytes`, and install.sh, which joins them and installs every wheel to its $1."""
    parts = []
    with tar.open("rb") as whole:
        while chunk := whole.read(part_bytes):
            parts.append(out / f"part{len(parts):02d}")
            parts[-1].write_bytes(chunk)
    script = out / "install.sh"
    script.write_text(
        "#!/usr/bin/env bash\n# Joins the parts beside it and installs their wheels to $1 (default /tmp/proj).\n"
        'set -euo pipefail\nhere=$(dirname "$0"); target=${1:-/tmp/proj}; mkdir -p "$here/wheels"\n'
        'cat "$here"/part* | tar -xf - -C "$here/wheels"\n'
        'python3 -m pip install -q --no-deps --no-index --target "$target" "$here"/wheels/*.whl\n'
    )
    return parts


def main(stack: str, out: Path, part_mib: int, leave_out: frozenset[str] = frozenset()) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        args = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                "--python-version", "3.12", "--implementation", "cp", "-d", tmp]  # fmt: skip
        for platform in PLATFORMS:
            args += ["--platform", platform]
        missing = []
        for requirement in pinned(stack, leave_out):
            if subprocess.run([*args, requirement], capture_output=True).returncode == 0:
                continue
            # no wheel on the index (antlr4-python3-runtime, which omegaconf needs): build it, pure Python
            build = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", tmp, requirement]
            if subprocess.run(build, capture_output=True).returncode:
                missing.append(requirement)
        whole = Path(tmp) / "wheels.tar"
        with tarfile.open(whole, "w") as tar:
            for wheel in sorted(Path(tmp).glob("*.whl")):
                tar.add(wheel, arcname=wheel.name)
        parts = write_parts(whole, out, part_mib * 2**20)
        size = whole.stat().st_size / 2**20
        wheels = len(list(Path(tmp).glob("*.whl")))
        print(f"{out}: {wheels} wheels, {size:.0f} MiB in {len(parts)} parts; not found: {missing or 'none'}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stack", choices=sorted(STACKS), default="trl", help="what the GPU runs import")
    parser.add_argument("out", type=Path, help="the folder for the parts and install.sh (git-ignored, e.g. .vc/trl)")
    parser.add_argument("--part-mib", type=int, default=PART_MIB, help="a part's size (MiB)")
    parser.add_argument(
        "--leave-out",
        action="append",
        default=[],
        metavar="NAME",
        help="a dependency no run there imports, left out with what only it needs (again for more)",
    )
    args = parser.parse_args()
    leave_out = frozenset(canonicalize_name(n) for n in args.leave_out)
    if unknown := leave_out - closure(STACKS[args.stack][0]).keys():
        parser.error(f"--leave-out {' '.join(sorted(unknown))}: not a dependency of the {args.stack} stack")
    main(args.stack, args.out, args.part_mib, leave_out)
