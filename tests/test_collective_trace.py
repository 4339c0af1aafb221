"""collective_trace input: detection by content, every line kind, the CSV export, summaries and hints."""
from __future__ import annotations

import gzip
import shutil
from pathlib import Path

import pandas as pd
import pytest
from conftest import shape_problems

from tracefuse_dask import TraceFormatError, analyze
from tracefuse_dask.cli import main
from tracefuse_dask.analysis.cross_rank.collective_trace import summarize
from tracefuse_dask.analysis.per_rank.collective_trace import looks_like_collective_trace, parse_collective_trace
from tracefuse_dask.analysis.schema import Summary

DATA = Path(__file__).parent / "data" / "collective_trace"
LOGS = sorted(DATA.glob("collective_trace.log-*"))
CSVS = sorted(DATA.glob("collective_trace_rank*.csv"))


def parse(path: Path, rank: int | None = None) -> pd.DataFrame:
    return parse_collective_trace(path.read_bytes(), str(path), rank)


def test_detection_by_content():
    for path in [*LOGS, *CSVS, *DATA.glob("coalesce.log-*")]:
        assert looks_like_collective_trace(path.read_bytes()), path
    assert not looks_like_collective_trace(b'{"traceEvents": [{"ph": "X", "name": "[TRACE] global rank 0"}]}')
    assert not looks_like_collective_trace(b"[TRACE] something else entirely\nhello\n")
    assert not looks_like_collective_trace(b"")


def test_every_line_kind_of_a_real_log():
    calls = parse(LOGS[2])
    assert set(calls["rank"]) == {2} and len(calls) == 3 * 7
    first = calls.iloc[0]
    assert (first["kind"], first["op"], first["group"], first["group_size"], first["shape"], first["dtype"]) == (
        "trace", "allreduce", "0-3", 4, "(4096,)", "torch.float32")
    assert first["duration_us"] == pytest.approx(3384.0) and first["bytes"] == 4096 * 4  # shape × dtype, not 0.02 MB
    assert calls[calls["shape"] == "(16,)"]["bytes"].iloc[0] == 16 * 4  # logged as "Size: 0.00 MB"
    sub = calls[calls["shape"] == "(24,)"]
    assert set(sub["group"]) == {"0,2"}  # the evens sub-group, known by its ranks
    assert calls[calls["shape"] == "(40,)"]["async_op"].all()
    batch = calls[calls["kind"] == "batch"].iloc[0]
    assert (batch["op"], batch["bytes"], batch["call_count"], batch["shape"]) == (
        "batch_isend_irecv", 64, 2, "send [(8,)] recv [(8,)]")
    barrier = calls[calls["kind"] == "barrier"]
    assert len(barrier) == 3 and barrier["duration_us"].iloc[0] == pytest.approx(4813.0)


def test_coalesce_lines_and_the_csv_export():
    co = parse(DATA / "coalesce.log-0").iloc[0]
    assert (co["kind"], co["op"], co["bytes"], co["call_count"], co["duration_us"]) == (
        "coalesce", "coalesced allreduce", 8192, 2, pytest.approx(1234.0))
    csv = parse(CSVS[2], rank=2)
    assert len(csv) == 3 * 6 and set(csv["rank"]) == {2}  # batch_isend_irecv is only logged
    first = csv.iloc[0]
    assert (first["op"], first["bytes"], first["shape"]) == ("allreduce", 16384, "(4096,)")
    assert first["duration_us"] == pytest.approx(3384.3089986476116) and first["timestamp"] > 0


def test_errors_name_the_file_and_line(tmp_path):
    with pytest.raises(TraceFormatError, match=r"empty\.log: no collective_trace lines"):
        parse_collective_trace(b"hello\nworld\n", "empty.log")
    bad = LOGS[0].read_bytes().splitlines()[0][:90] + b"\n"
    with pytest.raises(TraceFormatError, match=r"cut\.log: line 1 is a collective_trace TRACE line that does not "
                                               r"parse"):
        parse_collective_trace(bad, "cut.log")
    with pytest.raises(TraceFormatError, match=r"x\.csv: CSV line 2 has a bad duration"):
        parse_collective_trace(b"function,timestamp,duration,tensor_shape,tensor_dtype,tensor_size\n"
                               b"all_reduce,1.0,oops,(1,),torch.float32,4\n", "x.csv", 0)


