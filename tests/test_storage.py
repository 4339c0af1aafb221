"""Object storage: merges from and to real S3 (SeaweedFS) and GCS (fake-gcs-server) servers on 127.0.0.1."""
from __future__ import annotations

import datetime as dt
import errno
import json
import os
import shutil
import threading
import time
from pathlib import Path

import aiohttp
import orjson
import pytest

from conftest import S3_KEY, S3_SECRET, S3Server, make_trace, shared, write_trace
from perfetto_rules import assert_perfetto_rules, load_exact
from tracefuse_dask import (
    MergeError,
    StorageAccessError,
    StorageConnectionError,
    TraceFileNotFoundError,
    merge_traces,
)
from tracefuse_dask.cli import main
from tracefuse_dask.storage.files import options_for, redact
from tracefuse_dask.storage.joins import MIN_PART, plan_groups, write_group
from tracefuse_dask.synth import make_rank_trace, write_example

MB = 2**20


@pytest.mark.parametrize(
    "sizes, groups",
    [
        pytest.param([10, 6 * MB, 20], [[0, 1], [2]], id="header-joins-a-big-part"),
        pytest.param([10, 1 * MB, 2 * MB, 3 * MB, 5], [[0, 1, 2, 3], [4]], id="small-parts-grouped"),
        pytest.param([6 * MB, 7 * MB, 9], [[0], [1], [2]], id="big-parts-alone"),
        pytest.param([10, 20], [[0, 1]], id="all-small-one-group"),
    ],
)
def test_plan_groups(sizes, groups):
    pieces = [b"x" * n if n < 100 else ("p", n) for n in sizes]
    got = plan_groups(pieces)
    assert got == groups
    assert all(sum(sizes[i] for i in g) >= MIN_PART for g in got[:-1])


@pytest.mark.parametrize("kernel_copy", [None, errno.EXDEV, "partial", errno.ENOSPC],
                         ids=["kernel", "no-kernel-copy", "refused-midway", "disk-full"])
