"""End-to-end merges on a real process-based LocalCluster and on `dask scheduler`/`dask worker` processes."""
from __future__ import annotations

import functools
import gzip
import os
import subprocess
import sys
import tarfile
import threading
from pathlib import Path

import orjson
import pytest

from conftest import BASE, REAL_SETS, make_trace, shared, write_trace
from perfetto_rules import assert_inputs_kept, assert_perfetto_rules, load_exact
from tracefuse_dask import (
    MergeError,
    OutputExistsError,
    RankError,
    TraceFileNotFoundError,
    TraceFormatError,
    TraceFuse,
    merge_traces,
)
from tracefuse_dask.cluster import (
    batches,
    biggest_first,
    connect,
    flat,
    gathered,
    outcomes,
)
from tracefuse_dask.merge import assemble, plan, tasks
from tracefuse_dask.model import InputFile
from tracefuse_dask.programs import SMALL_INPUT_BYTES, small_input

pytestmark = pytest.mark.integration

SETS = ["gloo_4ranks", "gloo_2ranks_tb_nostraggler"] + [f"real/{s}" for s in REAL_SETS]


def inputs_of(folder: Path) -> dict[int, dict]:
    """The input documents by rank, read independently of the code under test."""
    docs = {}
    files = sorted(p for p in folder.iterdir() if p.name.endswith((".json", ".json.gz"))
                   and p.name != "generation_info.json")
    for order, p in enumerate(files):
        doc = load_exact(p)
        docs[(doc.get("distributedInfo") or {}).get("rank", order)] = doc
    return docs


def not_pyfunc(ev):
    return ev.get("cat") != "python_function"


@pytest.mark.parametrize("name", SETS)
def test_merge_shared_traces_on_local_cluster(name, client, tmp_path):
    folder = shared(*name.split("/"))
    inputs = inputs_of(folder)
    out = tmp_path / "merged.json.gz"
    files = {r: str(p) for r, p in zip(sorted(inputs), sorted(
        p for p in folder.iterdir() if p.name.endswith((".json", ".json.gz")) and p.name != "generation_info.json"))}
    # explicit list in name order: ranks come from distributedInfo, else the list order
    summary = merge_traces(list(files.values()), str(out), client=client)
    merged = load_exact(out)
    assert_perfetto_rules(merged)
    assert_inputs_kept(merged, inputs, keep=not_pyfunc)
    assert summary.ranks == len(inputs) and summary.events_out == len(merged["traceEvents"])
    assert not list(tmp_path.glob("*.tracefuse-tmp"))
    meta = merged["metadata"]["tracefuse"]
    assert sorted(meta["ranks"]) == sorted(str(r) for r in inputs)
    for r, doc in inputs.items():  # each rank's header, as its file has it
        assert {k: meta["ranks"][str(r)][k] for k in ("baseTimeNanoseconds", "distributedInfo", "deviceProperties",
                                                       "host_name")} == {
            k: doc.get(k) for k in ("baseTimeNanoseconds", "distributedInfo", "deviceProperties", "host_name")}
    bases = [d.get("baseTimeNanoseconds") for d in inputs.values()]
    assert merged["baseTimeNanoseconds"] == (min(bases) if None not in bases else 0)


@pytest.mark.parametrize("name", ["gloo_4ranks", "real/hta_trace_filter"])
def test_merge_on_dask_cli_cluster_is_byte_identical(name, scheduler_file, client, tmp_path):
    folder = shared(*name.split("/"))
    a, b = tmp_path / "local.json.gz", tmp_path / "cli.json.gz"
    merge_traces(str(folder), str(a), client=client)
    merge_traces(str(folder), str(b), scheduler_file=scheduler_file)
    assert a.read_bytes() == b.read_bytes()
    assert_perfetto_rules(load_exact(b))


def test_output_is_identical_with_one_and_two_workers(client, tmp_path):
    folder = shared("gloo_4ranks")
    one, two = tmp_path / "one.json", tmp_path / "two.json"
    merge_traces(str(folder), str(one), workers=1)
    merge_traces(str(folder), str(two), client=client)
    assert one.read_bytes() == two.read_bytes()


