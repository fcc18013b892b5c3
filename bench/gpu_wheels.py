"""Wheels this project needs on the GPU machine, for benchmarks run there through the device tool.

The GPU machine (CPython 3.12, torch 2.11, transformers 5.17, peft, accelerate; no internet) lacks the rest of the
`trl` extra and the core (hydra, langgraph, trl, datasets, ...). This downloads, for CPython 3.12 on x86_64 Linux, the
exact versions installed in this machine's `.venv` minus what the GPU image already has, into one tar file:

    python bench/gpu_wheels.py .vc/project.tar          # ~1 min from the package index; git-ignore .vc/
    # there:  mkdir -p /tmp/proj && tar -xf .vc/project.tar -C /tmp/pw && \
    #         pip install -q --no-deps --no-index --target /tmp/proj /tmp/pw/*.whl
    #         export PYTHONPATH=/tmp/proj:/tmp/site  # /tmp/site: vLLM's bundle (bench/README.md)

/tmp/proj goes first on the path: vLLM's bundle carries openai 3, this project pins openai < 3 (vLLM accepts >= 2).
"""

from __future__ import annotations

import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

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


def pinned() -> list[str]:
    """name==version for every package of .venv that the GPU image lacks."""
    venv_python = Path(__file__).resolve().parent.parent / ".venv" / "bin" / "python"
    freeze = subprocess.run([str(venv_python), "-m", "pip", "freeze"], capture_output=True, text=True, check=True)
    out = []
    for line in freeze.stdout.splitlines():
        if "==" not in line or line.startswith(("-e", "#")):
            continue
        name, version = line.split("==")
        if name.lower().replace("_", "-") not in ON_IMAGE:
            out.append(f"{name}=={version.split('+')[0]}")
    return out


def main(target: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        args = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                "--python-version", "3.12", "--implementation", "cp", "-d", tmp]  # fmt: skip
        for platform in PLATFORMS:
            args += ["--platform", platform]
        missing = []
        for requirement in pinned():
            if subprocess.run([*args, requirement], capture_output=True).returncode == 0:
                continue
            # no wheel on the index (antlr4-python3-runtime, which omegaconf needs): build it, pure Python
            build = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", tmp, requirement]
            if subprocess.run(build, capture_output=True).returncode:
                missing.append(requirement)
        target.parent.mkdir(parents=True, exist_ok=True)
        with tarfile.open(target, "w") as tar:
            for wheel in sorted(Path(tmp).glob("*.whl")):
                tar.add(wheel, arcname=wheel.name)
        size = target.stat().st_size / 2**20
        print(f"{target}: {len(list(Path(tmp).glob('*.whl')))} wheels, {size:.0f} MiB; not found: {missing or 'none'}")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else ".vc/project.tar"))
