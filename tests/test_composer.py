"""Composer's traces and the Chrome array form: real traces of composer's own Trainer, Profiler and JSONTraceHandler
on 2 gloo CPU ranks (tests/data/composer, and how they were made), merged, analysed, described and diffed as a user
does, and merged the same as Composer's own ``merge_traces`` (the real one, from the composer package)."""
from __future__ import annotations

import gzip
import importlib.metadata
import importlib.util
import json
import os
import re
import subprocess
import sys
from collections import Counter
from decimal import Decimal
from pathlib import Path

import pytest

from perfetto_rules import assert_perfetto_rules, load_exact, ns
from tracefuse_dask.kineto.events import begin_end_pairs

pytestmark = pytest.mark.integration

DATA = Path(__file__).parent / "data" / "composer"
QUARTER_NS = 7_889_238 * 10**9  # Kineto's base is a multiple of this (libkineto output_json.h)
_PROCESS_M = ("process_name", "process_labels", "process_sort_index")


def tracefuse(*argv: str, cwd: Path | None = None, ok: bool = True) -> subprocess.CompletedProcess:
    """The CLI as a user runs it: a fresh process."""
    run = subprocess.run([sys.executable, "-m", "tracefuse_dask", *argv], capture_output=True, text=True,
                         cwd=cwd, timeout=300, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    if ok:
        assert run.returncode == 0, run.stderr
    return run


def texts() -> dict[int, bytes]:
    """The two ranks' files as Composer wrote them."""
    return {r: gzip.decompress((DATA / f"composer_rank{r}_ep0-ba5.json.gz").read_bytes()) for r in (0, 1)}


def write_job(folder: Path, files: dict[int, bytes]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for r, data in files.items():
        (folder / f"ep0-ba5-rank{r}.json").write_bytes(data)
    return folder


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> Path:
    return write_job(tmp_path_factory.mktemp("composer") / "traces", texts())


def events_of(data: bytes) -> list[dict]:
    return json.loads(data, parse_float=Decimal)


def meta(events: list[dict], name: str):
    return next(e["args"]["value"] for e in events if e["ph"] == "M" and e["name"] == name)


def kineto_base(events: list[dict]) -> int:
    """The rank's dropped baseTimeNanoseconds, told here from the Kineto ProfilerStep#N spans (relative µs): each
    holds the start or the end of a Composer ``event/batch`` (absolute µs), so the base is the quarter multiple
    that puts them there."""
    steps = [(ns(e["ts"]), ns(e["ts"]) + ns(e["dur"])) for e in events if e["name"].startswith("ProfilerStep#")]
    batches = [ns(e["ts"]) for e in events if e["name"] == "event/batch"]
    fits = [q * QUARTER_NS for q in range(200, 260)
            if all(any(s + q * QUARTER_NS <= b < t + q * QUARTER_NS for b in batches) for s, t in steps)]
    assert len(fits) == 1 and len(steps) == 3, (fits, steps)
    return fits[0]


def composer_merger():
    """Composer's own ``json_trace_merger`` module, from the installed composer package (scripts/test.sh installs
    it without its dependencies, which pin an old torch; the module itself imports only the standard library)."""
    try:
        files = importlib.metadata.files("composer") or []
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("composer is not installed: pip install --no-deps composer==0.32.1 (scripts/test.sh does)")
    path = next(f for f in files if str(f).endswith("profiler/json_trace_merger.py")).locate()
    spec = importlib.util.spec_from_file_location("composer_json_trace_merger", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def mark(i: int, e: dict) -> tuple:
    return i, e["ph"], e["pid"], e["tid"], e["ts"], e.get("name"), e.get("cat")


def key(rank: int, ev: dict, abs_ns: int) -> tuple:
    return (rank, ev["ph"], ev.get("cat"), ev.get("name"), abs_ns, ns(ev["dur"]) if "dur" in ev else None,
            ev["id"] & 0xFFFFFFFF if "id" in ev else None)


def test_our_merge_agrees_with_composers_own_merge(job, tmp_path):
    """The same events per rank at the same times, after the same clock-sync shift. Composer's merger leaves the
    torch profiler's events at their relative times (it never knew their base) and drops the events of a tid
    naming 'PyTorch Profiler'; tracefuse puts those events at their absolute times and keeps them."""
    theirs = tmp_path / "composer.json"
    composer_merger().merge_traces(str(theirs), *sorted(str(p) for p in job.glob("*.json")))
    run = tracefuse("merge", str(job), "-o", str(tmp_path / "ours.json"))
    inputs = {r: events_of(d) for r, d in texts().items()}
    syncs = {r: meta(evs, "clock_sync_timestamp_us") for r, evs in inputs.items()}
    bases = {r: kineto_base(evs) for r, evs in inputs.items()}
    assert syncs[0] != syncs[1] and len(set(bases.values())) == 1
    composer = Counter()
    for ev in events_of(theirs.read_bytes()):
        if ev["ph"] != "M":
            t = ns(ev["ts"])
            composer[key(ev["pid"], ev, t if t >= 10**17 else t + bases[ev["pid"]])] += 1
    merged = load_exact(tmp_path / "ours.json")
    pid_rank = assert_perfetto_rules(merged)
    base_out = merged["baseTimeNanoseconds"]
    ours = Counter(key(pid_rank[ev["pid"]], ev, base_out + ns(ev["ts"])) for ev in merged["traceEvents"]
                   if ev["ph"] != "M")
    dropped = Counter()
    for r, evs in inputs.items():
        shift = (syncs[0] - syncs[r]) * 1000
        for ev in evs:
            if ev["ph"] != "M" and "PyTorch Profiler" in str(ev.get("tid")):
                t = ns(ev["ts"])
                dropped[key(r, ev, (t if t >= 10**17 else t + bases[r]) + shift)] += 1
    assert composer and dropped and ours - composer == dropped and not composer - ours
    assert "clock_sync_timestamp_us to rank 0" in run.stderr and "4,338 µs" in run.stderr
    block = merged["metadata"]["tracefuse"]
    assert block["options"]["align"] == "clock-sync"
    assert block["clock_offsets_ns"] == {str(r): (syncs[r] - syncs[0]) * 1000 for r in inputs}
    assert {r: m["baseTimeNanoseconds"] for r, m in block["ranks"].items()} == {str(r): b for r, b in bases.items()}


def test_the_merge_keeps_pairs_flows_and_ranks_and_gzips(job, tmp_path, client):
    """Every input event is in the merge, on its rank's one process (Composer gave the rank as pid), B/E pairs
    on their thread as in the input, fwdbwd flows within the rank; the gzip output holds the same events; one
    worker and two give the same bytes."""
    from tracefuse_dask import merge_traces
    from tracefuse_dask.cluster import connect

    outs = {}
    for suffix in ("json", "json.gz"):
        merge_traces(str(job), str(tmp_path / f"two.{suffix}"), client=client)
        with connect(workers=1) as one:
            merge_traces(str(job), str(tmp_path / f"one.{suffix}"), client=one)
        assert (tmp_path / f"one.{suffix}").read_bytes() == (tmp_path / f"two.{suffix}").read_bytes(), suffix
        outs[suffix] = load_exact(tmp_path / f"two.{suffix}")
    assert outs["json"] == outs["json.gz"]
    merged = outs["json"]
    pid_rank = assert_perfetto_rules(merged)
    names = {e["pid"]: e["args"]["name"] for e in merged["traceEvents"] if e.get("name") == "process_name"}
    assert sorted(names.values()) == ["rank 0 · CPU (pid 0)", "rank 1 · CPU (pid 1)"]
    inputs = {r: events_of(d) for r, d in texts().items()}
    n_in = {r: sum(e["ph"] != "M" for e in evs) for r, evs in inputs.items()}
    assert Counter(pid_rank[e["pid"]] for e in merged["traceEvents"] if e["ph"] != "M") == n_in
    for r, evs in inputs.items():
        marks = [mark(i, e) for i, e in enumerate(evs) if e["ph"] in "BE"]
        out = [e for e in merged["traceEvents"] if e["ph"] in "BE" and pid_rank[e["pid"]] == r]
        out_marks = [mark(i, e) for i, e in enumerate(out)]
        pairs_in, pairs_out = begin_end_pairs(marks), begin_end_pairs(out_marks)
        assert [len(p) for p in pairs_in] == [len(p) for p in pairs_out] and pairs_in[0]
        named = [(evs[b]["name"], evs[b]["tid"]) for b, _ in pairs_in[0]]
        assert sorted(named) == sorted((out[b]["name"], out[b]["tid"]) for b, _ in pairs_out[0])
    flows = [e for e in merged["traceEvents"] if e.get("cat") == "fwdbwd"]
    assert len(flows) == sum(e.get("cat") == "fwdbwd" for evs in inputs.values() for e in evs) > 0


@pytest.mark.parametrize("ending", [b"", b",", b",\n  "])
def test_an_array_without_its_closing_bracket_is_a_whole_trace(job, tmp_path, ending):
    """The Chrome format lets the array lack its ``]``, after a last event, with or without a comma after it."""
    closed = tracefuse("merge", str(job), "-o", str(tmp_path / "closed.json"))
    files = texts()
    files[1] = files[1].rstrip()[:-1].rstrip() + ending
    open_job = write_job(tmp_path / "open", files)
    with pytest.raises(json.JSONDecodeError):
        json.loads(files[1])
    run = tracefuse("merge", str(open_job), "-o", str(tmp_path / "open.json"))
    assert (tmp_path / "open.json").read_bytes() == (tmp_path / "closed.json").read_bytes()
    assert "repaired" not in run.stderr + closed.stderr
    info = json.loads(tracefuse("info", str(open_job / "ep0-ba5-rank1.json"), "--json").stdout)
    assert (info["ranks"], info["events"]) == ([1], len(events_of(texts()[1])))


def test_a_file_cut_in_the_middle_of_an_event_is_truncated_and_repair_recovers_it(tmp_path):
    files = texts()
    cut = files[1][: len(files[1]) * 2 // 3]
    assert cut.rstrip()[-1:] not in (b"}", b",")
    files[1] = cut
    folder = write_job(tmp_path / "cut", files)
    for argv in (["merge", str(folder), "-o", str(tmp_path / "m.json")],
                 ["analyze", str(folder), "-o", str(tmp_path / "report")]):
        run = tracefuse(*argv, ok=False)
        assert run.returncode == 1 and "Traceback" not in run.stderr
        assert "ep0-ba5-rank1.json (rank 1): not valid JSON" in run.stderr and "truncated" in run.stderr
        assert not (tmp_path / "m.json").exists() and not (tmp_path / "report").exists()
    run = tracefuse("merge", str(folder), "-o", str(tmp_path / "m.json"), "--repair")
    whole = cut[: cut.rindex(b"},") + 1] + b"]"
    assert f"recovered {len(events_of(whole)):,} complete events" in run.stderr
    merged = load_exact(tmp_path / "m.json")
    pid_rank = assert_perfetto_rules(merged)
    assert sum(pid_rank[e["pid"]] == 1 and e["ph"] != "M" for e in merged["traceEvents"]) == sum(
        e["ph"] != "M" for e in events_of(whole))
    assert "distributedInfo came after the cut" not in run.stderr  # its global_rank came before


@pytest.mark.parametrize("text, kind", [(b"[1, 2, 3]", "ints"), (b'["a", "b"]', "strs"), (b"[[1], [2]]", "lists")])
def test_a_list_of_non_events_keeps_a_clear_error(tmp_path, text, kind):
    path = tmp_path / "in" / "rank0.json"
    path.parent.mkdir()
    path.write_bytes(text)
    for argv in (["merge", str(path), "-o", str(tmp_path / "m.json")], ["info", str(path)],
                 ["analyze", str(path), "-o", str(tmp_path / "report")]):
        run = tracefuse(*argv, ok=False)
        assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr
        assert "rank0.json" in run.stderr and f"the top level is a JSON list of {kind}, not of trace events" \
            in run.stderr, run.stderr
    assert not (tmp_path / "m.json").exists() and not (tmp_path / "report").exists()


def test_ranks_with_and_without_clock_sync(tmp_path):
    """auto aligns by the clock sync only when every rank has one; with some, a warning and base times alone;
    --align clock-sync then fails, --align base never shifts."""
    files = texts()
    syncs = {r: meta(events_of(d), "clock_sync_timestamp_us") for r, d in files.items()}
    line = next(ln for ln in files[1].splitlines() if b'"clock_sync_timestamp_us"' in ln)
    files[1] = files[1].replace(line + b"\n", b"")
    folder = write_job(tmp_path / "some", files)
    run = tracefuse("merge", str(folder), "-o", str(tmp_path / "auto.json"))
    assert "rank(s) 1 carry no clock_sync_timestamp_us and rank(s) 0 do; aligned every rank by its base time " \
           "alone" in run.stderr
    base = tracefuse("merge", str(folder), "-o", str(tmp_path / "base.json"), "--align", "base")
    assert "clock" not in base.stderr
    assert load_exact(tmp_path / "auto.json")["traceEvents"] == load_exact(tmp_path / "base.json")["traceEvents"]
    run = tracefuse("merge", str(folder), "-o", str(tmp_path / "sync.json"), "--align", "clock-sync", ok=False)
    assert run.returncode == 1 and "--align clock-sync: rank(s) 1 carry no clock_sync_timestamp_us" in run.stderr
    assert not (tmp_path / "sync.json").exists()
    full = write_job(tmp_path / "all", texts())
    tracefuse("merge", str(full), "-o", str(tmp_path / "full-base.json"), "--align", "base")
    tracefuse("merge", str(full), "-o", str(tmp_path / "full-sync.json"), "--align", "clock-sync")
    plain, synced = load_exact(tmp_path / "full-base.json"), load_exact(tmp_path / "full-sync.json")
    tracefuse("merge", str(full / "ep0-ba5-rank1.json"), "-o", str(tmp_path / "one.json"), "--align", "clock-sync")
    assert load_exact(tmp_path / "one.json")["metadata"]["tracefuse"]["options"]["align"] == "clock-sync"
    shift = (syncs[0] - syncs[1]) * 1000
    assert shift and plain["baseTimeNanoseconds"] == synced["baseTimeNanoseconds"]
    for a, b in zip(plain["traceEvents"], synced["traceEvents"]):
        if "ts" in a:
            assert ns(b["ts"]) - ns(a["ts"]) == (shift if a["pid"] >= 2**22 + 64 else 0)


def test_clock_sync_is_a_note_unless_its_error_bound_is_larger_than_its_shifts(tmp_path):
    """The alignment done as asked is a note; it is a warning when the ranks' clock_sync_error_bound (4,338 µs in
    these traces) is larger than the largest shift (20 µs): the shifts are then within the sync's error."""
    run = tracefuse("merge", str(write_job(tmp_path / "as-made", texts())), "-o", str(tmp_path / "a.json"))
    assert "warning: clock sync: aligned 2 ranks" in run.stderr and "note: clock sync" not in run.stderr
    assert "the shifts are within the clock sync's error bound, so the ranks may still be up to 4,338 µs apart" \
        in run.stderr
    bound = re.compile(rb'("name": "clock_sync_error_bound".*?"value": )\d+')
    files = {r: bound.sub(rb"\g<1>3", d) for r, d in texts().items()}
    assert files != texts()
    run = tracefuse("merge", str(write_job(tmp_path / "tight", files)), "-o", str(tmp_path / "t.json"),
                    "--summary-json")
    assert "note: clock sync: aligned 2 ranks" in run.stderr and "warning" not in run.stderr, run.stderr
    assert json.loads(run.stdout)["notes"][0].startswith("clock sync: aligned 2 ranks")


def test_the_rank_comes_from_global_rank_before_the_file_name(tmp_path):
    """distributedInfo.rank, then Composer's global_rank, then the name: names without a rank, a name that
    disagrees (a note says so), a file without global_rank (its name), and a {rank: path} dict (its key)."""
    files = texts()
    folder = tmp_path / "named"
    folder.mkdir()
    (folder / "trace-a.json").write_bytes(files[1])
    (folder / "trace-b.json").write_bytes(files[0])
    (folder / "rank3.json").write_bytes(files[1])
    (folder / "rank7.json").write_bytes(files[0].replace(b'"name": "global_rank"', b'"name": "no_rank"'))
    out = json.loads(tracefuse("info", str(folder / "trace-a.json"), str(folder / "trace-b.json"), "--json").stdout)
    assert sorted((r["path"].rsplit("/", 1)[1], r["rank"]) for r in out["per_rank"]) == [("trace-a.json", 1),
                                                                                      ("trace-b.json", 0)]
    run = tracefuse("merge", str(folder / "rank3.json"), str(folder / "rank7.json"), "-o", str(tmp_path / "m.json"))
    assert "rank3.json: the name says rank 3 but global_rank is 1; using 1" in run.stderr
    assert json.loads(tracefuse("info", str(folder / "rank7.json"), "--json").stdout)["ranks"] == [7]
    from tracefuse_dask import merge_traces

    summary = merge_traces({5: str(folder / "trace-a.json")}, str(tmp_path / "d.json"), workers=0)
    assert summary.rank_list == [5]


def test_analyze_pairs_b_and_e_and_counts_a_cut_b(tmp_path):
    """Rank 1 as a writer that died leaves it: the array cut after an event, no ``]``. Its B events without an E
    end at its last timestamp; the summary counts them, the ops table holds Composer's spans."""
    files = texts()
    lines = files[1].splitlines(keepends=True)
    opened = [k for k, ln in enumerate(lines) if b'"name": "event/batch"' in ln and b'"ph": "B"' in ln]
    keep = lines[: opened[-1] + 40]
    files[1] = b"".join(keep)
    folder = write_job(tmp_path / "job", files)
    run = tracefuse("analyze", str(folder), "-o", str(tmp_path / "report"), "--format", "csv")
    summary = json.loads((tmp_path / "report" / "summary.json").read_text())
    cut = events_of(b"".join(keep).rstrip().rstrip(b",") + b"]")
    pairs, unclosed, unopened = begin_end_pairs([mark(i, e) for i, e in enumerate(cut) if e["ph"] in "BE"])
    whole = events_of(texts()[0])
    pairs0, unclosed0, unopened0 = begin_end_pairs([mark(i, e) for i, e in enumerate(whole) if e["ph"] in "BE"])
    # a whole cycle's file still has two open spans: Composer's fit and epoch outlive the profiling cycle
    assert sorted(whole[b]["name"] for b in unclosed0) == ["event/epoch", "event/fit"]
    assert len(unclosed) > len(unclosed0) and "event/batch" in {cut[b]["name"] for b in unclosed}
    assert summary["begin_end"] | {"why": None} == {
        "pairs": len(pairs) + len(pairs0), "unclosed": len(unclosed) + len(unclosed0), "unclosed_ranks": [0, 1],
        "unopened": len(unopened) + len(unopened0), "why": None}
    assert f"{len(unclosed) + len(unclosed0)} B events without their E in rank(s) 0-1" in run.stderr
    import pandas as pd

    ops = pd.read_csv(tmp_path / "report" / "ops.csv")
    last = max(ns(e["ts"]) + ns(e.get("dur", 0)) for e in cut if e["ph"] != "M")
    for rank, evs, prs, open_ in ((0, whole, pairs0, []), (1, cut, pairs, unclosed)):
        spans = [ns(evs[e]["ts"]) - ns(evs[b]["ts"]) for b, e in prs if evs[b]["name"] == "event/batch"]
        spans += [last - ns(evs[b]["ts"]) for b in open_ if evs[b]["name"] == "event/batch"]
        row = ops[(ops["rank"] == rank) & (ops["name"] == "event/batch")].iloc[0]
        assert (row["count"], round(row["cpu_time_us"] * 1000)) == (len(spans), sum(spans))
    fit = ops[(ops["rank"] == 0) & (ops["name"] == "event/fit")].iloc[0]  # open to the end of the file
    last0 = max(ns(e["ts"]) + ns(e.get("dur", 0)) for e in whole if e["ph"] != "M")
    begun = next(ns(e["ts"]) for e in whole if e["name"] == "event/fit" and e["ph"] == "B")
    assert round(fit["cpu_time_us"] * 1000) == last0 - begun > 400e6
    diff = tracefuse("diff", str(tmp_path / "report"), str(folder), "-o", str(tmp_path / "diff"))
    assert json.loads((tmp_path / "diff" / "diff.json").read_text()), diff.stderr


def test_composers_own_merged_trace_beside_the_ranks_is_passed_over(tmp_path):
    """JSONTraceHandler writes merged_trace.json (Composer's merge) beside the rank files by default: a folder
    merge and analysis pass over it and say so; named on its own, it is an error that says what it is."""
    folder = write_job(tmp_path / "traces", texts())
    composer_merger().merge_traces(str(folder / "merged_trace.json"), *sorted(str(p) for p in folder.glob("ep*.json")))
    run = tracefuse("merge", str(folder), "-o", str(tmp_path / "m.json"))
    assert "merged_trace.json: a trace merged by Composer's merge_traces" in run.stderr
    assert sorted(load_exact(tmp_path / "m.json")["metadata"]["tracefuse"]["ranks"]) == ["0", "1"]
    run = tracefuse("analyze", str(folder), "-o", str(tmp_path / "report"))
    assert "merged_trace.json: a trace merged by Composer's merge_traces" in run.stderr
    for argv in (["merge", str(folder / "merged_trace.json"), "-o", str(tmp_path / "x.json")],
                 ["analyze", str(folder / "merged_trace.json"), "-o", str(tmp_path / "x")],
                 ["info", str(folder / "merged_trace.json")]):
        bad = tracefuse(*argv, ok=False)
        assert bad.returncode == 1 and "merged_trace.json: this is a trace merged by Composer's merge_traces" \
            in bad.stderr and "Traceback" not in bad.stderr, bad.stderr


def test_a_cut_gzip_of_an_array_is_repaired_and_says_so(tmp_path):
    """A gzip stream that ends early, after a whole event: without --repair an error, with it the complete events
    and a note (as for the object form), not a silent whole trace."""
    import zlib

    files = texts()
    text = files[1][: files[1].index(b"\n", len(files[1]) // 2) + 1]  # up to a whole event and its comma
    z = zlib.compressobj(9, zlib.DEFLATED, 31)
    files[1] = z.compress(text) + z.flush(zlib.Z_SYNC_FLUSH)  # no end of stream
    folder = write_job(tmp_path / "gz", files)
    run = tracefuse("merge", str(folder), "-o", str(tmp_path / "m.json"), ok=False)
    assert run.returncode == 1 and "corrupt or truncated gzip" in run.stderr
    run = tracefuse("merge", str(folder), "-o", str(tmp_path / "m.json"), "--repair")
    n = len(events_of(text.rstrip().rstrip(b",") + b"]"))
    assert "repaired a truncated trace: the gzip stream ends early" in run.stderr and f"recovered {n:,} complete" \
        in run.stderr


def test_the_window_counts_from_the_clock_synced_start(tmp_path):
    """--window starts at the earliest kept event after the clock-sync shift: a rank shifted earlier keeps its
    first events."""
    files = texts()
    evs = {r: events_of(d) for r, d in files.items()}
    ahead = meta(evs[1], "clock_sync_timestamp_us") + 10**6  # rank 1's clock 1 s ahead of its stamp's true time
    files[1] = files[1].replace(str(meta(evs[1], "clock_sync_timestamp_us")).encode(), str(ahead).encode())
    folder = write_job(tmp_path / "w", files)
    tracefuse("merge", str(folder), "-o", str(tmp_path / "all.json"))
    tracefuse("merge", str(folder), "-o", str(tmp_path / "win.json"), "--window", "0:100000")
    everything, windowed = load_exact(tmp_path / "all.json"), load_exact(tmp_path / "win.json")
    t0 = min(ns(e["ts"]) for e in everything["traceEvents"] if e["ph"] != "M")
    first = [e for e in everything["traceEvents"] if e["ph"] != "M" and ns(e["ts"]) == t0]
    assert first and all(e in windowed["traceEvents"] for e in first)


def test_analyze_takes_global_rank_from_an_object_form_trace(tmp_path):
    """Composer's merger reads a top-level global_rank in the object form too; so do merge and analyze."""
    folder = tmp_path / "obj"
    folder.mkdir()
    for name, rank in (("trace_a.json", 3), ("trace_b.json", 5)):
        (folder / name).write_text(json.dumps({"global_rank": rank, "traceEvents": [
            {"ph": "X", "cat": "cpu_op", "name": "aten::add", "pid": 1, "tid": 1, "ts": 100 + rank, "dur": 5}]}))
    run = tracefuse("analyze", str(folder), "-o", str(tmp_path / "report"))
    assert json.loads((tmp_path / "report" / "summary.json").read_text())["ranks"] == [3, 5], run.stderr
    tracefuse("merge", str(folder), "-o", str(tmp_path / "m.json"))
    assert sorted(load_exact(tmp_path / "m.json")["metadata"]["tracefuse"]["ranks"]) == ["3", "5"]
