"""The event store (``tracefuse index``, ``tracefuse sql``, ``tracefuse_dask.query``): SQL over every shared real
job agrees with the same answers computed here straight from the JSON; stores on local disk, a real S3 server
(SeaweedFS) and a real GCS emulator (fake-gcs-server) answer alike; the same inputs give the same bytes whatever the
workers; overlapping, killed and incremental runs, truncated ranks and damaged stores end in a clean store or a
clear error."""
from __future__ import annotations

import collections
import functools
import gzip
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from decimal import Decimal
from pathlib import Path

import msgspec
import orjson
import pandas as pd
import pytest
from hypothesis import given, strategies as st

from conftest import REAL_SETS, read_trace, shared, shared_params, write_trace
from tracefuse_dask.store.schema import SCHEMA_VERSION

pytestmark = pytest.mark.integration

JOBS = shared_params([*REAL_SETS, "gloo_4ranks", "gloo_2ranks_tb_nostraggler"])
_COLLECTIVE = re.compile(r"^(c10d::|nccl:|rccl:|gloo:)")
_STEP = re.compile(r"ProfilerStep#(\d+)")


def _job(name: str) -> Path:
    return shared("real", name) if name in REAL_SETS else shared(name)


def tracefuse(*args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess:
    """The command line, in a process of its own, as a user runs it."""
    done = subprocess.run([sys.executable, "-m", "tracefuse_dask", *args], capture_output=True, text=True,
                          timeout=timeout)
    if check:
        assert done.returncode == 0, done.stderr
    return done


def _ns(us) -> int:
    return int(Decimal(repr(us)) * 1000)


def _is_kernel(e: dict) -> bool:
    """A kernel: a GPU's ``kernel`` event, or an MTIA's device event that is not a DMA (HTA's rule)."""
    cat = str(e.get("cat")).lower()
    return cat == "kernel" or (cat == "mtia_ccp_events" and not str(e.get("name")).startswith("dma"))


def _from_json(store: Path) -> dict[str, pd.DataFrame]:
    """The answers computed straight from each rank's JSON, with none of tracefuse's code: the events a merge keeps
    by default (all but python_function), kernels by their category, steps by the ProfilerStep#N that holds an
    event's start (a kernel: its launch's, found by its correlation)."""
    manifest = orjson.loads((store / "tracefuse-store.json").read_bytes())
    kernels, ops, collectives, by_name = [], [], collections.Counter(), collections.Counter()
    launch_ops = collections.Counter()
    for entry in manifest["ranks"]:
        rank = entry["rank"]
        events = [e for e in read_trace(Path(entry["file"]))["traceEvents"] if e.get("cat") != "python_function"]
        steps = sorted((_ns(e["ts"]), _ns(e["ts"]) + _ns(e["dur"]), int(m.group(1))) for e in events
                       if e.get("ph") == "X" and not str(e.get("cat")).lower().startswith("gpu_")
                       and (m := _STEP.fullmatch(str(e.get("name")))))
        launch = {e["args"]["correlation"]: e for e in events if e.get("ph") == "X" and not _is_kernel(e)
                  and isinstance(e.get("args"), dict) and "correlation" in e["args"]}

        def step_of(e, steps=steps, launch=launch):
            if _is_kernel(e) and (call := launch.get((e.get("args") or {}).get("correlation"))):
                e = call
            t = _ns(e["ts"])  # the host's step begun last among those that hold it
            return next((n for start, end, n in reversed(steps) if start <= t < end), None)

        ks = [e for e in events if e.get("ph") == "X" and _is_kernel(e)]
        ops_by_thread = collections.defaultdict(list)
        for i, e in enumerate(events):
            if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "Operator"):
                ops_by_thread[e["pid"], e.get("tid")].append((_ns(e["ts"]), -_ns(e["dur"]), i, e["name"]))
        for k in ks:  # the innermost CPU op around the call that launched the kernel, on the call's thread
            call = launch.get((k.get("args") or {}).get("correlation"))
            t = call and _ns(call["ts"])
            around = [o for o in ops_by_thread[call["pid"], call.get("tid")] if o[0] <= t < o[0] - o[1]] \
                if call else []
            launch_ops[max(around)[3] if around else None] += 1
        kernels.append((rank, len(ks), sum(_ns(e["dur"]) for e in ks)))
        ops.append((rank, sum(e.get("ph") == "X" and e.get("cat") == "cpu_op" for e in events)))
        for e in events:
            if e.get("ph") == "X" and (_COLLECTIVE.match(str(e.get("name")))
                                       or "Collective name" in (e.get("args") or {})):
                collectives[rank, step_of(e)] += 1
        for e in ks:
            by_name[e["name"]] += _ns(e["dur"])
    top = sorted(by_name.items(), key=lambda kv: (-kv[1], kv[0]))[:5]
    return {
        "kernels": pd.DataFrame([k for k in kernels if k[1]], columns=["rank", "n", "total_ns"]),
        "cpu_ops": pd.DataFrame([o for o in ops if o[1]], columns=["rank", "n"]),
        "collectives": pd.DataFrame([(r, s, n) for (r, s), n in sorted(collectives.items(), key=str)],
                                    columns=["rank", "step", "n"]),
        "top_kernels": pd.DataFrame(top, columns=["name", "total_ns"]),
        "launch_ops": pd.DataFrame(sorted(launch_ops.items(), key=lambda kv: (-kv[1], str(kv[0])))[:10],
                                   columns=["launch_op", "n"]),
    }


