"""merge --split N: contiguous rank ranges in separate, complete, aligned files."""
from __future__ import annotations

import gzip

import orjson
import pytest

from perfetto_rules import assert_perfetto_rules, load_exact
from tracefuse_dask import MergeError, OutputExistsError, merge_traces
from tracefuse_dask.cli import main
from tracefuse_dask.storage.output import is_output_part, split_name
from tracefuse_dask.synth import write_example


@pytest.mark.parametrize(("out", "name"), [
    ("m.json.gz", "m.ranks-007-015.json.gz"), ("s3://b/m.json", "s3://b/m.ranks-007-015.json"),
    ("m.gz", "m.ranks-007-015.gz"), ("merged", "merged.ranks-007-015"),
])
def test_split_names(out, name):
    """A part's name, and that it is known as one of its output's (the uploads a run aborts of a dead run's)."""
    assert split_name(out, 7, 15, 3) == name
    assert is_output_part(out, name) and is_output_part(out, out)
    assert not is_output_part(out, "x" + name) and not is_output_part(out, name.replace("ranks-", "rank-"))


@pytest.fixture(scope="module")
def seven(tmp_path_factory):
    d = tmp_path_factory.mktemp("seven")
    write_example(str(d), ranks=7, rank_bytes=150_000)
    return d


