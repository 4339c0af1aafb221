from __future__ import annotations

import gzip
import io
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from conftest import make_trace, write_trace
from tracefuse_dask.errors import TraceFileNotFoundError
from tracefuse_dask.storage.files import arrow_file, read_header, read_start
from tracefuse_dask.storage.inputs import expand_inputs, rank_from_name, relative_sources
from tracefuse_dask.storage.output import open_write
from tracefuse_dask.model import RankSet, parse_steps, parse_window


@pytest.mark.parametrize(
    "name, rank",
    [
        ("rank0.json", 0),
        ("rank-12.pt.trace.json.gz", 12),
        ("rank_3.json", 3),
        ("rank[7].json", 7),
        ("worker5.1795319725934765812.pt.trace.json.gz", 5),
        ("sampled_rank-1.json.gz", 1),
        ("rank-34.Jul_15_10_52_41.1074.pt.trace.json.gz", 34),
        ("eager_trace.json.gz", None),
        ("s3://bucket/rank9/trace.json", None),
    ],
)
def test_default_rank_regex(name, rank):
    assert rank_from_name(name) == rank


@pytest.mark.parametrize(
    "spec, inside, outside",
    [
        ("0-63:8,100", [0, 8, 56, 100], [1, 63, 64, 99]),
        ("5", [5], [4, 6]),
        ("2-4", [2, 3, 4], [1, 5]),
        ("1-9:4", [1, 5, 9], [2, 13]),
    ],
)
def test_rank_set(spec, inside, outside):
    rs = RankSet.parse(spec)
    assert all(r in rs for r in inside) and not any(r in rs for r in outside)


@pytest.mark.parametrize("ranks, spec", [
    ([0], "0"), ([3, 2], "2-3"), ([0, 8], "0,8"), (range(0, 10_000), "0-9999"), (range(3, 10_000, 8), "3-9995:8"),
    ([16, 0, 1, 2, 8, 24, 5, 5], "0-2,5,8-24:8"),
])
def test_rank_set_of_spells_a_group_short(ranks, spec):
    assert RankSet.of(ranks).spec == spec
    assert RankSet.parse(spec).ranks() == set(ranks)


@given(st.lists(st.integers(0, 300), min_size=1, max_size=60))
def test_rank_set_of_keeps_every_rank_in_disjoint_runs(ranks):
    rs = RankSet.of(ranks)
    assert rs.ranks() == set(ranks)
    runs = [set(range(lo, hi + 1, step)) for lo, hi, step in rs.parts]
    assert sum(map(len, runs)) == len(set(ranks))  # the runs do not overlap
    assert [lo for lo, _, _ in rs.parts] == sorted(lo for lo, _, _ in rs.parts)
    assert len(rs.spec) <= len(",".join(map(str, sorted(set(ranks)))))  # never longer than the list


@pytest.mark.parametrize("ranks", [[], [-1, 0], [True, 2], [1.0]])
def test_rank_set_of_wants_ranks(ranks):
    with pytest.raises(ValueError, match="ints >= 0"):
        RankSet.of(ranks)


def test_open_write_makes_the_folders_it_needs(tmp_path):
    with open_write(str(tmp_path / "new" / "deeper" / "part.json"), None) as f:
        f.write(b"[]")
    assert (tmp_path / "new" / "deeper" / "part.json").read_bytes() == b"[]"


def test_read_start_gives_the_start_of_the_content(tmp_path):
    data = b'{"traceEvents": [' + b'{"ph": "X"}, ' * 100_000 + b"]}"
    plain, packed, bad = tmp_path / "t.json", tmp_path / "t.json.gz", tmp_path / "bad.json.gz"
    plain.write_bytes(data)
    packed.write_bytes(gzip.compress(data))
    bad.write_bytes(b"\x1f\x8b" + b"not deflate" * 10)
    assert read_start(str(plain)) == data[:8192]
    assert read_start(str(packed)) == data[:8192]  # at most 8192 bytes, however well they compress
    assert read_start(str(bad)) == bad.read_bytes()
    with pytest.raises(TraceFileNotFoundError):
        read_start(str(tmp_path / "missing.json"))