QUERIES = {
    "kernels": "SELECT rank, count(*) AS n, sum(dur_ns) AS total_ns FROM kernels GROUP BY rank ORDER BY rank",
    "cpu_ops": "SELECT rank, count(*) AS n FROM events WHERE ph = 'X' AND cat = 'cpu_op' GROUP BY rank ORDER BY rank",
    "collectives": "SELECT rank, step, count(*) AS n FROM events WHERE ph = 'X' AND (collective IS NOT NULL OR "
                   "regexp_matches(name, '^(c10d::|nccl:|rccl:|gloo:)')) GROUP BY rank, step "
                   "ORDER BY CAST(rank AS VARCHAR) || ', ' || coalesce(CAST(step AS VARCHAR), 'None')",
    "top_kernels": "SELECT name, sum(dur_ns) AS total_ns FROM kernels GROUP BY name ORDER BY total_ns DESC, name "
                   "LIMIT 5",
    "launch_ops": "SELECT launch_op, count(*) AS n FROM kernels GROUP BY launch_op "
                  "ORDER BY n DESC, coalesce(launch_op, 'None') LIMIT 10",
}


def _same(got: pd.DataFrame, want: pd.DataFrame, what: str) -> None:
    got = got.astype(object).where(got.notna(), None).reset_index(drop=True)
    want = want.astype(object).where(want.notna(), None).reset_index(drop=True)
    assert got.values.tolist() == want.values.tolist(), what


@pytest.fixture(scope="module")
def indexed(client, tmp_path_factory):
    """``indexed(name)``: the store of a shared job with the default options (made once, read by several tests)
    and the index's summary."""
    import tracefuse_dask as tf

    @functools.cache
    def store_of(name: str) -> tuple[Path, object]:
        store = tmp_path_factory.mktemp("indexed") / name
        return store, tf.index_traces(str(_job(name)), str(store), client=client)

    return store_of


@pytest.mark.parametrize("name", JOBS)
def test_sql_over_every_real_job_agrees_with_its_json(name, indexed):
    import tracefuse_dask as tf

    store, summary = indexed(name)
    assert summary.status == "ok" and summary.events_out > 0
    want = _from_json(store)
    assert len(want["kernels"]) + len(want["cpu_ops"]) > 0, "a job with neither kernels nor CPU ops"
    for what, sql in QUERIES.items():
        _same(tf.query(str(store), sql), want[what], f"{name}: {what}")
    # every step's span is its ProfilerStep's, and every kernel that has a launch has its op
    steps = tf.query(str(store), "SELECT count(*) AS n FROM steps WHERE end_ns <= start_ns")
    assert steps.n[0] == 0


def test_the_command_line_indexes_and_answers_in_every_format(tmp_path):
    job = _job("gloo_4ranks")
    store = tmp_path / "store"
    done = tracefuse("index", str(job), "-o", str(store), "--summary-json")
    assert "indexed 4 ranks" in done.stderr and f"wrote {store}" in done.stderr
    summary = json.loads(done.stdout)
    manifest = orjson.loads((store / "tracefuse-store.json").read_bytes())
    assert summary["status"] == "ok" and summary["ranks"] == 4 and summary["output"] == str(store)
    assert summary["events_out"] == sum(sum(r["rows"].values()) for r in manifest["ranks"]) > 0
    sql = "SELECT rank, count(*) AS ops FROM events WHERE cat = 'cpu_op' GROUP BY rank ORDER BY rank"
    table = tracefuse("sql", str(store), sql).stdout.splitlines()
    assert table[0].split() == ["rank", "ops"] and table[-1] == "(4 rows)"
    csv = tracefuse("sql", str(store), sql, "--format", "csv").stdout.splitlines()
    rows = json.loads(tracefuse("sql", str(store), sql, "--format", "json").stdout)
    assert csv[0] == '"rank","ops"' and [f'{r["rank"]},{r["ops"]}' for r in rows] == csv[1:]
    tracefuse("sql", str(store), sql, "--format", "parquet", "-o", str(tmp_path / "r.parquet"))
    assert pd.read_parquet(tmp_path / "r.parquet").to_dict("records") == rows
    assert [int(line.split()[1]) for line in table[1:-1]] == [r["ops"] for r in rows]


@pytest.mark.parametrize("sql, says", [
    ("SELEC 1", "Parser Error: syntax error"),
    ("SELECT * FROM kernel", "Table with name kernel does not exist"),
])
def test_bad_sql_gets_one_line_with_duckdb_s_message_and_the_tables(sql, says, tmp_path):
    store = tmp_path / "store"
    tracefuse("index", str(_job("gloo_2ranks_tb_nostraggler")), "-o", str(store), "-q")
    done = tracefuse("sql", str(store), sql, check=False)
    assert done.returncode == 1 and done.stdout == ""
    (line,) = done.stderr.splitlines()
    assert says in line and "tables: events, flows, kernels, steps, ranks" in line and "Traceback" not in line


def test_a_query_s_own_bad_file_is_not_blamed_on_the_store(tmp_path):
    store = tmp_path / "store"
    tracefuse("index", str(_job("gloo_2ranks_tb_nostraggler")), "-o", str(store), "-q")
    done = tracefuse("sql", str(store), f"SELECT * FROM read_parquet('{tmp_path}/nowhere.parquet')", check=False)
    assert done.returncode == 1 and "the query failed" in done.stderr and "part of the store" not in done.stderr


