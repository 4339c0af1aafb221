"""The example scripts run as documented."""
from __future__ import annotations

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
