"""The README's two commands are the set-up; CI runs the second one, on xdist workers that keep a group together."""

from __future__ import annotations

import fcntl
import re
import subprocess
import sys
from pathlib import Path

import pytest

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


def test_the_pinned_pytest_and_xdist_keep_a_group_on_one_worker(tmp_path: Path) -> None:
    """`make test` runs `--dist loadgroup`: the tests of an `xdist_group` (one MariaDB server, one SLURM cluster) must
    run on one worker. pytest 9.2 silently drops xdist's group suffix (pytest-xdist#1386), spreading a group's tests
    over the workers, where two MariaDB servers then installed side by side and failed a CI run."""
    for name in ("a", "b"):
        (tmp_path / f"test_{name}.py").write_text(
            "import pytest\n\npytestmark = pytest.mark.xdist_group('together')\n\n"
            + "".join(f"def test_{i}():\n    pass\n\n" for i in range(4))
        )
    (tmp_path / "test_free.py").write_text("".join(f"def test_{i}():\n    pass\n\n" for i in range(4)))
    options = ["-n", "3", "--dist", "loadgroup", "-v", "-p", "no:cacheprovider", "-o", "addopts="]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", *options, str(tmp_path)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    ran = re.findall(r"^\[(gw\d+)\] .*?PASSED (\S+)", done.stdout, re.MULTILINE)
    assert len(ran) == 12, done.stdout[-2000:]
    grouped = {worker for worker, test in ran if "test_free" not in test}
    assert len(grouped) == 1, f"the group's 8 tests ran on {sorted(grouped)}:\n{done.stdout[-2000:]}"


def test_fixtures_that_install_packages_take_turns_with_apt(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """`apt-get update` in two workers at once fails at once (its lock does not wait): SLURM's cluster start and
    MariaDB's install each hold tests/conftest.py's apt lock while they may install (a CI run lost 5 SLURM tests so)."""
    import tests.conftest
    from tests import local_slurm, test_dbbench_mysql

    monkeypatch.setattr(tests.conftest, "APT_LOCK", tmp_path / "apt.lock")  # not the lock a running fixture holds
    monkeypatch.setattr(local_slurm, "LOCK", tmp_path / "slurm.lock")
    monkeypatch.setattr(local_slurm.os, "geteuid", lambda: 0)
    held: list[tuple[str, bool]] = []

    def apt_locked() -> bool:
        with (tmp_path / "apt.lock").open("w") as other:
            try:
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            fcntl.flock(other, fcntl.LOCK_UN)
            return False

    def run_cluster(command: str, nodes: int) -> subprocess.CompletedProcess[str]:
        held.append((command, apt_locked()))
        return subprocess.CompletedProcess([], 0, "", "")

    monkeypatch.setattr(local_slurm, "run_cluster", run_cluster)
    with local_slurm.local_cluster():
        held.append(("tests", apt_locked()))
    monkeypatch.setattr(test_dbbench_mysql, "_install_mariadb_locked", lambda: held.append(("mariadb", apt_locked())))
    test_dbbench_mysql._install_mariadb()
    assert held == [("start", True), ("tests", False), ("stop", False), ("mariadb", True)]