def test_what_is_not_a_store_or_another_version_says_how_to_make_or_rebuild_it(tmp_path):
    store = tmp_path / "store"
    done = tracefuse("sql", str(store), "SELECT 1", check=False)
    assert done.returncode == 1 and f"tracefuse index INPUT... -o {store}" in done.stderr
    tracefuse("index", str(_job("gloo_2ranks_tb_nostraggler")), "-o", str(store), "-q")
    manifest = orjson.loads((store / "tracefuse-store.json").read_bytes())
    (store / "tracefuse-store.json").write_bytes(orjson.dumps({**manifest, "schema_version": 99}))
    done = tracefuse("sql", str(store), "SELECT 1", check=False)
    assert done.returncode == 1 and "schema version 99" in done.stderr
    assert f"reads version {SCHEMA_VERSION}" in done.stderr
    assert f"tracefuse index INPUT... -o {store} --force" in done.stderr and "Traceback" not in done.stderr
    done = tracefuse("analyze", str(store), "-o", str(tmp_path / "report"), check=False)
    assert done.returncode == 1 and "schema version 99" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "report").exists()
    # a manifest whose ranks name no file, or that says nothing of what it was made from: one line, or the analysis
    (store / "tracefuse-store.json").write_bytes(orjson.dumps({**manifest, "ranks": [
        {k: v for k, v in r.items() if k != "file"} for r in manifest["ranks"]]}))
    done = tracefuse("analyze", str(store), "-o", str(tmp_path / "report"), check=False)
    assert done.returncode == 1 and "does not list its ranks' parts" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    (store / "tracefuse-store.json").write_bytes(orjson.dumps({**manifest, "made_from": None}))
    tracefuse("analyze", str(store), "-o", str(tmp_path / "report"), "-q")


def _files(store: Path) -> dict[str, bytes]:
    return {str(p.relative_to(store)): p.read_bytes() for p in sorted(store.rglob("*")) if p.is_file()}


def test_the_same_inputs_give_the_same_store_whatever_the_workers(client, tmp_path):
    import tracefuse_dask as tf

    job = _job("hta_trace_filter")
    tf.index_traces(str(job), str(tmp_path / "one"), workers=1)
    tf.index_traces(str(job), str(tmp_path / "two"), client=client)
    one, two = _files(tmp_path / "one"), _files(tmp_path / "two")
    assert one.keys() == two.keys() and all(one[k] == two[k] for k in one)


def test_skip_if_unchanged_indexes_only_the_ranks_whose_input_changed(tmp_path):
    job = tmp_path / "job"
    shutil.copytree(_job("gloo_4ranks"), job)
    store = tmp_path / "store"
    tracefuse("index", str(job), "-o", str(store), "-q")
    before = _files(store)
    done = tracefuse("index", str(job), "-o", str(store), "--skip-if-unchanged")
    assert done.stderr.startswith("unchanged:") and _files(store) == before
    rank2 = job / "rank2.json.gz"
    doc = read_trace(rank2)
    doc["traceEvents"] = [e for e in doc["traceEvents"] if e.get("name") != "aten::add_"]
    rank2.write_bytes(gzip.compress(orjson.dumps(doc)))
    done = tracefuse("index", str(job), "-o", str(store), "--skip-if-unchanged")
    assert "kept the parts of 3 ranks whose inputs did not change" in done.stderr
    after = _files(store)
    changed = {k.split("/")[1] for k in set(before) ^ set(after) if k.startswith("parts/")}
    assert sorted(c.split("-")[0] for c in changed) == ["000002", "000002"]  # rank 2's old part went, its new came
    import tracefuse_dask as tf

    adds = tf.query(str(store), "SELECT rank, count(*) AS n FROM events WHERE name = 'aten::add_' GROUP BY rank "
                                "ORDER BY rank")
    assert 2 not in adds["rank"].tolist() and len(adds) == 3


