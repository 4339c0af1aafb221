"""The benchmark scripts run, and compare rows the way they say they do."""
from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _common_module():
    spec = importlib.util.spec_from_file_location("benchmark_common", BENCHMARKS / "common.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_paired_takes_the_median_of_the_rounds_own_ratios():
    paired = _common_module().paired
    floor = [2.0, 1.0, 3.0]
    # Round by round the row is 1.25x, 0.5x and 1.5x the floor's speed; best against best would say 0.5x.
    assert paired(floor, [1.6, 2.0, 2.0]) == "1.25× (0.50-1.50)"
    assert paired(floor, floor) == "1.00×"
    assert paired(floor, [4.0]) == "0.25×"  # a row run once is compared with the floor's best


@pytest.mark.integration
def test_the_merge_benchmark_prints_its_table(tmp_path):
    out = tmp_path / "report.md"
    done = subprocess.run([sys.executable, str(BENCHMARKS / "merge.py"), "--ranks", "2", "--rank-mb", "0.2",
                           "--repeat", "2", "--no-naive", "--no-hta", "--tmp-dir", str(tmp_path), "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line for line in out.read_text().splitlines() if line.startswith("| ") and "2×0.2 MB" in line]
    assert [r.split(" | ")[0] for r in rows] == ["| orjson floor (GC on)", "| orjson floor (GC off)",
                                                  "| tracefuse merge → .json", "| tracefuse merge → .json.gz"]
    for row in rows[2:]:
        cells = row.split(" | ")
        assert re.fullmatch(r"\d+\.\d\d× \(\d+\.\d\d-\d+\.\d\d\)", cells[5]), row  # paired against the GC-off floor
        assert "→" in cells[-1] and "FAILED" not in row
    assert [p.name for p in tmp_path.iterdir()] == ["report.md"]  # the datasets and outputs are removed