def events_by_rank(doc):
    out = {}
    for ev in doc["traceEvents"]:
        if ev["ph"] != "M":
            out.setdefault((ev["pid"] - 2**22) // 64, []).append(ev)
    return out


@pytest.mark.integration
def test_split_parts_are_complete_aligned_and_cover_the_whole_merge(client, seven, tmp_path):
    whole = tmp_path / "whole.json.gz"
    merge_traces(str(seven), str(whole), client=client)
    s = merge_traces(str(seven), str(tmp_path / "m.json.gz"), client=client, split=3)
    names = ["m.ranks-0-1.json.gz", "m.ranks-2-3.json.gz", "m.ranks-4-6.json.gz"]
    assert s.outputs == [str(tmp_path / n) for n in names] and s.output == s.outputs[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names + ["whole.json.gz"])
    full = load_exact(whole)
    expected = events_by_rank(full)
    got = {}
    for k, n in enumerate(names):
        doc = load_exact(tmp_path / n)
        assert_perfetto_rules(doc)
        meta = doc["metadata"]["tracefuse"]
        assert meta["split"]["part"] == k + 1 and meta["split"]["of"] == 3
        assert doc["baseTimeNanoseconds"] == full["baseTimeNanoseconds"]
        first, last = meta["split"]["first_rank"], meta["split"]["last_rank"]
        assert sorted(map(int, meta["ranks"])) == list(range(first, last + 1))
        got.update(events_by_rank(doc))
    assert got == expected  # the same events with the same values (times exact to the ns), split by rank
    assert s.bytes_out == sum((tmp_path / n).stat().st_size for n in names)


@pytest.mark.integration
def test_split_is_deterministic_refuses_existing_parts_and_cleans_up(client, seven, tmp_path):
    a = merge_traces(str(seven), str(tmp_path / "a" / "m.json"), client=client, split=2)
    b = merge_traces(str(seven), str(tmp_path / "b" / "m.json"), workers=1, split=2)
    assert [p.rsplit("/", 1)[1] for p in a.outputs] == [p.rsplit("/", 1)[1] for p in b.outputs]
    for pa, pb in zip(a.outputs, b.outputs):
        assert open(pa, "rb").read() == open(pb, "rb").read()
    with pytest.raises(OutputExistsError, match=r"m\.ranks-0-2\.json: the output exists; pass force=True"):
        merge_traces(str(seven), str(tmp_path / "a" / "m.json"), client=client, split=2)
    assert merge_traces(str(seven), str(tmp_path / "a" / "m.json"), client=client, split=2, force=True).outputs
    assert not list((tmp_path / "a").glob("*tracefuse-tmp*"))
    one = merge_traces(str(seven), str(tmp_path / "c.json"), client=client, split=100)  # one rank per file
    assert len(one.outputs) == 7 and one.outputs[0].endswith("c.ranks-0-0.json")
    with pytest.raises(MergeError, match="split=0"):
        merge_traces(str(seven), str(tmp_path / "d.json"), client=client, split=0)


@pytest.mark.integration
def test_cli_split(seven, tmp_path, capsys):
    assert main(["merge", str(seven), "-o", str(tmp_path / "m.json.gz"), "--split", "2", "--workers", "1",
                 "--summary-json"]) == 0
    captured = capsys.readouterr()
    line = orjson.loads(captured.out)
    assert [p.rsplit("/", 1)[1] for p in line["outputs"]] == ["m.ranks-0-2.json.gz", "m.ranks-3-6.json.gz"]
    assert f"wrote {tmp_path / 'm.ranks-3-6.json.gz'}" in captured.err
    assert gzip.decompress((tmp_path / "m.ranks-3-6.json.gz").read_bytes()).startswith(b'{"schemaVersion"')
    assert main(["merge", str(seven), "-o", str(tmp_path / "x.json"), "--split", "2", "--skip-if-unchanged"]) == 1
    assert "--skip-if-unchanged works with one output file" in capsys.readouterr().err


@pytest.mark.integration
def test_split_to_s3_matches_the_local_split(client, s3, bucket_name, seven, tmp_path):
    s3.bucket(bucket_name)
    fs = s3.fs()
    remote = merge_traces(str(seven), f"s3://{bucket_name}/m.json.gz", client=client, split=2,
                          storage_options=s3.options)
    local = merge_traces(str(seven), str(tmp_path / "m.json.gz"), client=client, split=2)
    for r, l in zip(remote.outputs, local.outputs):
        assert fs.cat(r.removeprefix("s3://")) == open(l, "rb").read()
    fs.invalidate_cache()
    assert sorted(fs.find(bucket_name)) == [f"{bucket_name}/m.ranks-0-2.json.gz", f"{bucket_name}/m.ranks-3-6.json.gz"]
    assert not fs.call_s3("list_multipart_uploads", Bucket=bucket_name).get("Uploads")


def test_a_merge_too_big_for_the_browser_names_the_pieces_that_open(seven, tmp_path, monkeypatch, capsys):
    """Perfetto's web UI opens about 1.5 GB of JSON. Past that the merge says, from the partitions' sizes before
    the output is joined, how big it will be and which --split and --ranks give files the UI opens, with their
    sizes; each suggestion, run, gives files within the limit and no warning. The limit is lowered here so that a
    7-rank job stands for a job of gigabytes."""
    from tracefuse_dask.merge import plan

    plain = tmp_path / "plain.json"
    merge_traces(str(seven), str(plain))
    size = plain.stat().st_size
    monkeypatch.setattr(plan, "UI_LIMIT", int(size * 0.45))
    assert main(["merge", str(seven), "-o", str(tmp_path / "m.json.gz"), "--workers", "1", "--summary-json"]) == 0
    captured = capsys.readouterr()
    (warning,) = orjson.loads(captured.out)["warnings"]
    assert warning.startswith(f"the merged trace will be {size / 1e6:.2f} MB of JSON, more than Perfetto's web UI "
                              f"opens (about {int(size * 0.45) / 1e6:.2f} MB")
    # one step of every rank is more than the limit: the warning says so, with its size
    one = warning.split("one step, --steps ")[1].split(", still writes about ")
    assert float(one[1].split(" MB")[0]) * 1e6 > size * 0.45
    assert f"trace_processor --httpd {tmp_path / 'm.json.gz'} and ui.perfetto.dev" in warning
    assert f"warning: {warning}" in captured.err
    split = int(warning.split("--split ")[1].split()[0])
    ranks = warning.split("--ranks ")[1].split()[0]
    assert split == 3 and ranks == "0-2"  # 7 even ranks: 2 files hold 4 ranks, 45% holds 3
    capsys.readouterr()
    parts = merge_traces(str(seven), str(tmp_path / "s.json"), split=split)
    assert not parts.warnings and all((tmp_path / p).stat().st_size <= size * 0.45 for p in parts.outputs)
    most = max((tmp_path / p).stat().st_size for p in parts.outputs)
    assert f"--split 3 (3 files of at most {most / 1e6:.2f} MB)" in warning
    few = merge_traces(str(seven), str(tmp_path / "r.json"), ranks=ranks)
    assert not few.warnings and (tmp_path / "r.json").stat().st_size <= size * 0.45
    # --keep gpu,comm, measured by the tasks (their inputs are larger than the limit): about what it writes
    estimate = float(warning.split("--keep gpu,comm (")[1].split(" MB)")[0]) * 1e6
    narrow = merge_traces(str(seven), str(tmp_path / "k.json"), keep="gpu,comm")
    written = (tmp_path / "k.json").stat().st_size
    assert not narrow.warnings and written <= size * 0.45 and abs(estimate - written) <= 0.05 * written
    monkeypatch.setattr(plan, "UI_LIMIT", size)
    assert not merge_traces(str(seven), str(tmp_path / "fits.json")).warnings


def test_the_suggested_split_counts_a_skipped_rank_as_the_split_does():
    """--split cuts the planned ranks, a rank skipped by --on-error skip among them: the suggestion must fit
    when cut that way (5 ranks planned, rank 0 skipped; 0.2, 0.2, 0.7 and 0.7 GB)."""
    from types import SimpleNamespace as NS

    from tracefuse_dask.merge.assemble import too_big
    from tracefuse_dask.merge.plan import UI_LIMIT, split_ranges

    sizes = {1: 200_000_000, 2: 200_000_000, 3: 700_000_000, 4: 700_000_000}
    tasks = [NS(rank=r) for r in range(5)]
    plan = NS(request=NS(format="json", out="m.json"), ranks=[(r, NS(meta=None)) for r in range(5)], tasks=tasks,
              split_groups=split_ranges(5, 1))
    (warning,) = too_big(plan, [NS(rank=r, json_bytes=s, keep_bytes=None) for r, s in sizes.items()])
    split = int(warning.split("--split ")[1].split()[0])
    assert max(sum(sizes.get(tasks[t].rank, 0) for t in g) for g in split_ranges(5, split)) <= UI_LIMIT
    assert split == 3 and "--ranks 1-3 (1.10 GB)" in warning


def test_a_merge_too_big_for_the_browser_names_the_steps_that_open(seven, tmp_path, monkeypatch, capsys):
    """Where the first steps of every rank fit, the warning names the longest such --steps A-B and about how big
    it is (the tasks measure each step's events by their own start; --steps takes device work by its launch's):
    run, it gives a file within the limit, of about that size."""
    from tracefuse_dask.merge import plan

    plain = tmp_path / "plain.json"
    merge_traces(str(seven), str(plain))
    size = plain.stat().st_size
    monkeypatch.setattr(plan, "UI_LIMIT", int(size * 0.6))
    (warning,) = merge_traces(str(seven), str(tmp_path / "m.json")).warnings
    steps = warning.split("--steps ")[1].split()[0]
    estimate = float(warning.split(f"--steps {steps} (about ")[1].split(" MB)")[0]) * 1e6
    first, last = map(int, steps.split("-"))
    assert first == last  # the example's two steps are about half the trace each
    narrow = merge_traces(str(seven), str(tmp_path / "s.json"), steps=steps)
    written = (tmp_path / "s.json").stat().st_size
    assert not narrow.warnings and written <= size * 0.6 and abs(estimate - written) <= 0.1 * written