def test_a_truncated_rank_is_named_or_repaired(tmp_path):
    job = tmp_path / "job"
    shutil.copytree(_job("gloo_4ranks"), job)
    gz = job / "rank1.json.gz"
    bad = job / "rank1.json"
    raw = gzip.decompress(gz.read_bytes())
    bad.write_bytes(raw[: len(raw) * 2 // 3])  # cut in the middle of its events
    gz.unlink()
    store = tmp_path / "store"
    done = tracefuse("index", str(job), "-o", str(store), check=False)
    assert done.returncode == 1 and str(bad) in done.stderr and "--repair" in done.stderr
    assert "Traceback" not in done.stderr and not (store / "tracefuse-store.json").exists()
    done = tracefuse("index", str(job), "-o", str(store), "--repair")
    assert "recovered" in done.stderr or "repair" in done.stderr
    import tracefuse_dask as tf

    n = tf.query(str(store), "SELECT rank, count(*) AS n FROM events GROUP BY rank ORDER BY rank")
    assert n["rank"].tolist() == [0, 1, 2, 3] and n.n[0] > n.n[1] > 0


def test_a_missing_or_foreign_part_gets_a_clear_error_and_the_next_run_cleans_up(tmp_path):
    import tracefuse_dask as tf
    from tracefuse_dask.errors import StoreError

    job, store = _job("gloo_4ranks"), tmp_path / "store"
    tracefuse("index", str(job), "-o", str(store), "-q")
    (part,) = [p for p in (store / "parts").iterdir() if p.name.startswith("000001-")]
    (part / "events.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(StoreError, match="could not be read|the query failed") as e:
        tf.query(str(store), "SELECT count(*) FROM events")
    assert "events.parquet" in str(e.value)
    shutil.rmtree(part)
    with pytest.raises(StoreError, match="could not be read"):
        tf.query(str(store), "SELECT count(*) FROM events")
    stale = store / "parts" / ("000009-" + "0" * 32)  # named as a part: a dead run's, which no manifest lists
    stale.mkdir()
    (stale / "events.parquet").write_bytes(b"a dead run's")
    mine = store / "parts" / "notes.txt"  # not a part: somebody's, left alone
    mine.write_text("keep me")
    tracefuse("index", str(job), "-o", str(store), "-q", "--force")
    assert not stale.exists() and mine.read_text() == "keep me"
    assert tf.query(str(store), "SELECT count(DISTINCT rank) AS n FROM events").n[0] == 4


def test_overlapping_and_killed_runs_leave_a_whole_store(tmp_path):
    import tracefuse_dask as tf

    job, store = _job("hta_trace_filter"), tmp_path / "store"
    cmd = [sys.executable, "-m", "tracefuse_dask", "index", str(job), "-o", str(store), "-q", "--workers", "1",
           "--force"]
    killed = subprocess.Popen(cmd, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 120
    while not (store / "parts").exists() and killed.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    os.killpg(killed.pid, signal.SIGKILL)  # as its first part is written: the run and its workers
    killed.wait()
    assert not (store / "tracefuse-store.json").exists()
    runs = [subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True) for _ in range(3)]
    errs = [r.communicate(timeout=300)[1] for r in runs]
    assert all(r.returncode == 0 for r in runs), errs
    manifest = orjson.loads((store / "tracefuse-store.json").read_bytes())
    assert sorted(p.name for p in (store / "parts").iterdir()) == sorted(r["part"][6:] for r in manifest["ranks"])
    assert not list(tmp_path.glob("store.tracefuse-tmp/*"))
    n = tf.query(str(store), "SELECT count(*) AS n FROM events").n[0]
    assert n == sum(sum(r["rows"].values()) - r["rows"]["flows"] for r in manifest["ranks"])


@pytest.mark.parametrize("where", ["s3", "gcs"])
def test_object_storage_stores_answer_as_local_ones(where, request, bucket_name, client, tmp_path):
    import tracefuse_dask as tf

    server = request.getfixturevalue(where)
    server.bucket(bucket_name)
    job = _job("hta_trace_filter")
    local = tmp_path / "store"
    tf.index_traces(str(job), str(local), client=client)
    url = f"{where}://{bucket_name}/store"
    tf.index_traces(str(job), url, client=client, storage_options=server.options)
    for sql in QUERIES.values():
        _same(tf.query(url, sql, storage_options=server.options), tf.query(str(local), sql), f"{where}: {sql}")
    done = subprocess.run([sys.executable, "-m", "tracefuse_dask", "sql", url, QUERIES["kernels"], "--format", "csv",
                           "--storage-options", json.dumps(server.options)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[1:] == [f"{r.rank},{r.n},{r.total_ns}"
                                            for r in tf.query(str(local), QUERIES["kernels"]).itertuples()]
    got = tf.analyze(url, client=client, storage_options=server.options).tables()
    for name, table in tf.analyze(str(local), client=client).tables().items():
        pd.testing.assert_frame_equal(got[name], table, obj=f"{where}: {name}")


def test_docs_dask_example_gives_sql_s_p99_kernel_time_per_rank(client, tmp_path):
    """docs/store.md's example, as written there, on the user's cluster."""
    import dask.dataframe as dd

    import tracefuse_dask as tf

    tf.index_traces(str(_job("hta_trace_filter")), str(tmp_path / "store"), client=client)
    storage_options = None
    store = tf.open_store(str(tmp_path / "store"), storage_options)
    kernels = dd.read_parquet(store.files("events"), columns=["rank", "kind", "dur_ns"],
                              filters=[("kind", "==", "kernel")], storage_options=storage_options)
    p99 = kernels.groupby("rank").dur_ns.apply(lambda s: s.quantile(0.99), meta=("dur_ns", "f8")).compute()
    sql = tf.query(str(tmp_path / "store"), "SELECT rank, quantile_cont(dur_ns, 0.99) AS p99 FROM kernels "
                                            "GROUP BY rank ORDER BY rank")
    assert len(sql) == 2 and p99.sort_index().tolist() == sql.p99.tolist()
    assert "p99 = kernels.groupby(\"rank\").dur_ns.apply(lambda s: s.quantile(0.99), meta=(\"dur_ns\", \"f8\"))" \
        in (Path(__file__).parents[1] / "docs" / "store.md").read_text()


@pytest.mark.parametrize("name", shared_params(["hta_trace_filter", "tracelens_h100_qwen", "hta_mtia_inference"]))
def test_the_merge_s_fast_and_general_paths_write_the_same_rows(name, client, indexed, tmp_path):
    """A filter that keeps every event sends each rank down the merge's general path (dicts): its rows are the fast
    path's, column for column (``args`` the same JSON, written by another encoder)."""
    import tracefuse_dask as tf

    stores = {"fast": indexed(name)[0], "general": tmp_path / "general"}
    tf.index_traces(str(_job(name)), str(stores["general"]), client=client, filter_fn=lambda e: True)
    from tracefuse_dask.store.query import result

    def rows(store: str, sql: str) -> list[dict]:
        got = result(str(stores[store]), sql).to_pylist()
        for row in got:
            if row.get("args") is not None:
                row["args"] = orjson.loads(row["args"])
        return got

    sizes = []
    for sql in ("SELECT * FROM events ORDER BY rank, ts_ns, pid, tid, name, dur_ns",
                "SELECT * FROM flows ORDER BY rank, id, ph, ts_ns"):
        fast = rows("fast", sql)
        assert fast == rows("general", sql), f"{name}: {sql}"
        sizes.append(len(fast))
    assert sizes[0] > 0 and (sizes[1] > 0 or name == "hta_trace_filter")  # its sampled ranks have no flows


def test_a_folder_that_is_not_a_store_is_refused_and_what_is_in_it_stays(tmp_path):
    folder = tmp_path / "proj"
    (folder / "parts").mkdir(parents=True)
    (folder / "parts" / "notes.txt").write_text("precious")
    done = tracefuse("index", str(_job("hta_cpu_only")), "-o", str(folder), check=False)
    assert done.returncode == 1 and "is not a tracefuse store" in done.stderr and "--force" in done.stderr
    tracefuse("index", str(_job("hta_cpu_only")), "-o", str(folder), "-q", "--force")
    assert (folder / "parts" / "notes.txt").read_text() == "precious" and (folder / "tracefuse-store.json").exists()
    file = tmp_path / "a-file"
    file.write_text("x")
    for command in (["index", str(_job("hta_cpu_only")), "-o", str(file)], ["sql", str(file), "SELECT 1"]):
        done = tracefuse(*command, check=False)
        assert done.returncode == 1 and "Traceback" not in done.stderr and str(file) in done.stderr, done.stderr


def test_a_run_that_ends_after_another_finished_leaves_that_run_s_parts(tmp_path):
    """The tidy of a run that fails (or is stopped) after another run committed keeps the parts the store's
    manifest lists now, not only those of the manifest it started from."""
    import fsspec

    from tracefuse_dask.storage.runs import run_folder
    from tracefuse_dask.store.index import _tidy

    job, store = tmp_path / "job", tmp_path / "store"
    shutil.copytree(_job("gloo_4ranks"), job)
    tracefuse("index", str(job), "-o", str(store), "-q")
    old = orjson.loads((store / "tracefuse-store.json").read_bytes())
    tracefuse("index", str(job), "-o", str(store), "-q", "--force", "--include-pyfunc")
    new = orjson.loads((store / "tracefuse-store.json").read_bytes())
    assert {r["part"] for r in old["ranks"]}.isdisjoint(r["part"] for r in new["ranks"])
    with run_folder(str(store), None) as tmp_dir:  # a run that started from the old manifest, and failed
        _tidy(fsspec.filesystem("file"), str(store), tmp_dir, old, None)
    assert all((store / r["part"] / "events.parquet").exists() for r in new["ranks"])


def test_skip_if_unchanged_rebuilds_a_part_that_is_gone(tmp_path):
    import tracefuse_dask as tf

    store = tmp_path / "store"
    tracefuse("index", str(_job("gloo_4ranks")), "-o", str(store), "-q")
    before = tf.query(str(store), QUERIES["cpu_ops"])
    (part,) = [p for p in (store / "parts").iterdir() if p.name.startswith("000002-")]
    shutil.rmtree(part)
    (other,) = [p for p in (store / "parts").iterdir() if p.name.startswith("000003-")]
    (other / "flows.parquet").unlink()  # a part that lost one of its files
    done = tracefuse("index", str(_job("gloo_4ranks")), "-o", str(store), "--skip-if-unchanged")
    assert "kept the parts of 2 ranks" in done.stderr and part.exists() and (other / "flows.parquet").exists()
    _same(tf.query(str(store), QUERIES["cpu_ops"]), before, "after the rebuild")
    _same(tf.query(str(store), "SELECT rank, count(*) AS n FROM flows GROUP BY rank ORDER BY rank").iloc[:, :1],
          pd.DataFrame({"rank": [0, 1, 2, 3]}), "flows")


def test_answers_keep_exact_ns_and_every_format_writes_sums(tmp_path):
    import tracefuse_dask as tf

    store = tmp_path / "store"
    tracefuse("index", str(_job("gloo_4ranks")), "-o", str(store), "-q")
    sql = "SELECT ts_ns, step FROM events ORDER BY ts_ns NULLS FIRST, name LIMIT 40"
    got = tf.query(str(store), sql)
    from tracefuse_dask.store.query import result

    exact = result(str(store), sql).to_pylist()
    assert got["ts_ns"].isna().any() and [None if pd.isna(v) else int(v) for v in got["ts_ns"]] == \
        [r["ts_ns"] for r in exact]
    table = tracefuse("sql", str(store), sql).stdout
    assert all(str(r["ts_ns"]) in table for r in exact if r["ts_ns"] is not None) and ".0 " not in table
    total = json.loads(tracefuse("sql", str(store), "SELECT sum(dur_ns) AS s, sum(ts_ns) AS big FROM events",
                                 "--format", "json").stdout)
    exact = tf.query(str(store), "SELECT sum(dur_ns) AS s, CAST(sum(ts_ns) AS VARCHAR) AS big FROM events")
    assert total == [{"s": int(exact.s[0]), "big": exact.big[0]}]  # beyond 64 bits: its exact digits, as text


_US = st.one_of(st.none(), st.integers(-(2**43), 2**43).map(lambda n: n / 1000), st.floats(-9e15, 9e15),
                st.integers(-(10**16), 10**16), st.sampled_from([2.0**43, -(2.0**43), 8796093022207.999, 0.0005]),
                st.integers(0, 10**19).map(lambda ns: msgspec.Raw(b"%d.%03d" % divmod(ns, 1000))))


@given(st.lists(_US, max_size=30),
       st.sampled_from([0, 1790857026000000000, -(2**40), 2**63 - 10**16, 2**63 - 1, -(2**63)]))
def test_a_part_s_times_are_each_value_s_exact_ns_whatever_mix_of_types_it_holds(values, offset):
    """The store's ``ts_ns`` and ``dur_ns`` (``columns._ns_of``, which takes floats as arrays): each value as
    ``to_ns`` makes it, or as its exact text (the rewrite's raw µs), plus the offset, also near int64's limits
    (past which the sum is a Python int as before); None stays None."""
    from tracefuse_dask.kineto.times import to_ns
    from tracefuse_dask.store.columns import _ns_of

    def one(v):
        if v is None:
            return None
        return int(Decimal(bytes(v).decode()) * 1000) + offset if type(v) is msgspec.Raw else to_ns(v) + offset

    got = _ns_of(values, offset)
    assert got == [one(v) for v in values] and {type(v) for v in got} <= {int, type(None)}


def test_a_part_s_float_times_are_the_ns_of_their_decimal_text():
    """Floats of three-decimal µs up to 2**43 (a trace's times after its ``baseTimeNanoseconds``), as the store
    takes them (arrays): the ns their text says, plus the offset. ``round(v * 1000)`` is 1 ns off on about one in
    170 of those from 2**42 to 2**43 µs."""
    from tracefuse_dask.store.columns import _ns_of

    rng = random.Random(7)
    texts = [f"{rng.randrange(0, 2**43)}.{rng.randrange(1000):03d}" for _ in range(10000)] + \
        [f"{rng.randrange(2**42, 2**43)}.{rng.randrange(1000):03d}" for _ in range(10000)]
    values = [None if k % 7 == 0 else float(t) for k, t in enumerate(texts)]
    offset = 1790857026000000000
    assert _ns_of(values, offset) == [None if v is None else int(Decimal(t) * 1000) + offset
                                      for v, t in zip(values, texts)]


def test_an_id_beyond_int64_stays_in_args(tmp_path):
    import tracefuse_dask as tf

    doc = read_trace(_job("gloo_4ranks") / "rank0.json.gz")
    (first,) = [e for e in doc["traceEvents"] if e.get("ph") == "X"][:1]
    first.setdefault("args", {})["External id"] = 2**63 + 5
    (tmp_path / "job").mkdir()
    (tmp_path / "job" / "rank0.json").write_text(json.dumps(doc))  # orjson writes no int beyond 64 bits
    tracefuse("index", str(tmp_path / "job"), "-o", str(tmp_path / "store"), "-q")
    row = tf.query(str(tmp_path / "store"),
                   "SELECT external_id, args FROM events WHERE args LIKE '%9223372036854775813%'")
    assert len(row) == 1 and pd.isna(row.external_id[0])


def test_a_storage_server_that_dies_mid_index_fails_on_one_line_and_the_next_run_works(tmp_path):
    """SeaweedFS of its own, stopped (SIGTERM, then SIGKILL) as the first parts arrive: the run stops with one line
    naming the storage, leaves no manifest; once the server is back, the next run indexes every rank and tidies."""
    from conftest import S3Server

    import tracefuse_dask as tf

    doc = read_trace(_job("hta_trace_filter") / "sampled_rank-0.json.gz")
    job = tmp_path / "job"
    job.mkdir()
    for rank in range(40):
        doc["distributedInfo"].update(rank=rank, world_size=40)
        (job / f"rank{rank}.json").write_bytes(orjson.dumps(doc))
    server = S3Server(tmp_path / "weed")
    server.start()
    try:
        server.bucket("jobs")
        so = json.dumps(server.options)
        cmd = [sys.executable, "-m", "tracefuse_dask", "index", str(job), "-o", "s3://jobs/store", "--storage-options",
               so, "--storage-timeout", "10", "--workers", "1"]
        run = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
        fs, deadline = server.fs(), time.monotonic() + 120
        while run.poll() is None and time.monotonic() < deadline:
            fs.invalidate_cache()
            if fs.exists("jobs/store/parts"):
                break
            time.sleep(0.05)
        assert run.poll() is None, "the run ended before the server could be stopped"
        server.stop()
        _, err = run.communicate(timeout=180)
        assert run.returncode == 1 and "Traceback" not in err, err
        assert "cannot reach the storage" in err.splitlines()[-1] and server.url in err.splitlines()[-1]
        server.start()
        assert not server.fs().exists("jobs/store/tracefuse-store.json")
        done = subprocess.run(cmd[:-2] + ["--workers", "1", "-q"], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        manifest = orjson.loads(server.fs().cat("jobs/store/tracefuse-store.json"))
        fs = server.fs()
        assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls("jobs/store/parts")) == \
            sorted(r["part"][6:] for r in manifest["ranks"])
        n = tf.query("s3://jobs/store", "SELECT count(DISTINCT rank) AS n FROM events", storage_options=server.options)
        assert n.n[0] == 40
    finally:
        server.stop()


def _report(folder: Path) -> dict[str, bytes]:
    """A report or diff folder's files as a user compares them: ``summary.json`` without the run's seconds; the
    commit record, which hashes it, left out."""
    files = {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.name != "commit.json"}
    if "summary.json" in files:
        files["summary.json"] = orjson.dumps({k: v for k, v in orjson.loads(files["summary.json"]).items()
                                              if k != "seconds"})
    return files


def test_analyze_and_diff_of_stores_give_what_the_json_gives_and_never_read_it(tmp_path):
    """A job and the same job with its cutlass kernels 30% slower, each analysed and diffed from its JSON; then
    indexed, its traces moved away, and analysed and diffed from the stores: every table, summary.json (but its
    seconds), diff.json and the pages are the same bytes."""
    base, new = tmp_path / "base", tmp_path / "new"
    shutil.copytree(_job("hta_trace_filter"), base)
    new.mkdir()
    for src in sorted(base.glob("*.json.gz")):
        doc = read_trace(src)
        for e in doc["traceEvents"]:
            if e.get("cat") == "kernel" and "cutlass" in e.get("name", ""):
                e["dur"] = round(e["dur"] * 1.3, 3)
        write_trace(new / src.name, doc)
    tracefuse("analyze", str(base), "-o", str(tmp_path / "report-json"), "--format", "csv", "-q")
    tracefuse("diff", str(base), str(new), "-o", str(tmp_path / "diff-json"), "--format", "csv", "-q")
    for run in (base, new):
        tracefuse("index", str(run), "-o", str(tmp_path / f"{run.name}-store"), "-q")
        run.rename(tmp_path / f"{run.name}-gone")
    tracefuse("analyze", str(tmp_path / "base-store"), "-o", str(tmp_path / "report-store"), "--format", "csv",
              "-q")
    tracefuse("diff", str(tmp_path / "base-store"), str(tmp_path / "new-store"), "-o", str(tmp_path / "diff-store"),
              "--format", "csv", "-q")
    assert _report(tmp_path / "report-store") == _report(tmp_path / "report-json")
    assert _report(tmp_path / "diff-store") == _report(tmp_path / "diff-json")
    got = json.loads((tmp_path / "diff-store" / "diff.json").read_text())
    assert got["regressions"][0]["what"] == "kernel" and "cutlass" in got["regressions"][0]["name"]


def test_a_store_s_ranks_analyse_as_the_json_s_and_it_merges_no_trace(client, tmp_path):
    import tracefuse_dask as tf

    job, store = _job("gloo_4ranks"), tmp_path / "store"
    tf.index_traces(str(job), str(store), client=client)
    got = tf.analyze(str(store), client=client, ranks="1-2")
    want = tf.analyze(str(job), client=client, ranks="1-2")
    assert got.summary["ranks"] == [1, 2]
    for name, table in want.tables().items():
        pd.testing.assert_frame_equal(got.tables()[name], table, obj=name)
    done = tracefuse("analyze", str(store), "-o", str(tmp_path / "report"), "--critical-path-trace",
                     str(tmp_path / "path.json"), check=False)
    assert done.returncode == 1 and "the input is an event store, which keeps none" in done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "path.json").exists()
    assert not (tmp_path / "report").exists()


@pytest.mark.parametrize("name", JOBS)
def test_info_of_a_store_is_info_of_its_traces(name, client, indexed, tmp_path):
    """``info`` of a store, read from its manifest, gives what ``info`` gives of its traces, whichever of the
    merge's paths indexed them (``rewrite_ids`` takes the general one), and the same lines on the command line;
    but the account of a merge, which the index does not make (it places no slice on a lane)."""
    import tracefuse_dask as tf
    from tracefuse_dask.info import describe_traces

    job = _job(name)
    want = describe_traces(str(job), client=client)
    assert want["account"]["read"] == want["events"]
    want = {**want, "account": None, "per_rank": [{k: v for k, v in r.items() if k != "account"}
                                                  for r in want["per_rank"]]}
    general = tmp_path / "store"
    tf.index_traces(str(job), str(general), client=client, rewrite_ids=True)
    for store in (indexed(name)[0], general):
        assert describe_traces(str(store)) == want
    done = tracefuse("info", str(general))
    lines = tracefuse("info", str(job)).stdout.splitlines()
    merge = [line for line in lines if line.startswith(("a merge with the default options keeps ", "anomaly: "))]
    assert merge[0].startswith("a merge") and done.stdout.splitlines() == [line for line in lines if line not in merge]


@pytest.mark.parametrize("name", shared_params(["hta_trace_filter", "gloo_4ranks"]))
def test_analyze_store_writes_in_its_tasks_the_store_index_writes(name, tmp_path):
    """``analyze --store``: the report of a plain analyze, and the store of ``index --align base``, part for part
    and byte for byte, which that index then finds up to date and whose analysis is the report's."""
    job = _job(name)
    tracefuse("analyze", str(job), "-o", str(tmp_path / "plain"), "--format", "csv", "-q")
    done = tracefuse("analyze", str(job), "-o", str(tmp_path / "report"), "--format", "csv", "--store",
                     str(tmp_path / "store"))
    assert re.search(r"wrote .*store: the event store of \d+ ranks, [\d,]+ rows", done.stderr), done.stderr
    report = _report(tmp_path / "report")
    summary = orjson.loads(report.pop("summary.json"))
    assert summary.pop("store")["output"] == str(tmp_path / "store")
    plain = _report(tmp_path / "plain")
    assert orjson.loads(plain.pop("summary.json")) == summary
    assert {k: v for k, v in report.items() if k != "report.html"} == \
        {k: v for k, v in plain.items() if k != "report.html"}
    tracefuse("index", str(job), "-o", str(tmp_path / "indexed"), "--align", "base", "-q")
    assert _files(tmp_path / "store") == _files(tmp_path / "indexed")
    done = tracefuse("index", str(job), "-o", str(tmp_path / "store"), "--align", "base", "--skip-if-unchanged")
    assert "unchanged:" in done.stderr
    tracefuse("analyze", str(tmp_path / "store"), "-o", str(tmp_path / "from-store"), "--format", "csv", "-q")
    assert _report(tmp_path / "from-store") == plain | {"summary.json": _report(tmp_path / "plain")["summary.json"]}


def test_analyze_store_refuses_what_it_cannot_write_before_any_work_and_a_failure_leaves_no_store(tmp_path):
    job, store = _job("gloo_2ranks_tb_nostraggler"), tmp_path / "store"
    tracefuse("index", str(job), "-o", str(store), "-q")
    before = _files(store)
    for args, says in ((["--store", str(store)], "the store exists; pass --force"),
                       (["--store", str(tmp_path / "other"), "--skip-if-unchanged"], "skip_if_unchanged with store"),
                       ):
        done = tracefuse("analyze", str(job), "-o", str(tmp_path / "report"), *args, check=False)
        assert done.returncode == 1 and says in done.stderr and "Traceback" not in done.stderr, done.stderr
        assert not (tmp_path / "report").exists() and not (tmp_path / "other").exists()
    done = tracefuse("analyze", str(store), "-o", str(tmp_path / "report"), "--store", str(tmp_path / "other"),
                     check=False)
    assert done.returncode == 1 and "the input is an event store" in done.stderr
    assert _files(store) == before
    bad = tmp_path / "bad"
    shutil.copytree(job, bad)
    victim = sorted(bad.glob("*.json*"))[-1]
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    done = tracefuse("analyze", str(bad), "-o", str(tmp_path / "report"), "--store", str(tmp_path / "other"),
                     check=False)
    assert done.returncode == 1 and victim.name in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "other").exists() and not (tmp_path / "report").exists()


def test_a_tid_the_merge_makes_an_int_comes_back_as_read_where_that_int_names_it_alone(client, tmp_path):
    """Kineto 2021's pattern (real/kineto_2021_resnet50): CPU events on tid ``"7"`` and an ac2g flow on tid ``7``
    of one pid, a kernel without a correlation. The JSON's flow starts on no launch (``"7"`` is not ``7``), and the
    store's analysis must not bind it either, though the merge writes both as 7. Where one phase has both (a launch
    on ``"7"`` and one on ``7``), the store keeps them one, and its analysis says so."""
    import tracefuse_dask as tf
    from conftest import make_trace

    events = [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 10, "tid": "7", "ts": 100.0, "dur": 50.0},
              {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 10, "tid": "7", "ts": 110.0,
               "dur": 5.0, "args": {"correlation": 1}},
              {"ph": "X", "cat": "kernel", "name": "gemm", "pid": 0, "tid": "stream 3", "ts": 120.0, "dur": 30.0,
               "args": {"stream": 3, "correlation": 1}},
              {"ph": "s", "cat": "ac2g", "name": "ac2g", "pid": 10, "tid": 7, "ts": 110.0, "id": 9},
              {"ph": "X", "cat": "kernel", "name": "copyish", "pid": 0, "tid": "stream 3", "ts": 210.0, "dur": 10.0,
               "args": {"stream": 3}},
              {"ph": "f", "cat": "ac2g", "name": "ac2g", "pid": 0, "tid": "stream 3", "ts": 210.0, "id": 9,
               "bp": "e"}]
    both = events + [{"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 10, "tid": 7, "ts": 300.0,
                      "dur": 5.0}]
    for name, doc in (("one", events), ("both", both)):
        write_trace(tmp_path / name / "rank0.json", make_trace(0, doc))
        tf.index_traces(str(tmp_path / name), str(tmp_path / f"{name}.store"), client=client)
    want, got = (tf.analyze(str(tmp_path / p), client=client) for p in ("one", "one.store"))
    for name, table in want.tables().items():
        pd.testing.assert_frame_equal(got.tables()[name], table, obj=name)
    assert got.summary["warnings"] == want.summary["warnings"]
    said = [w for w in tf.analyze(str(tmp_path / "both.store"), client=client).summary["warnings"] if "tids" in w]
    assert said == [f"{tmp_path / 'both' / 'rank0.json'} (rank 0): the tids '7', 7 of pid 10's 'X' events are one "
                    "tid, 7, in the store, as in a merge; its analysis of them may differ from the trace's"]


def test_a_store_and_its_report_may_not_hold_one_another_and_a_corrupt_part_is_named(tmp_path):
    job, store = _job("gloo_2ranks_tb_nostraggler"), tmp_path / "store"
    for out, where in ((tmp_path / "x", tmp_path / "x"), (tmp_path / "x", tmp_path / "x" / "store"),
                       (tmp_path / "x" / "report", tmp_path / "x")):
        done = tracefuse("analyze", str(job), "-o", str(out), "--store", str(where), check=False)
        assert done.returncode == 1 and "is inside" in done.stderr and "written as a whole" in done.stderr, done.stderr
        assert not (tmp_path / "x").exists()
    tracefuse("index", str(job), "-o", str(store), "-q")
    part = sorted(store.glob("parts/*/events.parquet"))[0]
    part.write_bytes(part.read_bytes()[:100])
    done = tracefuse("analyze", str(store), "-o", str(tmp_path / "report"), check=False)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert f"{part.parent.name}/events.parquet, rank 0: not a whole Parquet file" in done.stderr
    assert "tracefuse index INPUT... -o STORE --force" in done.stderr and not (tmp_path / "report").exists()