@pytest.mark.parametrize("env, expected", [
    ({}, [None, str(256 * 2**20), "1"]),
    ({"MALLOC_TRIM_THRESHOLD_": "131072", "MALLOC_TOP_PAD_": "0", "MALLOC_ARENA_MAX": "2"}, ["131072", "0", "2"]),
], ids=["dask-default-dropped", "environment-wins"])
def test_the_embedded_cluster_sets_its_workers_malloc(env, expected):
    """Dask's nannies set MALLOC_TRIM_THRESHOLD_=65536 in their workers; those tracefuse starts keep glibc's trimming
    but keep 256 MiB of freed memory for their next task (MALLOC_TOP_PAD_) in one arena (MALLOC_ARENA_MAX), unless
    the caller's environment says otherwise."""
    code = ("import os\nfrom tracefuse_dask.cluster import connect\nwith connect(workers=1) as c:\n"
            "    print(list(c.run(lambda: [os.environ.get(k) for k in ('MALLOC_TRIM_THRESHOLD_', 'MALLOC_TOP_PAD_', "
            "'MALLOC_ARENA_MAX')])"
            ".values()))")
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")} | env
    done = subprocess.run([sys.executable, "-c", code], env=environ, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == repr([expected])


@pytest.mark.parametrize("in_process", [False, True], ids=["worker-programs", "in-process"])
def test_the_embedded_clusters_workers_run_no_profiler(in_process):
    """Without a dashboard nobody sees Dask's statistical profile; it only interrupts the tasks every 10 ms."""
    code = ("from tracefuse_dask.cluster import connect\n"
            f"with connect(workers=1, in_process={in_process}) as c:\n"
            "    print(list(c.run(lambda dask_worker: sorted(dask_worker.periodic_callbacks)).values()))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    (callbacks,) = eval(done.stdout.splitlines()[-1])
    assert "heartbeat" in callbacks and not {"profile", "profile-cycle"} & set(callbacks)


def test_the_embedded_cluster_starts_no_dashboard():
    """Nobody is told its port, and Bokeh's server costs start-up time and memory; nor does it take :8787."""
    code = ("import sys\nfrom tracefuse_dask.cluster import connect\nwith connect(workers=1) as c:\n"
            "    print('bokeh' in sys.modules, c.scheduler_info()['services']['dashboard'])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    bokeh, http_port = done.stdout.split()[-2:]
    assert bokeh == "False" and int(http_port) != 8787  # the HTTP server (health, metrics) takes a free port


_OWN_CLIENT = """
import sys
import distributed
from tracefuse_dask import analyze, merge_traces
if __name__ == "__main__":
    with distributed.LocalCluster(n_workers=1, threads_per_worker=1, dashboard_address=":0") as cluster, \\
            distributed.Client(cluster, set_as_default=False) as c:
        summary = merge_traces(sys.argv[1], sys.argv[2], client=c, show_progress=True)
        analysis = analyze(sys.argv[1], client=c, show_progress=True)
        print(summary.ranks, sorted(analysis.breakdown["rank"]))
"""


def test_a_client_that_is_not_the_default_one_is_enough(tmp_path):
    """merge_traces and analyze wait, gather and show progress through the client they are given."""
    script = tmp_path / "own_client.py"
    script.write_text(_OWN_CLIENT)
    done = subprocess.run([sys.executable, str(script), str(shared("gloo_4ranks")), str(tmp_path / "m.json")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[-1] == "4 [0, 1, 2, 3]"
    assert load_exact(tmp_path / "m.json")["traceEvents"]


def test_a_cancelled_task_is_reported_as_cancelled():
    """A task cancelled under the merge (another client, a restart) gives CancelledError, not a TypeError."""
    import time

    from distributed import CancelledError, Client, LocalCluster

    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=":0") as cluster, \
            Client(cluster, set_as_default=False) as c:
        done, slow = c.submit(lambda: [("ok", None)], pure=False), c.submit(time.sleep, 3, pure=False)
        slow.cancel()
        got = outcomes(c, [done, slow])
        assert got[0] == ([("ok", None)], None) and isinstance(got[1][1], CancelledError)
        with pytest.raises(CancelledError):
            flat(got)


_released = threading.Event()


def _held() -> str:
    """A task that runs until ``_released`` is set (in this process: a cluster with ``processes=False``); a sleep
    would hold the cluster's close until it ended."""
    _released.wait(60)
    return "slow"


def test_gathered_gives_the_results_in_order_as_they_finish_and_stops_at_a_failure():
    """The analysis's results (megabytes a rank) are fetched as their tasks finish, in any order, and come back in
    the tasks' order; a failed task ends the wait with its error, as gather's does, not after the slow ones."""
    import time

    from distributed import Client, LocalCluster

    def late(value, seconds):
        time.sleep(seconds)
        return value

    def bad():
        raise ValueError("rank 3: bad trace")

    def fetched_meanwhile():  # whether this worker sent a result to the client while this task still ran
        from distributed import get_worker

        start = time.monotonic()
        while time.monotonic() - start < 20:
            if get_worker().transfer_outgoing_count_total:
                return True
            time.sleep(0.05)
        return False

    with LocalCluster(n_workers=1, threads_per_worker=2, processes=False, dashboard_address=":0") as cluster, \
            Client(cluster, set_as_default=False) as c:
        futures = [c.submit(fetched_meanwhile, pure=False), c.submit(late, "done", 0.5, pure=False)]
        assert gathered(c, futures) == [True, "done"]  # gather would fetch "done" only after both had finished
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address=":0") as cluster, \
            Client(cluster, set_as_default=False) as c:
        futures = [c.submit(late, "first", 1.5, pure=False), c.submit(late, "second", 0, pure=False)]
        assert gathered(c, futures) == ["first", "second"]
        _released.clear()
        futures = [c.submit(_held, pure=False), c.submit(bad, pure=False)]
        try:
            start = time.monotonic()
            with pytest.raises(ValueError, match="rank 3: bad trace"):
                gathered(c, futures, show_progress=True)
            assert time.monotonic() - start < 30
            assert not futures[0].done()
        finally:
            _released.set()
        futures[0].cancel()


def _request(**changes):
    fields = dict(out="m.json", options=plan.build_options(), storage_options={}, ranks=None,
                  rank_regex="rank(?P<rank>\\d+)", gzip_members="rank", on_error="raise", repair=False, align="base",
                  split=None, format="json", force=False, skip_if_unchanged=False, show_progress=False)
    return plan.MergeRequest(**{**fields, **changes})


@pytest.mark.parametrize("changes, message", [
    ({"gzip_members": "all"}, "gzip_members='all'; use 'rank' or 'single'"),
    ({"on_error": "ignore"}, "on_error='ignore'; use 'raise' or 'skip'"),
    ({"align": "ntp"}, "align='ntp'; use one of 'auto', 'base', 'clock-sync', 'collectives'"),
    ({"split": 0}, "split=0; give the number of output files"),
    ({"format": "zip"}, "format='zip'; use 'json' or 'perfetto-archive'"),
    ({"format": "perfetto-archive"}, "m.json: --format perfetto-archive writes a TAR archive"),
    ({"format": "perfetto-archive", "out": "m.tar", "split": 2}, "a perfetto archive already holds one trace"),
    ({"split": 2, "skip_if_unchanged": True}, "--skip-if-unchanged works with one output file"),
    ({"ranks": "3-1"}, "3-1"),
    ({"marks": {}, "split": 2}, "marks go into one merged JSON trace"),
    ({"marks": {}, "format": "perfetto-archive", "out": "m.tar"}, "marks go into one merged JSON trace"),
    ({"options": plan.build_options(counters=True)}, "counters=True needs the analysis's counter series"),
])
def test_a_merge_request_checks_itself_before_any_io(changes, message):
    with pytest.raises(MergeError) as err:
        _request(**changes)
    assert message in str(err.value)


def test_a_merge_request_derives_its_subset_and_split():
    request = _request(ranks="0-7:2")
    assert request.split == 1 and [r for r in range(10) if r in request.subset] == [0, 2, 4, 6]
    assert _request().subset is None


@pytest.mark.parametrize("sizes, limit, expected", [
    pytest.param([], 10, [], id="none"),
    pytest.param([20, 20, 20], 10, [[0], [1], [2]], id="big-ranks-alone"),
    pytest.param([3, 3, 3, 3, 3], 10, [[0, 1, 2, 3], [4]], id="small-ranks-share"),
    pytest.param([3, None, 3], 10, [[0, 1], [2]], id="unknown-size-counts-as-big"),
    pytest.param([1] * 2500, 10**9, [list(range(0, 1024)), list(range(1024, 2048)), list(range(2048, 2500))],
                 id="at-most-1024-ranks"),
    pytest.param([3, 3], 0, [[0], [1]], id="no-batching"),
])
def test_batches(sizes, limit, expected):
    assert [list(b) for b in batches(sizes, limit)] == expected


@pytest.mark.parametrize("sizes, expected", [
    pytest.param([], [], id="none"),
    pytest.param([5, 5, 5], [0, 1, 2], id="ties-keep-their-order"),
    pytest.param([4, 9, 4, 6], [1, 3, 0, 2], id="biggest-first"),
    pytest.param([3, None, 5], [1, 2, 0], id="unknown-size-counts-as-big"),
])
def test_biggest_first(sizes, expected):
    assert biggest_first(sizes) == expected


@pytest.mark.parametrize("files, small", [
    pytest.param([], True, id="none"),
    pytest.param([InputFile("a.json", SMALL_INPUT_BYTES // 2)] * 2, True, id="at-the-limit"),
    pytest.param([InputFile("a.json", SMALL_INPUT_BYTES + 1)], False, id="over"),
    pytest.param([InputFile("a.json.gz", SMALL_INPUT_BYTES // 8)], True, id="gzip-counts-8-times"),
    pytest.param([InputFile("a.JSON.GZ", SMALL_INPUT_BYTES // 8 + 1)], False, id="gzip-over"),
    pytest.param([InputFile("a.json", 10), InputFile("b.json")], False, id="an-unknown-size-is-not-small"),
])
def test_small_input(files, small):
    assert small_input(files) is small


def test_small_input_counts_a_cost_per_file():
    files = [InputFile("a.json", 1000)] * 64
    assert small_input(files, per_file=SMALL_INPUT_BYTES // 64 - 1000)
    assert not small_input(files, per_file=SMALL_INPUT_BYTES // 64 - 999)


def test_gzipped_ranks_are_grouped_by_the_trace_they_hold(client, tmp_path):
    """Eight gzipped ranks of about 4 MB of trace each (300 kB on disk) share tasks as 4 MB plain ranks would,
    not as 300 kB ones: by their size on disk all eight were one task, and one worker did the whole merge."""
    from distributed import get_task_stream

    from tracefuse_dask.synth import write_example

    paths = write_example(str(tmp_path / "in"), ranks=8, rank_bytes=4_000_000)
    files = [InputFile(p, os.path.getsize(p)) for p in paths]
    assert all(f.trace_bytes == 8 * f.size for f in files)
    with get_task_stream(client) as ts:
        merge_traces(str(tmp_path / "in"), str(tmp_path / "m.json.gz"), client=client)
    rewrites = {t["key"] for t in ts.data if str(t["key"]).startswith("tracefuse-rewrite")}
    assert len(rewrites) == len(batches([f.trace_bytes for f in files])) >= 4
    assert len(batches([f.size for f in files])) == 1


@pytest.mark.parametrize("size, workers, here", [
    pytest.param(1000, None, True, id="small"),
    pytest.param(SMALL_INPUT_BYTES + 1, None, False, id="big"),
    pytest.param(1000, 1, False, id="workers-given"),
])
def test_the_embedded_cluster_runs_small_inputs_in_this_process(size, workers, here):
    with connect(workers=workers, inputs=[InputFile("rank0.json", size)]) as c:
        assert (set(c.run(os.getpid).values()) == {os.getpid()}) is here


def _seen_by(folder: str, event: dict) -> bool:
    """A filter_fn that keeps every event and notes the process that ran it."""
    Path(folder, str(os.getpid())).touch()
    return True


def test_a_small_merge_runs_in_this_process_unless_workers_are_given(tmp_path):
    """Without ``workers``, its tasks run in threads of this process; ``workers=2`` starts worker programs.
    The output is the same (the filter's repr, folder included, is in its metadata)."""
    seen = tmp_path / "seen"
    seen.mkdir()
    pids, outputs = {}, {}
    for workers in (None, 2):
        out = tmp_path / f"merged-{workers}.json.gz"
        merge_traces(str(shared("gloo_4ranks")), str(out), workers=workers,
                     filter_fn=functools.partial(_seen_by, str(seen)))
        pids[workers], outputs[workers] = {p.name for p in seen.iterdir()}, out.read_bytes()
        for p in seen.iterdir():
            p.unlink()
    assert pids[None] == {str(os.getpid())}
    assert pids[2] and str(os.getpid()) not in pids[2]
    assert outputs[None] == outputs[2]


def test_the_biggest_rank_starts_first_and_the_output_keeps_rank_order(tmp_path):
    from distributed import get_task_stream

    from tracefuse_dask.cluster import connect
    from tracefuse_dask.synth import make_rank_trace

    sizes = [4_500_000, 4_500_000, 4_500_000, 13_500_000]  # each its own task (>= BATCH_BYTES); rank 3 last
    for r, size in enumerate(sizes):
        write_trace(tmp_path / "in" / f"rank{r}.json", make_rank_trace(r, 4, target_bytes=size, seed=r))
    # A cluster of its own: on the session's shared one this failed once in six full runs (the biggest task
    # started only after another had finished), likely from what earlier tests leave on it.
    with connect(workers=2) as client, get_task_stream(client) as ts:
        merge_traces(str(tmp_path / "in"), str(tmp_path / "m.json"), client=client)
    runs = [(ss["start"], ss["stop"]) for d in ts.data for ss in d["startstops"]
            if str(d["key"]).startswith("tracefuse-rewrite-") and ss["action"] == "compute"]
    assert len(runs) == 4
    big = max(runs, key=lambda r: r[1] - r[0])
    assert big[0] < min(stop for _, stop in set(runs) - {big}), runs  # in the first wave: it waited for none
    events = orjson.loads((tmp_path / "m.json").read_bytes())["traceEvents"]
    ranks = [(e["pid"] - 2**22) // 64 for e in events if e["ph"] != "M"]
    assert ranks == sorted(ranks) and set(ranks) == {0, 1, 2, 3}


@pytest.mark.parametrize("out", ["m.json", "m.json.gz"])
def test_batching_does_not_change_the_output(client, tmp_path, monkeypatch, out):
    folder = shared("gloo_4ranks")
    merge_traces(str(folder), str(tmp_path / f"batched-{out}"), client=client)
    monkeypatch.setattr(plan, "BATCH_BYTES", 1)  # every rank its own task, in the header pass and the rewrite
    monkeypatch.setattr(tasks, "BATCH_BYTES", 1)
    merge_traces(str(folder), str(tmp_path / f"alone-{out}"), client=client)
    assert (tmp_path / f"batched-{out}").read_bytes() == (tmp_path / f"alone-{out}").read_bytes()


def test_scattered_headers_write_the_same_output(client, tmp_path, monkeypatch):
    folder = shared("gloo_4ranks")
    merge_traces(str(folder), str(tmp_path / "inline.json"), client=client)
    monkeypatch.setattr(assemble, "_INLINE_HEADS", 0)  # as a big job's headers: scattered to the workers first
    merge_traces(str(folder), str(tmp_path / "scattered.json"), client=client)
    assert (tmp_path / "inline.json").read_bytes() == (tmp_path / "scattered.json").read_bytes()


def test_big_rank_metadata_reaches_every_output_but_not_the_client(client, tmp_path):
    """Process groups of a big job (here 200,000 ranks in the default group) go from Phase A's files into the
    merged header, each split part and each archive member; Phase A hands the client only where they lie."""
    world = 200_000
    ev = {"ph": "X", "cat": "cpu_op", "name": "op", "pid": 100, "tid": 100, "ts": 5.0, "dur": 1.0}
    docs = {}
    for r in range(3):
        info = {"backend": "nccl", "rank": r, "world_size": world, "pg_count": 2,
                "pg_config": [{"pg_name": "0", "pg_desc": "default_pg", "pg_size": world, "ranks": list(range(world))},
                              {"pg_name": "1", "pg_desc": "tp", "pg_size": 2, "ranks": [r, r + 1]}]}
        docs[r] = make_trace(r, [ev], distributedInfo=info, host_name=f"node{r}",
                             deviceProperties=[{"id": 0, "name": "GPU"}])
        write_trace(tmp_path / "in" / f"rank{r}.json", docs[r])
    files = [InputFile(str(tmp_path / "in" / f"rank{r}.json")) for r in range(3)]
    read = plan._read_headers(files, str(tmp_path / "meta.json"), None, None, False)
    for r, (h, err) in enumerate(read):
        assert err is None and h.header == {"distributedInfo": {"rank": r, "world_size": world}}
        path, offset, length = h.meta
        text = Path(path).read_bytes()[offset:offset + length]
        assert orjson.loads(text) == {k: docs[r].get(k) for k in ("distributedInfo", "deviceProperties", "host_name")}

    def ranks_meta(doc):
        return {int(r): {k: m[k] for k in ("distributedInfo", "deviceProperties", "host_name")}
                for r, m in doc["metadata"]["tracefuse"]["ranks"].items()}

    want = {r: {k: docs[r].get(k) for k in ("distributedInfo", "deviceProperties", "host_name")} for r in range(3)}
    for out in ("m.json", "m.json.gz"):
        merge_traces(str(tmp_path / "in"), str(tmp_path / out), client=client)
        assert ranks_meta(load_exact(tmp_path / out)) == want
    merge_traces(str(tmp_path / "in"), str(tmp_path / "s.json"), client=client, split=2)
    parts = sorted(tmp_path.glob("s.ranks-*.json"))
    assert [sorted(ranks_meta(load_exact(p))) for p in parts] == [[0], [1, 2]]
    assert {r: m for p in parts for r, m in ranks_meta(load_exact(p)).items()} == want
    merge_traces(str(tmp_path / "in"), str(tmp_path / "a.tar"), client=client, format="perfetto-archive")
    with tarfile.open(tmp_path / "a.tar") as tar:
        for r in range(3):
            member = orjson.loads(tar.extractfile(f"rank-{r:05d}.json").read())
            assert ranks_meta(member) == {r: want[r]}


def test_gzip_members_single_and_per_rank_hold_the_same_json(client, tmp_path):
    folder = shared("gloo_4ranks")
    plain, per_rank, single = tmp_path / "m.json", tmp_path / "r.json.gz", tmp_path / "s.json.gz"
    merge_traces(str(folder), str(plain), client=client)
    merge_traces(str(folder), str(per_rank), client=client)
    merge_traces(str(folder), str(single), client=client, gzip_members="single")
    assert gzip.decompress(per_rank.read_bytes()) == plain.read_bytes() == gzip.decompress(single.read_bytes())
    members = per_rank.read_bytes().count(b"\x1f\x8b\x08\x00\x00\x00\x00\x00")
    assert members >= 4 + 2  # header, one member per rank, separators, footer
    assert single.read_bytes().count(b"\x1f\x8b\x08\x00\x00\x00\x00\x00") == 1
    plain_single = tmp_path / "s.json"  # one member asked for, but the name says plain JSON
    merge_traces(str(folder), str(plain_single), client=client, gzip_members="single")
    assert plain_single.read_bytes() == plain.read_bytes()


def test_ranks_subset_and_different_bases_align(client, tmp_path):
    shift = 7889238 * 10**9  # the next Kineto base "quarter"
    events = [{"ph": "X", "cat": "cpu_op", "name": "op", "pid": 100, "tid": 100, "ts": 5.0, "dur": 1.0}]
    for r in range(4):
        base = BASE + (shift if r % 2 else 0)
        ts = 5.0 if r % 2 else 5.0 + shift / 1000
        ev = dict(events[0], ts=ts)
        write_trace(tmp_path / "in" / f"rank{r}.json", make_trace(r, [ev], base=base, world_size=4))
    out = tmp_path / "m.json"
    s = merge_traces(str(tmp_path / "in"), str(out), client=client, ranks="1-3:2,0")
    merged = load_exact(out)
    assert s.rank_list == [0, 1, 3]
    xs = [e for e in merged["traceEvents"] if e["ph"] == "X"]
    assert {e["ts"] for e in xs} == {5 + shift // 1000}  # all four absolute times are equal
    assert merged["baseTimeNanoseconds"] == BASE


def test_traces_without_a_base_keep_absolute_times(client, tmp_path):
    ev = {"ph": "X", "cat": "cpu_op", "name": "op", "pid": 1, "tid": 1, "ts": 1682725897226747, "dur": 3}
    write_trace(tmp_path / "rank0.json", make_trace(0, [ev], base=None, world_size=2))
    write_trace(tmp_path / "rank1.json", make_trace(1, [dict(ev, ts=1682725897226750)], base=None, world_size=2))
    out = tmp_path / "m.json"
    merge_traces([str(tmp_path / "rank0.json"), str(tmp_path / "rank1.json")], str(out), client=client)
    merged = load_exact(out)
    assert merged["baseTimeNanoseconds"] == 0
    assert sorted(e["ts"] for e in merged["traceEvents"] if e["ph"] == "X") == [1682725897226747, 1682725897226750]


def test_mixed_bases_use_the_earliest_event_floored_to_a_second(client, tmp_path):
    abs_us = (BASE + 2_500_000_000) // 1000
    write_trace(tmp_path / "rank0.json", make_trace(0, [{"ph": "X", "name": "a", "pid": 1, "tid": 1, "ts": 2500000.0,
                                                          "dur": 1.0}], world_size=2))
    write_trace(tmp_path / "rank1.json", make_trace(1, [{"ph": "X", "name": "b", "pid": 1, "tid": 1, "ts": abs_us,
                                                          "dur": 1.0}], base=None, world_size=2))
    out = tmp_path / "m.json"
    merge_traces(str(tmp_path), str(out), client=client)
    merged = load_exact(out)
    assert merged["baseTimeNanoseconds"] == BASE + 2_000_000_000
    assert {e["ts"] for e in merged["traceEvents"] if e["ph"] == "X"} == {500000}


def test_window_and_steps(client, tmp_path):
    folder = shared("gloo_4ranks")
    out = tmp_path / "steps.json"
    merge_traces(str(folder), str(out), client=client, steps="3-3")
    steps = {e["name"] for e in load_exact(out)["traceEvents"] if e["name"].startswith("ProfilerStep#")}
    assert steps == {"ProfilerStep#3"}
    win = tmp_path / "win.json"
    merge_traces(str(folder), str(win), client=client, window="0:5")
    merged = load_exact(win)
    ts = [e["ts"] for e in merged["traceEvents"] if e["ph"] != "M"]
    assert ts and max(ts) - min(ts) < 5000
    assert_perfetto_rules(merged)


def test_rank_from_file_name_and_regex(client, tmp_path):
    ev = [{"ph": "X", "name": "a", "pid": 1, "tid": 1, "ts": 1.0, "dur": 1.0}]
    write_trace(tmp_path / "in" / "host-a_w3.json.gz", make_trace(None, ev))
    write_trace(tmp_path / "in" / "host-b_w5.json", make_trace(None, ev))
    with pytest.raises(RankError, match="--rank-regex"):
        merge_traces(str(tmp_path / "in"), str(tmp_path / "m.json"), client=client)
    s = merge_traces(str(tmp_path / "in" / "*.json*"), str(tmp_path / "m.json"), client=client,
                     rank_regex=r"_w(?P<rank>\d+)")
    assert s.rank_list == [3, 5]


def test_gzip_is_detected_by_content(client, tmp_path):
    ev = [{"ph": "X", "name": "a", "pid": 1, "tid": 1, "ts": 1.0, "dur": 1.0}]
    p = tmp_path / "rank0.json"
    p.write_bytes(gzip.compress(__import__("orjson").dumps(make_trace(0, ev))))
    merge_traces(str(p), str(tmp_path / "m.json"), client=client)
    assert load_exact(tmp_path / "m.json")["traceEvents"][-1]["name"] == "a"


def test_duplicate_ranks_name_both_files(client, tmp_path):
    ev = [{"ph": "X", "name": "a", "pid": 1, "tid": 1, "ts": 1.0, "dur": 1.0}]
    write_trace(tmp_path / "a.json", make_trace(2, ev))
    write_trace(tmp_path / "b.json", make_trace(2, ev))
    with pytest.raises(RankError, match=r"rank 2 appears twice: .*a\.json and .*b\.json"):
        merge_traces(str(tmp_path / "*.json"), str(tmp_path / "out.json"), client=client)
    assert not (tmp_path / "out.json").exists() and not list(tmp_path.glob("*tracefuse-tmp"))


def test_mixed_world_sizes_are_refused_and_missing_ranks_warned(client, tmp_path):
    ev = [{"ph": "X", "name": "a", "pid": 1, "tid": 1, "ts": 1.0, "dur": 1.0}]
    write_trace(tmp_path / "r0.json", make_trace(0, ev, world_size=4))
    write_trace(tmp_path / "r1.json", make_trace(1, ev, world_size=8))
    with pytest.raises(RankError, match="different world sizes"):
        merge_traces([str(tmp_path / "r0.json"), str(tmp_path / "r1.json")], str(tmp_path / "o.json"), client=client)
    s = merge_traces([str(tmp_path / "r0.json")], str(tmp_path / "o.json"), client=client)
    assert s.warnings == ["3 of 4 ranks missing: 1-3"]


def test_output_exists_needs_force_and_own_outputs_are_skipped(client, tmp_path):
    folder = tmp_path / "traces"
    ev = [{"ph": "X", "name": "a", "pid": 1, "tid": 1, "ts": 1.0, "dur": 1.0}]
    for r in range(2):
        write_trace(folder / f"rank{r}.json", make_trace(r, ev, world_size=2))
    out = folder / "merged.json"
    merge_traces(str(folder), str(out), client=client)
    with pytest.raises(OutputExistsError, match="pass force=True to replace it"):
        merge_traces(str(folder), str(out), client=client)
    (folder / "merged.json.manifest.json").write_text("{}")
    s = merge_traces(str(folder), str(out), client=client, force=True)
    assert s.ranks == 2 and any("merged trace written by tracefuse" in i for i in s.ignored)
    assert any("manifest" in i for i in s.ignored)
    with pytest.raises(TraceFormatError, match="merged trace written by tracefuse"):
        merge_traces([str(out)], str(tmp_path / "again.json"), client=client)


def test_missing_input_is_a_file_not_found_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file"):
        merge_traces([str(tmp_path / "nope.json")], str(tmp_path / "o.json"))
    with pytest.raises(TraceFileNotFoundError, match="no trace files found"):
        merge_traces(str(tmp_path / "*.json"), str(tmp_path / "o.json"))


def test_tracefuse_api_with_list_and_dict(client, tmp_path):
    files = sorted(str(p) for p in shared("gloo_4ranks").glob("rank*.json.gz"))
    out = TraceFuse(files, client=client).merge_and_save(str(tmp_path / "list.json"))
    assert out == str(tmp_path / "list.json")
    by_dict = TraceFuse({10: files[0], 20: files[1]}, client=client)
    path = by_dict.merge_and_save(str(tmp_path / "dict.json.gz"), include_pyfunc=True)
    merged = load_exact(path)
    assert set(assert_perfetto_rules(merged).values()) == {10, 20}
    events = TraceFuse(files[:2], client=client).merge(filter_fn=lambda ev: ev.get("cat") != "cpu_op")
    assert events and not [e for e in events if e.get("cat") == "cpu_op"]
