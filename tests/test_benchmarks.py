"""The benchmark scripts run, and compare rows the way they say they do."""
from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import SHARED

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
    done = subprocess.run([sys.executable, str(BENCHMARKS / "merge.py"), "--shapes", "synthetic", "--ranks", "2",
                           "--rank-mb", "0.2", "--repeat", "2", "--no-naive", "--no-hta", "--tmp-dir", str(tmp_path),
                           "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line for line in out.read_text().splitlines() if line.startswith("| ") and "2×0.2 MB" in line]
    assert [r.split(" | ")[0] for r in rows] == ["| orjson floor (GC on)", "| orjson floor (GC off)",
                                                  "| tracefuse merge → .json", "| tracefuse merge → .json.gz",
                                                  "| tracefuse merge --keep-overlaps → .json"]
    for row in rows[2:]:
        cells = row.split(" | ")
        assert re.fullmatch(r"\d+\.\d\d× \(\d+\.\d\d-\d+\.\d\d\)", cells[5]), row  # paired against the GC-off floor
        assert ("→" in cells[-1] or "no lanes" in cells[-1]) and "FAILED" not in row
    lanes = [line for line in out.read_text().splitlines() if line.startswith("Lanes (")]
    assert len(lanes) == 1 and re.search(r"synthetic 2×0\.2 MB: \d+\.\d\d× \(\d+\.\d\d-\d+\.\d\d\) \(0 slices on lanes\)",
                                         lanes[0]), lanes
    assert [p.name for p in tmp_path.iterdir()] == ["report.md"]  # the datasets and outputs are removed


needs_real_shapes = pytest.mark.skipif(
    not (SHARED.parent / "tools" / "make_dataset.py").is_file() or not (SHARED / "real").is_dir(),
    reason="../shared/tools/make_dataset.py or ../shared/traces/real is missing beside the repository")


@pytest.mark.integration
@needs_real_shapes
def test_the_merge_benchmark_measures_each_real_shape_against_its_own_floor(tmp_path):
    out = tmp_path / "report.md"
    done = subprocess.run([sys.executable, str(BENCHMARKS / "merge.py"), "--shapes", "a100,h100,b200", "--ranks", "2",
                           "--rank-mb", "0.2", "--repeat", "2", "--no-naive", "--no-hta", "--tmp-dir", str(tmp_path),
                           "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = out.read_text().splitlines()
    rows = [line.split(" | ") for line in report if line.startswith("| ") and " 2×" in line]
    # one source window per rank is more than 0.2 MB, so the dataset says what make_dataset.py wrote
    assert [(r[0], r[1].split(" ")[0]) for r in rows] == [
        (row, shape) for shape in ("a100", "h100", "b200")
        for row in ("| orjson floor (GC on)", "| orjson floor (GC off)", "| tracefuse merge → .json",
                    "| tracefuse merge → .json.gz", "| tracefuse merge --keep-overlaps → .json")]
    gc_off = {}
    for cells in rows:
        assert "FAILED" not in " | ".join(cells), cells
        if cells[0] == "| tracefuse merge --keep-overlaps → .json":
            assert cells[-1].startswith("no lanes"), cells  # the lanes' cost, not the merge: not in the worst
        elif cells[0].startswith("| tracefuse"):
            assert re.fullmatch(r"\d+\.\d\d× \(\d+\.\d\d-\d+\.\d\d\)", cells[5]), cells  # its own GC-off floor
            assert re.search(r"header pass \d+% of the merge, reads [\d,]+ kB per file", cells[-1]), cells
            gc_off[f"{cells[1]}, {cells[0][2:]}"] = cells[5]
        elif cells[0] == "| orjson floor (GC off)":
            assert cells[5] == "1.00×"  # each shape's rows are against that shape's floor
    low = min(float(v.split("×")[0]) for v in gc_off.values())
    worst = [k for k, v in gc_off.items() if float(v.split("×")[0]) == low]  # rows that tie as printed
    assert any(report[-1].endswith(f"rounds): {k}: {gc_off[k]}") for k in worst), report[-1]
    assert [p.name for p in tmp_path.iterdir()] == ["report.md"]


@pytest.mark.integration
@needs_real_shapes
def test_the_analysis_benchmark_analyses_each_real_shape(tmp_path):
    """A row per dataset with tracefuse's time and memory, in the cluster and as a whole process; without HTA its
    columns say why they are empty."""
    out = tmp_path / "report.md"
    done = subprocess.run([sys.executable, str(BENCHMARKS / "analyze.py"), "--ranks", "2", "--rank-mb", "0.3",
                           "--shapes", "a100,b200", "--real", str(tmp_path / "none"),
                           "--hta-python", str(tmp_path / "no-python"), "--repeat", "2", "--tmp-dir", str(tmp_path),
                           "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split(" | ") for line in out.read_text().splitlines() if line.startswith("| ") and " 2×" in line]
    # a real shape's files are plain .json; one source window per rank is more than 0.3 MB (make_dataset.py)
    assert [r[0].split(" (")[0] for r in rows] == ["| synthetic 2×0.3 MB", "| a100 2×0.3 MB", "| b200 2×0.3 MB"] * 2
    for cells in rows[:3]:
        assert cells[1] == "2" and re.fullmatch(r"\d+\.\d\d", cells[3]), cells  # both ranks analysed, timed
        assert cells[4] == "–" and "HTA skipped" in cells[-1], cells
    for cells in rows[3:]:  # the whole process: its seconds and its CPU; HTA's columns empty
        assert cells[1] == "2" and re.fullmatch(r"\d+\.\d\d", cells[3]) and re.fullmatch(r"\d+%", cells[4]), cells
        assert cells[5] == "–" and "HTA skipped" in cells[-1], cells
    assert [p.name for p in tmp_path.iterdir()] == ["report.md"]


@pytest.mark.integration
@needs_real_shapes
def test_the_scale_benchmark_measures_memory_on_a_real_shape(tmp_path):
    """The memory rows of --shape a100: as many ranks as asked, over 8 distinct real-shape ranks, within the bound."""
    out = tmp_path / "report.md"
    done = subprocess.run([sys.executable, str(BENCHMARKS / "scale.py"), "--memory-ranks", "8,16", "--rank-mb", "1",
                           "--shape", "a100", "--small-ranks", "20", "--small-kb", "10", "--tmp-dir", str(tmp_path),
                           "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split(" | ") for line in out.read_text().splitlines() if "MB (a100)" in line]
    assert [r[0] for r in rows] == ["| 8 × 1 MB (a100)", "| 16 × 1 MB (a100)"]
    assert all(r[-1] == "yes |" for r in rows), rows
    # the small ranks are cut from the real shape from its first collective call: the analysed job has calls
    job = [line.split(" | ") for line in out.read_text().splitlines() if "-rank job" in line]
    assert len(job) == 1 and int(job[0][-1].rstrip(" |").replace(",", "")) > 0, job
    assert [p.name for p in tmp_path.iterdir()] == ["report.md"]


@pytest.mark.integration
def test_the_cli_benchmark_times_fresh_processes(tmp_path):
    out = tmp_path / "report.md"
    done = subprocess.run([sys.executable, str(BENCHMARKS / "cli.py"), "--repeat", "2", "--tmp-dir", str(tmp_path),
                           "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split(" | ") for line in out.read_text().splitlines() if "example 8 × 1 MB" in line]
    assert [r[0] for r in rows] == ["| tracefuse merge (CLI, embedded cluster)", "| naive TraceLens-style (python -c)"]
    assert re.fullmatch(r"\d+\.\d\d× \(\d+\.\d\d-\d+\.\d\d\)", rows[0][4]) and rows[1][4].startswith("1.00×")
    assert re.search(r"`tracefuse --version`: \d+\.\d\d s", out.read_text())
    assert [p.name for p in tmp_path.iterdir()] == ["report.md"]


@pytest.mark.integration
@needs_real_shapes
def test_the_rank_task_benchmark_pairs_this_checkout_with_the_commit_before(tmp_path):
    """A row per checkout and shape: the baseline's and this checkout's task time, the ratio, and the op groups and
    launches each checkout found (the one before the op performance models has neither)."""
    out = tmp_path / "report.md"
    done = subprocess.run([sys.executable, str(BENCHMARKS / "rank_task.py"), "--shapes", "h100", "--ranks", "1",
                           "--rank-mb", "0.3", "--repeat", "2", "--baseline", "45604ca", "--tmp-dir", str(tmp_path),
                           "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split(" | ") for line in out.read_text().splitlines() if line.startswith("| h100")]
    assert [r[1] for r in rows] == ["baseline 45604ca", "this checkout"]
    assert rows[0][-2:] == ["-", "- |"] and re.fullmatch(r"\d+ \(\d+\)", rows[1][-2]), rows
    assert re.fullmatch(r"[\d,]+ \|", rows[1][-1]) and rows[1][-1] != "0 |", rows
    assert re.fullmatch(r"\d+\.\d\d× \(\d+\.\d\d-\d+\.\d\d\)", rows[1][5]), rows
    assert [p.name for p in tmp_path.iterdir()] == ["report.md"]


@pytest.mark.integration
@needs_real_shapes
def test_the_merge_baseline_benchmark_pairs_this_checkout_with_the_commit_before(tmp_path):
    """A row per checkout: the merge's time at the commit before issue 48 and here, and the paired ratio."""
    out = tmp_path / "report.md"
    done = subprocess.run([sys.executable, str(BENCHMARKS / "merge_baseline.py"), "--shapes", "a100", "--ranks", "2",
                           "--rank-mb", "0.3", "--repeat", "2", "--tmp-dir", str(tmp_path), "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split(" | ") for line in out.read_text().splitlines() if line.startswith("| a100")]
    assert [r[1] for r in rows] == ["baseline 3fb2f81^", "this checkout"], rows
    assert rows[0][5] == "1.00× (1.00-1.00) |" and re.fullmatch(r"\d+\.\d\d× \(\d+\.\d\d-\d+\.\d\d\) \|", rows[1][5])
    assert [p.name for p in tmp_path.iterdir()] == ["report.md"]


@pytest.mark.integration
@needs_real_shapes
def test_the_index_benchmark_pairs_the_index_with_the_merge(tmp_path):
    """Per shape a merge row and an index row, the ratio, the store's size and the query's time; the small ranks'
    cost per rank; nothing left behind."""
    out = tmp_path / "report.md"
    done = subprocess.run([sys.executable, str(BENCHMARKS / "index.py"), "--shapes", "a100", "--ranks", "2",
                           "--rank-mb", "1", "--repeat", "2", "--small-ranks", "20", "--small-kb", "10",
                           "--tmp-dir", str(tmp_path), "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    text = out.read_text()
    rows = [line.split(" | ")[0] for line in text.splitlines() if line.startswith("| ") and "a100" in line]
    assert rows == ["| merge → .json.gz", "| index → store", "| analyze ← .json.gz", "| analyze ← store",
                    "| analyze --store ← .json.gz", "| merge → .json.gz", "| index → store"], rows
    assert re.search(r"- a100: the index takes \d+\.\d\d× the merge's time \(rounds [\d.]+-[\d.]+\); the store is "
                     r"[\d.]+ MB, [\d.]+× the [\d.]+ MB of gzipped JSON; p99 kernel time per rank over it answers in "
                     r"[\d.]+ s", text), text
    assert re.search(r"- a100: analyze from the store takes \d+\.\d\d× analyze from the JSON \(rounds [\d.]+-[\d.]+\); "
                     r"analyze --store takes \d+\.\d\d× analyze from the JSON", text), text
    assert re.search(r"- 20 ranks of 10 kB: the index takes [\d.]+ ms per rank", text), text
    assert [p.name for p in tmp_path.iterdir()] == ["report.md"]