@pytest.mark.parametrize("spec", ["", "a", "3-1", "0-4:0", "1,,2"])
def test_bad_rank_set_says_the_syntax(spec):
    with pytest.raises(ValueError, match="bad rank spec"):
        RankSet.parse(spec)


@pytest.mark.parametrize("spec, expected", [("3-5", (3, 5)), ("4", (4, 4))])
def test_parse_steps(spec, expected):
    assert parse_steps(spec) == expected


@pytest.mark.parametrize("spec, expected", [("0:5", (0, 5_000_000)), ("1.000001:2", (1_000_001, 2_000_000))])
def test_parse_window_is_exact(spec, expected):
    assert parse_window(spec) == expected


@pytest.mark.parametrize("spec", ["5", "5:1", "-1:3", "a:b"])
def test_bad_window(spec):
    with pytest.raises(ValueError):
        parse_window(spec)


@pytest.mark.parametrize("suffix", [".json", ".json.gz"])
def test_read_header_stops_at_trace_events(tmp_path, suffix):
    doc = make_trace(3, [{"ph": "X", "name": "a", "pid": 1, "tid": 1, "ts": 1.0}] * 50000, world_size=8)
    p = write_trace(tmp_path / f"rank3{suffix}", doc)
    header, reached, nbytes = read_header(str(p))
    assert reached and header["distributedInfo"]["rank"] == 3 and header["baseTimeNanoseconds"] == doc[
        "baseTimeNanoseconds"]
    assert nbytes < 200_000  # the events were not read


EVENT = '{"ph": "X", "name": "a]", "pid": 1, "tid": 1, "ts": 1.0, "args": {"Input Dims": [[1, 2], []]}}'


@pytest.mark.parametrize("text, keys", [
    pytest.param('{"schemaVersion": 1, "traceEvents": [], "baseTimeNanoseconds": 5}',
                 {"schemaVersion": 1, "baseTimeNanoseconds": 5}, id="empty-events"),
    pytest.param('{"deviceProperties": [{"id": 0}], "traceEvents": [E, E], "baseTimeNanoseconds": 5, '
                 '"distributedInfo": {"rank": 3, "pg_config": [{"ranks": [0, 1]}]}, "x": [1]}',
                 {"deviceProperties": [{"id": 0}], "baseTimeNanoseconds": 5,
                  "distributedInfo": {"rank": 3, "pg_config": [{"ranks": [0, 1]}]}, "x": [1]},
                 id="lists-before-inside-and-after-the-events"),
    pytest.param('{"schemaVersion": 1, "traceEvents": [E]\n}\n', {"schemaVersion": 1}, id="nothing-after"),
    pytest.param('{"traceEvents": [E], "traceName": "t"}', {"traceName": "t"}, id="no-head"),
])
@pytest.mark.parametrize("size", ["small", "big"])
@pytest.mark.parametrize("suffix", [".json", ".json.gz"])
def test_read_header_reads_the_keys_after_the_events_from_the_end(tmp_path, text, keys, size, suffix):
    events = ", ".join([EVENT] * (1 if size == "small" else 40_000))  # big: the head and tail reads are apart
    p = write_trace(tmp_path / f"late{suffix}", text.replace("E, E", events).replace("[E]", f"[{events}]").encode())
    header, complete, nbytes = read_header(str(p))
    assert complete and header == keys
    if suffix == ".json":
        assert nbytes <= 1 << 20  # a ranged read of the end, not the events


