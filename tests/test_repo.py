"""The README's two commands are the set-up; CI runs the second one."""

from __future__ import annotations

import re

from tests.conftest import ROOT


def readme_commands() -> list[str]:
    block = re.search(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.DOTALL)
    assert block, "README.md must open with a bash block of commands"
    return [line.split("#")[0].strip() for line in block.group(1).splitlines() if line.split("#")[0].strip()]


def test_readme_opens_with_run_then_test() -> None:
    run, test = readme_commands()[:2]
    makefile = (ROOT / "Makefile").read_text()
    assert run == "make run" and "launch.py" in makefile.split("\nrun:")[1].split("\n\n")[0]
    assert test == "make test" and "pytest" in makefile


def test_ci_runs_the_readme_test_command() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    assert readme_commands()[1] in ci.splitlines()
