"""merge --format perfetto-archive: a TAR of per-rank traces plus the perfetto_manifest.json Perfetto v58+ merges."""
from __future__ import annotations

import gzip
import io
import tarfile
from collections import Counter

import orjson
import pytest

from conftest import shared
from perfetto_rules import assert_perfetto_rules
from tracefuse_dask import merge_traces
from tracefuse_dask.cli import main

pytestmark = pytest.mark.integration

NAMES = ["perfetto_manifest.json"] + [f"rank-{r:05d}.json" for r in range(4)]


@pytest.fixture(scope="module")
def merged(client, tmp_path_factory):
    """gloo_4ranks merged as a perfetto archive and as one JSON trace, with the archive's summary."""
    d = tmp_path_factory.mktemp("archive")
    folder = str(shared("gloo_4ranks"))
    summary = merge_traces(folder, str(d / "m.tar"), client=client, format="perfetto-archive")
    merge_traces(folder, str(d / "m.json"), client=client)
    return d, summary


def members(data: bytes) -> dict[str, bytes]:
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers()}


def test_layout_is_the_manifest_then_one_trace_per_rank(merged):
    d, summary = merged
    data = (d / "m.tar").read_bytes()
    assert summary.outputs == [str(d / "m.tar")] and summary.bytes_out == len(data) and summary.ranks == 4
    with tarfile.open(d / "m.tar") as tar:
        infos = tar.getmembers()
    assert [m.name for m in infos] == NAMES
    assert {(m.type, m.mode, m.mtime, m.uid, m.gid, m.uname, m.gname) for m in infos} == {
        (tarfile.REGTYPE, 0o644, 0, 0, 0, "", "")}
    assert data[257:265] == b"ustar  \0"  # GNU headers: Perfetto's TAR reader refuses pax headers
    assert len(data) % tarfile.RECORDSIZE == 0
    assert sorted(p.name for p in d.iterdir()) == ["m.json", "m.tar"]  # no temporaries left


def test_manifest_follows_the_documented_schema(merged):
    d, _ = merged
    files = members((d / "m.tar").read_bytes())
    raw = files["perfetto_manifest.json"]
    assert b"".join(raw.split()).startswith(b'{"perfetto_manifest"')  # how Perfetto detects a manifest
    m = orjson.loads(raw)["perfetto_manifest"]
    assert m["version"] == 1
    assert [f["path"] for f in m["files"]] == NAMES[1:]
    assert [f["machine"] for f in m["files"]] == [{"name": f"rank-{r}"} for r in range(4)]  # unique machines
    assert "clocks" not in m["files"][0]  # the reference timeline
    assert all(f["clocks"] == {"sync_to": {"file": "rank-00000.json"}, "offset_ns": 0} for f in m["files"][1:])
    base = orjson.loads(files["rank-00000.json"])["baseTimeNanoseconds"]
    assert m["attributes"]["tracefuse.base_time_ns"] == base


def test_members_hold_the_events_of_the_json_merge(merged):
    d, _ = merged
    whole = orjson.loads((d / "m.json").read_bytes())
    files = members((d / "m.tar").read_bytes())
    docs = [orjson.loads(files[name]) for name in NAMES[1:]]  # every member parses with orjson

    def key(ev):
        return orjson.dumps(ev, option=orjson.OPT_SORT_KEYS)

    events = [ev for doc in docs for ev in doc["traceEvents"]]
    assert Counter(map(key, events)) == Counter(map(key, whole["traceEvents"]))  # same events, same ts
    for r, doc in enumerate(docs):
        assert doc["baseTimeNanoseconds"] == whole["baseTimeNanoseconds"]
        assert doc["metadata"]["tracefuse"]["ranks"] == {str(r): whole["metadata"]["tracefuse"]["ranks"][str(r)]}
        assert set(assert_perfetto_rules(doc).values()) == {r}


def test_tar_gz_is_byte_identical_with_one_and_two_workers(merged, client, tmp_path):
    d, _ = merged
    folder = str(shared("gloo_4ranks"))
    one, two = tmp_path / "one.tar.gz", tmp_path / "two.tar.gz"
    merge_traces(folder, str(one), workers=1, format="perfetto-archive")
    merge_traces(folder, str(two), client=client, format="perfetto-archive")
    assert one.read_bytes() == two.read_bytes()
    assert gzip.decompress(one.read_bytes()) == (d / "m.tar").read_bytes()


def test_cli_refuses_an_existing_output_split_and_other_names(merged, client, tmp_path, capsys):
    d, _ = merged
    folder = str(shared("gloo_4ranks"))
    out = d / "m.tar"
    before = out.read_bytes()
    assert main(["merge", folder, "-o", str(out), "--format", "perfetto-archive"]) == 1
    assert f"{out}: the output exists; pass --force" in capsys.readouterr().err
    assert main(["merge", folder, "-o", str(tmp_path / "s.tar"), "--format", "perfetto-archive", "--split", "2"]) == 1
    assert "drop --split or --format perfetto-archive" in capsys.readouterr().err
    assert main(["merge", folder, "-o", str(tmp_path / "m.json"), "--format", "perfetto-archive"]) == 1
    assert "m.json: --format perfetto-archive writes a TAR archive; name the output .tar" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())
    merge_traces(folder, str(out), client=client, format="perfetto-archive", force=True)
    assert out.read_bytes() == before


def test_archive_to_s3_matches_the_local_one(merged, client, s3, bucket_name):
    d, _ = merged
    s3.bucket(bucket_name)
    merge_traces(str(shared("gloo_4ranks")), f"s3://{bucket_name}/m.tar", client=client, format="perfetto-archive",
                 storage_options=s3.options)
    fs = s3.fs()
    assert fs.cat(f"{bucket_name}/m.tar") == (d / "m.tar").read_bytes()
    fs.invalidate_cache()
    assert fs.find(bucket_name) == [f"{bucket_name}/m.tar"]
    assert not fs.call_s3("list_multipart_uploads", Bucket=bucket_name).get("Uploads")


def test_archive_pieces_are_files_and_tar_bytes_with_no_empty_piece():
    """Each member's header and partition stay whole file pieces (copied server side on S3/GCS), and no empty
    bytes piece sits between them (it would pair each partition with it into a copy through a worker)."""
    from tracefuse_dask.merge.assemble import _archive_pieces
    from tracefuse_dask.model import RankResult

    results = [RankResult(r, f"in/rank{r}.json", 1, 1, 1, 10_000 + r, f"tmp/part-{r}.json") for r in range(3)]
    heads = [(f"tmp/head-{r}.json", 700 + r) for r in range(3)]
    pieces = _archive_pieces(results, {"version": "0", "base_time_ns": 0}, heads)
    assert b"" not in pieces
    assert [p for p in pieces if not isinstance(p, bytes)] == [
        x for r in range(3) for x in (heads[r], (f"tmp/part-{r}.json", 10_000 + r))]
    total = sum(len(p) if isinstance(p, bytes) else p[1] for p in pieces)
    assert total % tarfile.RECORDSIZE == 0