def test_write_group_joins_local_files(tmp_path, monkeypatch, kernel_copy):
    """Local partitions are copied by the kernel; where it cannot (from the start or midway), through a
    buffer; a real error stops it."""
    import fsspec

    parts = []
    for i, n in enumerate([3, 0, 5 * MB + 7]):
        p = tmp_path / f"part-{i}"
        p.write_bytes(bytes(range(256)) * (n // 256) + b"x" * (n % 256))
        parts.append((str(p), n))
    pieces = [b"HEAD", parts[0], parts[1], b"MID", parts[2], b"FOOT"]
    want = b"HEAD" + Path(parts[0][0]).read_bytes() + b"MID" + Path(parts[2][0]).read_bytes() + b"FOOT"
    if kernel_copy == "partial":
        real, copied = os.copy_file_range, []

        def refuse(src, dst, count):  # 1000 bytes a call; past 2000 in all, it refuses (in the big part)
            if sum(copied) >= 2000:
                raise OSError(errno.EXDEV, os.strerror(errno.EXDEV))
            copied.append(real(src, dst, min(count, 1000)))
            return copied[-1]
        monkeypatch.setattr(os, "copy_file_range", refuse)
    elif kernel_copy is not None:
        def refuse(*args):
            raise OSError(kernel_copy, os.strerror(kernel_copy))
        monkeypatch.setattr(os, "copy_file_range", refuse)
    dest = str(tmp_path / "out")
    if kernel_copy == errno.ENOSPC:
        with pytest.raises(OSError, match="No space"):
            write_group(fsspec.filesystem("file"), pieces, dest)
        return
    assert write_group(fsspec.filesystem("file"), pieces, dest) == len(want)
    assert Path(dest).read_bytes() == want


# the 60 s default bound on a stall, over s3fs's 5 tries of botocore's 2, less their waits (6.9 s)
_BOUNDED = {"config_kwargs": {"connect_timeout": 5, "read_timeout": pytest.approx(5.31),
                              "retries": {"max_attempts": 1, "mode": "standard"}}}
# the 60 s default bound over gcsfs's 6 tries, less their waits (36 s)
_GCS_BOUNDED = {"requests_timeout": aiohttp.ClientTimeout(sock_connect=4.0, sock_read=4.0)}


@pytest.mark.parametrize(
    "url, so, expected",
    [
        ("s3://b/k", {"anon": True}, {"anon": True, **_BOUNDED}),
        ("s3://b/k", {"s3": {"anon": True}, "gs": {"token": "anon"}}, {"anon": True, **_BOUNDED}),
        ("gs://b/k", {"s3": {"anon": True}, "gs": {"token": "anon"}}, {"token": "anon", **_GCS_BOUNDED}),
        ("gcs://b/k", {"gs": {"token": "anon"}}, {"token": "anon", **_GCS_BOUNDED}),
        ("/tmp/x", {"s3": {"anon": True}}, {}),
        ("/tmp/x", {"anon": True}, {"anon": True}),
        ("s3://b/k", {"client_kwargs": {"endpoint_url": "http://x"}},
         {"client_kwargs": {"endpoint_url": "http://x"}, **_BOUNDED}),
        ("s3a://b/k", None, _BOUNDED),
        pytest.param("s3://b/k", {"config_kwargs": {"retries": {"max_attempts": 9}, "read_timeout": 600}},
                     {"config_kwargs": {"connect_timeout": 5, "read_timeout": 600, "retries": {"max_attempts": 9}}},
                     id="the-user's-settings-win"),
        pytest.param("s3://b/k", {"storage_timeout": 20}, {"config_kwargs": {
            "connect_timeout": pytest.approx(1.31), "read_timeout": pytest.approx(1.31),
            "retries": {"max_attempts": 1, "mode": "standard"}}}, id="--storage-timeout"),
        pytest.param("s3://b/k", {"storage_timeout": 3}, {"config_kwargs": {
            "connect_timeout": 1.0, "read_timeout": 1.0, "retries": {"max_attempts": 1, "mode": "standard"}}},
                     id="never-under-a-second"),
    ],
)
def test_options_for(url, so, expected):
    """S3 gets each try's wait for a byte from the bound on a stall (storage.files.stall_wait), which
    --storage-options overrides key by key; GCS its requests_timeout."""
    assert options_for(url, so) == expected


def test_a_gcs_wait_for_a_byte_of_the_users_wins():
    mine = aiohttp.ClientTimeout(total=5)
    assert options_for("gs://b/k", {"requests_timeout": mine})["requests_timeout"] is mine


@pytest.mark.parametrize("entry, expected", [
    pytest.param({"mtime": 1795709123.5}, 1795709123.5, id="local"),
    pytest.param({"LastModified": dt.datetime(2026, 11, 26, 16, 5, 23, 500000, tzinfo=dt.timezone.utc)},
                 1795709123.5, id="s3"),
    pytest.param({"updated": "2026-11-26T16:05:23.500000Z"}, 1795709123.5, id="gcs-text"),
    pytest.param({"name": "x"}, None, id="none"),
])
def test_a_lease_s_age_comes_from_each_storage_s_listing(entry, expected):
    from tracefuse_dask.storage.runs import _mtime

    assert _mtime(entry) == expected


def test_redact_hides_credentials():
    so = {"s3": {"key": "AKIAEXAMPLE", "secret": "very-secret-value", "client_kwargs": {"region_name": "eu"}}}
    assert redact("denied for very-secret-value and AKIAEXAMPLE in eu", so) == "denied for *** and *** in eu"


def _upload(fs, local: Path, remote: str) -> None:
    for p in sorted(local.iterdir()):
        fs.put(str(p), f"{remote}/{p.name}")


def _leftovers(fs, bucket: str) -> list[str]:
    fs.invalidate_cache()
    return [p for p in fs.find(bucket) if "tracefuse-tmp" in p]


pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def example(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("example")
    write_example(str(folder), ranks=6, rank_bytes=300_000)
    return folder


def test_s3_to_s3_cli_matches_the_local_merge(s3, bucket_name, example, client, tmp_path, capsys):
    s3.bucket(bucket_name)
    fs = s3.fs()
    _upload(fs, example, f"{bucket_name}/job42")
    local = tmp_path / "local.json.gz"
    assert main(["merge", str(example), "-o", str(local), "--scheduler", client.scheduler.address, "-q"]) == 0
    so = json.dumps(s3.options)
    out = f"s3://{bucket_name}/job42/merged.json.gz"
    assert main(["merge", f"s3://{bucket_name}/job42/*.json.gz", "-o", out, "--storage-options", so,
                 "--scheduler", client.scheduler.address, "--summary-json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["ranks"] == 6
    assert fs.cat(out.removeprefix("s3://")) == local.read_bytes()
    assert _leftovers(fs, bucket_name) == []
    assert S3_SECRET not in captured.err and S3_SECRET not in captured.out
    # the output sits next to its inputs: a rerun lists the folder and skips it, and --force replaces it
    assert main(["merge", f"s3://{bucket_name}/job42/", "-o", out, "--storage-options", so,
                 "--scheduler", client.scheduler.address, "-q", "--force"]) == 0
    assert fs.cat(out.removeprefix("s3://")) == local.read_bytes()
    assert main(["info", f"s3://{bucket_name}/job42/", "--storage-options", so, "--json",
                 "--scheduler", client.scheduler.address]) == 0
    assert json.loads(capsys.readouterr().out)["ranks"] == list(range(6))


def test_s3_merge_on_dask_cli_cluster(s3, bucket_name, example, scheduler_file, tmp_path):
    s3.bucket(bucket_name)
    _upload(s3.fs(), example, f"{bucket_name}/in")
    out = f"s3://{bucket_name}/out/merged.json"
    merge_traces(f"s3://{bucket_name}/in/", out, storage_options=s3.options, scheduler_file=scheduler_file)
    merge_traces(str(example), str(tmp_path / "merged.json"), scheduler_file=scheduler_file)
    assert s3.fs().cat(out.removeprefix("s3://")) == (tmp_path / "merged.json").read_bytes()


def test_s3_to_local_and_local_to_s3(s3, bucket_name, example, client, tmp_path):
    s3.bucket(bucket_name)
    _upload(s3.fs(), example, f"{bucket_name}/in")
    merge_traces(f"s3://{bucket_name}/in", str(tmp_path / "a.json.gz"), storage_options=s3.options, client=client)
    merge_traces(str(example), f"s3://{bucket_name}/b.json.gz", storage_options={"s3": s3.options}, client=client)
    merge_traces(str(example), str(tmp_path / "c.json.gz"), client=client)
    assert (tmp_path / "a.json.gz").read_bytes() == s3.fs().cat(f"{bucket_name}/b.json.gz") == \
        (tmp_path / "c.json.gz").read_bytes()
    assert_perfetto_rules(load_exact(tmp_path / "a.json.gz"))


def test_many_small_ranks_and_a_few_big_ones(s3, bucket_name, client, tmp_path):
    s3.bucket(bucket_name)
    fs = s3.fs()
    small, big = tmp_path / "small", tmp_path / "big"
    for r in range(40):
        write_trace(small / f"rank{r}.json", make_rank_trace(r, 40, target_bytes=150_000))
    for r in range(2):
        write_trace(big / f"rank{r}.json", make_rank_trace(r, 2, target_bytes=9_000_000))
    for folder in (small, big):
        _upload(fs, folder, f"{bucket_name}/{folder.name}")
        out = f"s3://{bucket_name}/{folder.name}.json"
        s = merge_traces(f"s3://{bucket_name}/{folder.name}/", out, storage_options=s3.options, client=client,
                         include_pyfunc=True)
        merge_traces(str(folder), str(tmp_path / f"{folder.name}.json"), client=client, include_pyfunc=True)
        assert fs.cat(out.removeprefix("s3://")) == (tmp_path / f"{folder.name}.json").read_bytes()
        assert s.bytes_out == fs.size(out)
    assert fs.size(f"{bucket_name}/big.json") > 2 * MIN_PART  # its two partitions were copied as they are
    assert _leftovers(fs, bucket_name) == []
    assert not fs.call_s3("list_multipart_uploads", Bucket=bucket_name).get("Uploads")


def test_a_batch_partition_reaches_s3_in_parts_as_it_is_written(s3, bucket_name, tmp_path):
    """A task uploads its partition file in parts of about 5 MiB while it writes its ranks, rather than
    holding up to s3fs's default block of 50 MiB (~100 MiB of RSS per task for a 34 MB partition)."""
    from tracefuse_dask.merge.tasks import _rewrite_batch
    from tracefuse_dask.model import MergeOptions, RankTask

    s3.bucket(bucket_name)
    tasks = []
    for r in range(4):
        write_trace(tmp_path / f"rank{r}.json", make_rank_trace(r, 4, target_bytes=3_000_000))
        tasks.append(RankTask(r, str(tmp_path / f"rank{r}.json"), 0, 0, MergeOptions(include_pyfunc=True)))
    part = f"s3://{bucket_name}/parts/part-0.json"
    outcomes = _rewrite_batch(tasks, part, s3.options, skip=False)
    assert [e for _, e in outcomes] == [None] * 4
    assert sum(res.part_bytes for res, _ in outcomes) > 2 * MIN_PART
    etag = s3.fs().info(part.removeprefix("s3://"))["ETag"].strip('"')
    assert "-" in etag and int(etag.rsplit("-", 1)[1]) >= 2, etag  # a multipart upload's ETag: <md5>-<parts>


def test_gs_to_gs_cli(gcs, bucket_name, example, client, tmp_path):
    gcs.bucket(bucket_name)
    fs = gcs.fs()
    _upload(fs, example, f"{bucket_name}/job")
    so = json.dumps(gcs.options)
    out = f"gs://{bucket_name}/job/merged.json.gz"
    assert main(["merge", f"gs://{bucket_name}/job/", "-o", out, "--storage-options", so,
                 "--scheduler", client.scheduler.address, "-q"]) == 0
    merge_traces(str(example), str(tmp_path / "local.json.gz"), client=client)
    assert fs.cat(out.removeprefix("gs://")) == (tmp_path / "local.json.gz").read_bytes()
    assert _leftovers(fs, bucket_name) == []


def test_gcs_compose_tree_for_many_ranks(gcs, bucket_name, client, tmp_path):
    gcs.bucket(bucket_name)
    folder = tmp_path / "in"
    for r in range(40):  # 40 partitions + header + footer > 32 compose sources
        write_trace(folder / f"rank{r}.json", make_trace(r, [{"ph": "X", "name": "a", "pid": 1, "tid": 1,
                                                             "ts": 1.0 + r, "dur": 1.0}], world_size=40))
    merge_traces(str(folder), f"gs://{bucket_name}/m.json", storage_options=gcs.options, client=client)
    merge_traces(str(folder), str(tmp_path / "m.json"), client=client)
    assert gcs.fs().cat(f"{bucket_name}/m.json") == (tmp_path / "m.json").read_bytes()


def test_mixed_protocols_with_per_protocol_options(s3, gcs, bucket_name, example, client, tmp_path):
    s3.bucket(bucket_name)
    gcs.bucket(bucket_name)
    _upload(s3.fs(), example, f"{bucket_name}/in")
    so = {"s3": s3.options, "gs": gcs.options}
    merge_traces(f"s3://{bucket_name}/in/", f"gs://{bucket_name}/m.json.gz", storage_options=so, client=client)
    merge_traces(str(example), str(tmp_path / "m.json.gz"), client=client)
    assert gcs.fs().cat(f"{bucket_name}/m.json.gz") == (tmp_path / "m.json.gz").read_bytes()


def test_simplecache_chain(s3, bucket_name, example, client, tmp_path):
    s3.bucket(bucket_name)
    _upload(s3.fs(), example, f"{bucket_name}/in")
    merge_traces(f"simplecache::s3://{bucket_name}/in/*.json.gz", str(tmp_path / "m.json"),
                 storage_options={"s3": s3.options}, client=client)
    merge_traces(str(example), str(tmp_path / "l.json"), client=client)
    assert (tmp_path / "m.json").read_bytes() == (tmp_path / "l.json").read_bytes()


def test_access_denied_missing_bucket_and_wrong_endpoint(s3, bucket_name, example, client, capsys):
    s3.bucket(bucket_name)
    _upload(s3.fs(), example, f"{bucket_name}/in")
    wrong = {"key": "someone-else", "secret": "not-the-secret-xyz", "client_kwargs": s3.options["client_kwargs"]}
    with pytest.raises(StorageAccessError, match=f"s3://{bucket_name}/in/: access denied") as e:
        merge_traces(f"s3://{bucket_name}/in/", f"s3://{bucket_name}/o.json", storage_options=wrong, client=client)
    assert "not-the-secret-xyz" not in str(e.value) and isinstance(e.value, PermissionError)
    code = main(["merge", f"s3://{bucket_name}/in/", "-o", f"s3://{bucket_name}/o.json", "--storage-options",
                 json.dumps(wrong), "--scheduler", client.scheduler.address])
    err = capsys.readouterr().err
    assert code == 1 and "access denied" in err and "not-the-secret-xyz" not in err and "Traceback" not in err
    with pytest.raises(TraceFileNotFoundError, match="s3://no-such-bucket-tf/in/") as e:
        merge_traces("s3://no-such-bucket-tf/in/", "/tmp/never.json", storage_options=s3.options, client=client)
    assert str(e.value).endswith("check the path (bucket and key)")
    bad_endpoint = {**s3.options, "client_kwargs": {"endpoint_url": "http://127.0.0.1:9"}, "config_kwargs":
                    {"retries": {"max_attempts": 1}, "connect_timeout": 1}}
    with pytest.raises(StorageConnectionError, match="cannot reach the storage"):
        merge_traces(f"s3://{bucket_name}/in/", "/tmp/never.json", storage_options=bad_endpoint, client=client)


def test_secrets_never_reach_logs_or_output(s3, bucket_name, example, client, tmp_path, capsys):
    s3.bucket(bucket_name)
    _upload(s3.fs(), example, f"{bucket_name}/in")
    out = tmp_path / "m.json"
    assert main(["merge", f"s3://{bucket_name}/in/", "-o", str(out), "--storage-options", json.dumps(s3.options),
                 "-v", "--summary-json", "--scheduler", client.scheduler.address]) == 0
    captured = capsys.readouterr()
    for text in (captured.out, captured.err, out.read_text()):
        assert S3_SECRET not in text and S3_KEY not in text


def test_memory_urls_need_an_in_process_cluster(client, tmp_path):
    import fsspec

    mem = fsspec.filesystem("memory")
    mem.pipe("/traces/rank0.json", orjson.dumps(make_trace(0, [{"ph": "X", "name": "a", "pid": 1, "tid": 1,
                                                               "ts": 1.0, "dur": 1.0}])))
    with pytest.raises(MergeError, match="memory:// paths live in one process"):
        merge_traces("memory://traces/", "memory://out.json", client=client)
    s = merge_traces("memory://traces/", "memory://out.json")  # the embedded cluster runs in process
    assert s.ranks == 1 and orjson.loads(mem.cat("/out.json"))["traceEvents"][-1]["name"] == "a"


def test_a_server_that_goes_away_leaves_nothing_behind(tmp_path, client):
    server = S3Server(tmp_path / "weed")
    server.start()
    try:
        server.bucket("vanish")
        fs = server.fs()
        folder = tmp_path / "in"
        for r in range(8):
            write_trace(folder / f"rank{r}.json", make_rank_trace(r, 8, target_bytes=3_000_000))
        _upload(fs, folder, "vanish/in")
        options = {**server.options, "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 2}}
        error: list[BaseException] = []

        def run() -> None:
            try:
                merge_traces("s3://vanish/in/", "s3://vanish/out/m.json", storage_options=options, client=client,
                             include_pyfunc=True)
            except BaseException as e:  # noqa: BLE001
                error.append(e)

        t = threading.Thread(target=run)
        t.start()
        deadline = time.monotonic() + 60
        while not any("tracefuse-tmp" in p for p in _safe_find(fs, "vanish/out")):
            assert time.monotonic() < deadline and t.is_alive(), "the merge never wrote a partition"
            time.sleep(0.05)
        server.stop()
        t.join(180)
        assert error and "s3://vanish" in str(error[0])
        server.start()
        fs = server.fs()
        assert not fs.exists("vanish/out/m.json")
        # whatever the crash left, the next run cleans it, and then nothing is left over
        merge_traces("s3://vanish/in/", "s3://vanish/out/m.json", storage_options=server.options, client=client,
                     include_pyfunc=True)
        assert _leftovers(fs, "vanish") == []
        assert not fs.call_s3("list_multipart_uploads", Bucket="vanish").get("Uploads")
        assert_perfetto_rules(orjson.loads(fs.cat("vanish/out/m.json")))
    finally:
        server.stop()


def test_a_test_s_s3_server_leaves_nothing_in_tmp(tmp_path):
    """SeaweedFS keeps what it writes in the test's folder: each server had left three log files, a WebDAV
    chunk-cache folder and its Unix sockets in /tmp (2,118 entries there after a few days of test runs). Its own,
    told by its process id and ports."""
    server = S3Server(tmp_path / "weed")
    server.start()
    try:
        pid = str(server.proc.pid)
        server.fs().pipe(f"{server.bucket('tidy')}/a", b"1")
    finally:
        server.stop()
    ports = {str(port) for port in server.ports.values()}
    left = [p.name for p in Path("/tmp").iterdir() if (p.name.startswith("weed.") and p.name.rsplit(".", 1)[-1] == pid)
            or (p.name.startswith("seaweedfs-") and p.name.removesuffix(".sock").rsplit("-", 1)[-1] in ports)]
    assert left == []
    assert any(p.is_dir() and any(p.glob("c*_*_*.dat")) for p in (tmp_path / "weed").iterdir())  # the cache


def _safe_find(fs, path: str) -> list[str]:
    try:
        fs.invalidate_cache()
        return fs.find(path)
    except Exception:  # noqa: BLE001
        return []


def test_stale_multipart_uploads_and_temporaries_are_cleaned(s3, bucket_name, example, client):
    s3.bucket(bucket_name)
    fs = s3.fs()
    _upload(fs, example, f"{bucket_name}/in")
    for key in ("out/m.json", "out/m.ranks-000-001.json", "out/other.json"):  # a --split part's too
        fs.call_s3("create_multipart_upload", Bucket=bucket_name, Key=key)
    fs.pipe(f"{bucket_name}/out/m.json.tracefuse-tmp/part-00000001.json", b"stale")
    merge_traces(f"s3://{bucket_name}/in/", f"s3://{bucket_name}/out/m.json", storage_options=s3.options,
                 client=client)
    left = fs.call_s3("list_multipart_uploads", Bucket=bucket_name).get("Uploads") or []
    assert [up["Key"] for up in left] == ["out/other.json"]  # another output's upload is not this run's to abort
    assert _leftovers(fs, bucket_name) == []


def test_real_gloo_traces_round_trip_through_s3(s3, bucket_name, client, tmp_path):
    s3.bucket(bucket_name)
    folder = shared("gloo_4ranks")
    local = tmp_path / "gloo"
    shutil.copytree(folder, local)
    _upload(s3.fs(), local, f"{bucket_name}/gloo")
    merge_traces(f"s3://{bucket_name}/gloo/", f"s3://{bucket_name}/m.json.gz", storage_options=s3.options,
                 client=client)
    merge_traces(str(folder), str(tmp_path / "m.json.gz"), client=client)
    assert s3.fs().cat(f"{bucket_name}/m.json.gz") == (tmp_path / "m.json.gz").read_bytes()


@pytest.mark.serial  # timed
def test_ten_thousand_objects_list_in_one_pass_without_a_request_per_file(s3, bucket_name):
    import time

    import fsspec

    from tracefuse_dask.storage.inputs import expand_inputs

    s3.bucket(bucket_name)
    s3.fs().pipe({f"{bucket_name}/job/rank{r}.json": b"{}" for r in range(10_000)}, batch_size=256)
    fs = fsspec.filesystem("s3", **options_for("s3://", s3.options))  # the cached instance expand_inputs uses
    calls: list[str] = []
    fs.s3.meta.events.register("before-call.s3", lambda event_name, **kw: calls.append(event_name.split(".")[-1]))
    fs.invalidate_cache()
    t0 = time.perf_counter()
    files, skipped = expand_inputs(f"s3://{bucket_name}/job/", storage_options=s3.options)
    seconds = time.perf_counter() - t0
    assert len(files) == 10_000 and sorted(f.rank_hint for f in files) == list(range(10_000))
    assert all(f.size == 2 and f.stamp for f in files)  # sizes and etags came with the listing
    assert set(calls) <= {"ListObjectsV2", "HeadObject", "HeadBucket"} and 10 <= calls.count("ListObjectsV2") <= 12
    assert calls.count("HeadObject") <= 1, calls  # at most the folder itself, never one per file
    assert seconds < 30
