"""The example scripts run as documented."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.mark.integration
def test_merge_example(tmp_path):
    done = subprocess.run([sys.executable, str(EXAMPLES / "merge_example.py"), str(tmp_path)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "8 ranks" in done.stdout and (tmp_path / "merged.json.gz").is_file()
    assert (tmp_path / "ranks_0_4.json.gz").is_file()


@pytest.mark.integration
def test_analyze_example(tmp_path):
    done = subprocess.run([sys.executable, str(EXAMPLES / "analyze_example.py"), str(tmp_path)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("rank 5 is the straggler") and (tmp_path / "report" / "report.html").is_file()


@pytest.mark.integration
def test_the_readme_quick_start_runs_and_runs_again(tmp_path):
    """The README's quick start, its line after the install as written, twice in a row from a shell whose PATH has
    this environment's ``tracefuse`` (what the install line's activation gives): both runs write the merge and the
    report; the second replaces the first's."""
    readme = (EXAMPLES.parent / "README.md").read_text()
    block = re.search(r"## Quick start\n\n```bash\n(.*?)```", readme, re.S).group(1).splitlines()
    assert block[0] == "python3 -m venv .venv && . .venv/bin/activate && pip install -e ." and \
        block[2] == "./scripts/test.sh"
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    for _ in range(2):
        done = subprocess.run(["bash", "-c", block[1]], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        assert "wrote demo/merged.json.gz" in done.stderr and "rank 5 is the straggler" in done.stderr
        assert "wrote demo/report/report.html" in done.stderr
