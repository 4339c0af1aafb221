"""``.ci/run`` runs each test once: the pass without ``../shared`` lists the tests that passed
(``TRACEFUSE_PASSED_TO``), and the pass with it leaves them out (``TRACEFUSE_PASSED_IN``); ``tests/conftest.py``."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent

CASES = '''
import pytest

@pytest.fixture
def breaks_after():
    yield
    raise RuntimeError("teardown")

def test_passes(): pass
def test_fails(): assert False
def test_skips(): pytest.skip("needs ../shared")
def test_passes_then_its_teardown_fails(breaks_after): pass
@pytest.mark.parametrize("p", [1, 2])
def test_param(p): assert p == 1
'''


def run(folder: Path, **env: str) -> subprocess.CompletedProcess:
    """The cases on two xdist workers, as scripts/test.sh runs the suite, with tests/conftest.py as a plugin."""
    return subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "-p", "conftest", "-p", "no:cacheprovider",
                           "-q", "-rA", str(folder / "test_cases.py")], cwd=folder, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(TESTS), **env}, timeout=300, check=False)


def test_the_second_pass_runs_only_what_did_not_pass_in_the_first(tmp_path):
    (tmp_path / "test_cases.py").write_text(CASES)
    listed = tmp_path / "passed"
    first = run(tmp_path, TRACEFUSE_PASSED_TO=str(listed))
    assert first.returncode == 1, first.stdout
    # a test whose teardown failed did not pass; a skipped test did not either
    assert listed.read_text().splitlines() == ["test_cases.py::test_param[1]", "test_cases.py::test_passes"]
    second = run(tmp_path, TRACEFUSE_PASSED_IN=str(listed))
    ran = {line.split()[1] for line in second.stdout.splitlines() if line.startswith(("PASSED", "FAILED", "ERROR"))}
    ran |= {"test_cases.py::test_skips" for line in second.stdout.splitlines() if line.startswith("SKIPPED")}
    # under xdist each worker collects, and leaves them out, so the controller counts no deselection
    assert ran == {"test_cases.py::test_fails", "test_cases.py::test_param[2]", "test_cases.py::test_skips",
                   "test_cases.py::test_passes_then_its_teardown_fails"}, second.stdout