@pytest.mark.parametrize("files", [LOGS, CSVS], ids=["logs", "csv"])
def test_summary_and_straggler_hint_point_at_the_slow_rank(files):
    calls = pd.concat([parse(p, rank=k) for k, p in enumerate(files)], ignore_index=True)
    summary, hints, verdict = summarize(calls)
    top = summary.iloc[0]
    assert (top["op"], top["shape"], top["count"], top["ranks"]) == ("allreduce", "(4096,)", 12, 4)
    assert top["total_us"] == pytest.approx(calls[calls["shape"] == "(4096,)"]["duration_us"].sum())
    assert verdict["rank"] == 2 and verdict["confidence"] >= 0.5 and "durations only" in verdict["evidence"]
    assert hints.set_index("rank")["others_waited_us"].idxmax() == 2


@pytest.mark.integration
def test_analyze_takes_collective_trace_logs(client, tmp_path, capsys):
    for p in LOGS:
        shutil.copy(p, tmp_path / p.name)
    a = analyze(str(tmp_path), client=client)
    assert shape_problems(a.summary, Summary) == []  # as schema.Summary declares it
    assert a.summary["collective_trace"]["files"] == 4 and a.summary["collective_trace"]["calls"] == 84
    assert a.summary["collective_trace"]["straggler_hint"]["rank"] == 2
    assert len(a.collective_trace_calls) == 84 and a.breakdown.empty
    out = tmp_path / "report"
    assert main(["analyze", str(tmp_path), "-o", str(out), "--workers", "1"]) == 0
    assert "collective_trace: 84 calls in 4 files; rank 2 probably arrives last" in capsys.readouterr().err
    assert "rank 2 probably arrives last" in (out / "report.html").read_text()
    assert len(pd.read_parquet(out / "collective_trace_summary.parquet")) == len(a.collective_trace_summary)
    for p in CSVS:  # the same run's CSV exports beside the logs do not count the calls twice
        shutil.copy(p, tmp_path / p.name)
    both = analyze(str(tmp_path), client=client)
    assert len(both.collective_trace_calls) == 84 and set(both.collective_trace_calls["kind"]) != {"csv"}
    assert sum("the CSV's calls were left out" in w for w in both.summary["warnings"]) == 4


def test_gzipped_logs_and_exports_are_recognised(client, tmp_path):
    for p in [LOGS[0], CSVS[1]]:
        (tmp_path / (p.name + ".gz")).write_bytes(gzip.compress(p.read_bytes(), mtime=0))
    a = analyze(str(tmp_path), client=client)
    calls = a.collective_trace_calls
    assert len(calls[calls["rank"] == 0]) == len(parse(LOGS[0]))
    assert len(calls[calls["rank"] == 1]) == len(parse(CSVS[1], rank=1))


def test_an_empty_table_summarises_as_grouping_it_would():
    """An empty table of plain columns takes a shortcut past pandas' grouping; a typed one keeps its types."""
    from tracefuse_dask.analysis.schema import CT_COLUMNS

    summary, hints, verdict = summarize(pd.DataFrame(columns=CT_COLUMNS))
    assert summary.empty and hints.empty and verdict["rank"] is None
    assert summary.dtypes.astype(str).to_dict() == {"op": "object", "shape": "object", "dtype": "object",
                                                    "group": "object", "count": "int64", "ranks": "int64",
                                                    "total_us": "object", "mean_us": "object", "max_us": "object",
                                                    "bytes": "object"}
    typed = summarize(pd.DataFrame(columns=CT_COLUMNS).astype({"duration_us": float}))[0]
    assert typed.empty and typed["total_us"].dtype == "float64"