def test_read_header_is_incomplete_when_the_end_cannot_be_told(tmp_path):
    truncated = write_trace(tmp_path / "cut.json", ('{"traceEvents": [' + ", ".join([EVENT] * 40_000)).encode())
    assert read_header(str(truncated))[1] is False
    # keys after the events longer than the tail read: their lists must not pass for the events' end
    long_tail = ('{"traceEvents": [' + EVENT + '], "deviceProperties": [' + ", ".join(['{"id": 1}'] * 200_000)
                 + '], "baseTimeNanoseconds": 5}')
    header, complete, nbytes = read_header(str(write_trace(tmp_path / "long.json", long_tail.encode())))
    assert not complete and nbytes <= 1 << 20
    assert read_header(str(write_trace(tmp_path / "long.json.gz", long_tail.encode())))[1] is False


def test_expand_folder_skips_own_artifacts(tmp_path):
    for name in ["rank0.json", "rank1.json.gz", "notes.txt", "m.json.manifest.json", "m.tar.gz", "m.tar"]:
        write_trace(tmp_path / name, make_trace(0, []))
    (tmp_path / "m.json.tracefuse-tmp").mkdir()
    write_trace(tmp_path / "m.json.tracefuse-tmp" / "part-00000001.json", b"{}")
    files, skipped = expand_inputs(str(tmp_path))
    assert [f.rank_hint for f in files] == [0, 1]
    assert {p.rsplit("/", 1)[-1] for p in skipped} == {"notes.txt", "m.json.manifest.json", "m.tar.gz", "m.tar"}


def test_relative_sources_drop_the_common_prefix():
    got = relative_sources(["s3://b/job/a/rank0.json", "s3://b/job/b/rank1.json"])
    assert got == {"s3://b/job/a/rank0.json": "a/rank0.json", "s3://b/job/b/rank1.json": "b/rank1.json"}
    assert relative_sources(["/x/y/rank0.json"]) == {"/x/y/rank0.json": "rank0.json"}


def test_a_folder_of_one_trace_without_a_rank_is_rank_0(tmp_path):
    write_trace(tmp_path / "one" / "trace.json", make_trace(None, []))
    files, _ = expand_inputs(str(tmp_path / "one"))
    assert [(f.rank_hint, f.hint_source) for f in files] == [(0, "order")]
    write_trace(tmp_path / "one" / "other.json", make_trace(None, []))
    files, _ = expand_inputs(str(tmp_path / "one"))  # two: which is which cannot be guessed
    assert [f.rank_hint for f in files] == [None, None]


def test_a_folder_served_over_http_lists_its_traces(tmp_path):
    """A web server's index page of a folder is a folder (fsspec's HTTP isdir), though HTTP's info calls every URL
    a file."""
    import functools
    import http.server
    import threading

    for rank in (0, 1):
        write_trace(tmp_path / f"rank{rank}.json", make_trace(rank, []))
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/"
        files, _ = expand_inputs(url)
        assert [(f.path.rsplit("/", 1)[-1], f.rank_hint) for f in files] == [("rank0.json", 0), ("rank1.json", 1)]
        (one,), _ = expand_inputs(url + "rank1.json")
        assert one.path == url + "rank1.json" and one.rank_hint == 1
    finally:
        server.shutdown()


def test_arrow_file_holds_no_python_object():
    """A table read through ``arrow_file`` is the one in the bytes, and Arrow's threads, which may drop the file after
    the read returned, hold nothing of Python's: a bytes object they held would need the interpreter to be freed,
    and one freed as the interpreter exits aborts it (apache/arrow#34314)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"name": ["a", "b", None], "dur": [1, 2, 3]})
    buf = io.BytesIO()
    pq.write_table(table, buf)
    data = buf.getvalue()
    held = sys.getrefcount(data)
    f = arrow_file(data)
    assert sys.getrefcount(data) == held
    assert pq.read_table(f).equals(table)
    plain = pa.BufferReader(data)  # what the check tells apart: a reader of the bytes themselves holds them
    assert sys.getrefcount(data) == held + 1 and pq.read_table(plain).equals(table)
