"""``tracefuse diff`` on real traces and generated jobs: a run against itself, a kernel made 30% slower, a rank
slowed, a straggler switched on; from traces and from analyze reports; the CLI's exit codes; diff.html in
Chromium; bad input."""
from __future__ import annotations

import html
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from conftest import SHARED, make_trace, read_trace, shared, write_trace

from tracefuse_dask import MergeError, TraceFileNotFoundError, analyze, diff
from tracefuse_dask.analysis.folder import write_folder
from tracefuse_dask.analysis.diff.identity import name_key
from tracefuse_dask.analysis.diff.sides import step_spread
from tracefuse_dask.kineto.vocabulary import kernel_label as label
from tracefuse_dask.cli import main
from tracefuse_dask.synth import write_example

pytestmark = pytest.mark.integration

A100 = ("real", "hta_trace_filter")  # two ranks of one job, NCCL, two ProfilerStep#N


def slowed(doc: dict, pick, factor: float) -> dict:
    """``doc`` with the events that ``pick(event)`` selects ``factor`` times longer, and time stopped for them:
    everything that starts at or after one's end starts that much later, and what spans its end ends later,
    so that the trace stays a valid timeline."""
    events = doc["traceEvents"]
    timed = [e for e in events if "ts" in e and e.get("ph") != "M"]
    ts = np.array([float(e["ts"]) for e in timed])
    dur = np.array([float(e.get("dur", 0)) for e in timed])
    chosen = sorted((i for i, e in enumerate(timed) if e.get("ph") == "X" and pick(e)), key=lambda i: -ts[i])
    for i in chosen:  # the latest first: an earlier one then moves what the later ones moved
        end, extra = ts[i] + dur[i], dur[i] * (factor - 1)
        spans = (ts < end) & (ts + dur > end)
        dur[spans] += extra
        ts[ts >= end] += extra
        dur[i] += extra
    for e, t, d in zip(timed, ts, dur):
        e["ts"] = round(float(t), 3)
        if "dur" in e:
            e["dur"] = round(float(d), 3)
    return doc


def copy_set(parts: tuple[str, ...], dest: Path, edit=None) -> Path:
    """The shared set ``parts`` as a folder of its own, each rank's document passed through ``edit(rank, doc)``."""
    for i, src in enumerate(sorted(p for p in shared(*parts).iterdir() if ".json" in p.name)):
        doc = read_trace(src)
        write_trace(dest / src.name, edit(i, doc) if edit else doc)
    return dest


@pytest.fixture(scope="module")
def a100_kernel(tmp_path_factory):
    """The A100 set with its largest compute kernel 30% slower on both ranks: (base, new, the kernel's name)."""
    root = tmp_path_factory.mktemp("a100-kernel")
    doc = read_trace(next(p for p in sorted(shared(*A100).iterdir()) if ".json" in p.name))
    totals: dict[str, float] = {}
    for e in doc["traceEvents"]:
        if e.get("cat") == "kernel" and not e["name"].startswith("nccl"):
            totals[e["name"]] = totals.get(e["name"], 0) + e["dur"]
    kernel = max(totals, key=totals.get)
    base = copy_set(A100, root / "base")
    new = copy_set(A100, root / "new", lambda r, d: slowed(d, lambda e: e.get("cat") == "kernel"
                                                            and e["name"] == kernel, 1.3))
    return base, new, kernel


RANKS = {A100: {0, 1}, ("gloo_4ranks",): {0, 1, 2, 3}}


def test_a_run_against_itself_changes_nothing(client, tmp_path):
    for parts in (A100, ("gloo_4ranks",)):
        got = diff(str(shared(*parts)), str(shared(*parts)), str(tmp_path / parts[-1]), client=client,
                   fail_above="5%")
        s = got.summary
        assert not got.failed and s["regressions"] == [] and s["improvements"] == [] and s["failing"] == []
        assert s["verdict"].startswith("no significant change in step time (+0.0%")
        assert "and the smallest change reported, 1%)" in s["verdict"]  # one spread, then the minimum change
        assert s["step_time"]["delta_pct"] == 0 and not s["straggler"]["changed"]
        assert [w for w in s["warnings"] if w.startswith("both sides are ")] == [
            f"both sides are {shared(*parts)}: a run compared with itself shows no change; give the other run's "
            "traces or report as NEW"]
        written = json.loads((tmp_path / parts[-1] / "diff.json").read_text())
        assert written == json.loads(json.dumps(s))
        items = pd.read_parquet(tmp_path / parts[-1] / "items.parquet")
        assert len(items) == len(got.tables["items"]) > 10 and (items["delta_us"] == 0).all()
        stats = got.tables["step_stats"]
        job = stats[stats["rank"] == -1].set_index("run")
        assert job.loc["base", "median_us"] == job.loc["new", "median_us"]
        assert job.loc["base", "median_us"] == pytest.approx(s["base"]["step_time_us"]["median"], abs=0.001)
        assert set(stats["rank"]) == {-1, *RANKS[parts]}


def test_a_kernel_made_30_percent_slower_is_named_first_and_fails_the_check(a100_kernel, client, tmp_path):
    base, new, kernel = a100_kernel
    got = diff(str(base), str(new), str(tmp_path / "diff"), client=client, fail_above=10)
    s = got.summary
    top = s["regressions"][0]
    assert (top["what"], top["name"], top["rank"]) == ("kernel", kernel, -1)  # its exact name
    assert top["delta_pct"] == pytest.approx(30, abs=2) and top["ranks_regressed"] == 2
    assert top["new_count"] == top["base_count"] > 0  # as many calls, each 30% longer
    assert top["new_mean_us"] == pytest.approx(1.3 * top["base_mean_us"], rel=0.02)
    coll = got.tables["items"].query("what == 'collective' and rank == -1")
    assert len(coll) and coll["base_wait_us"].notna().all()
    assert coll["base_busbw_gbps"].notna().any() and coll["base_algbw_gbps"].notna().any()
    assert got.failed and s["failing"][0]["name"] == kernel
    assert s["verdict"].startswith(f"kernel `{label(kernel)}` +30% on all ranks")  # the root change leads
    # the same from the two runs' analyze reports: no re-parse, the same comparison
    for side in ("base", "new"):
        analyze(str(a100_kernel[0 if side == "base" else 1]), str(tmp_path / side), client=client)
    again = diff(str(tmp_path / "base"), str(tmp_path / "new"), client=client, fail_above=10)
    assert again.summary["regressions"] == s["regressions"] and again.summary["verdict"] == s["verdict"]


def copy_dir(src: Path, dest: Path, edit=None) -> Path:
    """A folder of rank files as a new one, each rank's document passed through ``edit(rank, doc)``."""
    for i, path in enumerate(sorted(p for p in src.iterdir() if ".json" in p.name)):
        doc = read_trace(path)
        write_trace(dest / path.name, edit(i, doc) if edit else doc)
    return dest


CUTLASS = "void cutlass::Kernel<"


@pytest.fixture(scope="module")
def a100_steps(tmp_path_factory) -> Path:
    """make_dataset's 2 ranks of the real A100 set's rank 0, 6 MB each: more steps than the set's 2."""
    tool = SHARED.parent / "tools" / "make_dataset.py"
    if not tool.is_file() or not shared(*A100).is_dir():
        pytest.skip("../shared/tools/make_dataset.py or ../shared/traces/real is missing beside the repository")
    out = tmp_path_factory.mktemp("a100-steps") / "job"
    subprocess.run([sys.executable, str(tool), "--source", str(shared(*A100) / "sampled_rank-0.json.gz"), "--ranks",
                    "2", "--mb-per-rank", "6", "--no-gzip", "--out", str(out)], check=True, capture_output=True,
                   timeout=600)
    return out


@pytest.mark.parametrize("which", ["the shared set", "a make_dataset job"])
def test_one_of_several_kernels_of_one_template_made_slower_is_named_exactly(which, a100_steps, client, tmp_path):
    """The cutlass GEMM with most time, one of many ``cutlass::Kernel<…>`` instances, 30% slower on every rank and
    later events shifted: that exact kernel is the first kernel regression, its siblings did not change, and the
    check fails because of it, not because of a critical-path route."""
    src = shared(*A100) if which == "the shared set" else a100_steps
    doc = read_trace(next(p for p in sorted(src.iterdir()) if ".json" in p.name))
    totals: dict[str, float] = {}
    for e in doc["traceEvents"]:
        if e.get("cat") == "kernel" and e["name"].startswith(CUTLASS):
            totals[e["name"]] = totals.get(e["name"], 0) + e["dur"]
    assert len(totals) > 20  # many instances of one template
    kernel = max(totals, key=totals.get)
    base = copy_dir(src, tmp_path / "base")
    new = copy_dir(src, tmp_path / "new", lambda r, d: slowed(d, lambda e: e.get("cat") == "kernel"
                                                             and e["name"] == kernel, 1.3))
    got = diff(str(base), str(new), str(tmp_path / "diff"), client=client, fail_above=10)
    s = got.summary
    assert len(s["new"]["steps"]) == (2 if which == "the shared set" else len(s["new"]["steps"])) >= 2
    first = next(r for r in s["regressions"] if r["what"] == "kernel")
    assert (first["name"], first["rank"], first["ranks_regressed"]) == (kernel, -1, 2)
    assert first["delta_pct"] == pytest.approx(30, abs=2)
    items = got.tables["items"]
    siblings = items[(items["what"] == "kernel") & items["name"].str.startswith(CUTLASS) & (items["name"] != kernel)]
    assert len(siblings) > 20 and not siblings["significant"].any()
    assert got.failed and s["failing"][0]["name"] == kernel
    assert {r["what"] for r in s["failing"]} <= {"kernel", "op group"}  # never a critical-path route
    assert s["verdict"].startswith(f"kernel `{label(kernel)}` +30% on all ranks, in op `aten::")
    groups = [r for r in s["regressions"] if r["what"] == "op group" and r["rank"] == -1]
    assert groups and all(r["new_kernel"] == kernel and r["delta_pct"] == pytest.approx(30, abs=2) for r in groups)
    if which == "the shared set":  # through the CLI: exit code 3, the kernel named first
        run = subprocess.run([sys.executable, "-m", "tracefuse_dask", "diff", str(base), str(new),
                              "-o", str(tmp_path / "cli"), "--fail-above", "10%"], capture_output=True, text=True,
                             timeout=300, check=False)
        assert run.returncode == 3, run.stderr
        first_line = next(line for line in run.stderr.splitlines() if line.startswith("regression above 10%"))
        assert first_line.startswith(f"regression above 10%: kernel `{label(kernel)}` on the job: +30")


def test_a_renamed_kernel_is_followed_through_its_op_and_shapes(client, tmp_path):
    """The new run's build names the main GEMM of some ``aten::mm`` shapes anew (as a new cuBLAS would), and it is 20%
    slower: one kernel 20% slower under its new name, the op groups with the kernel change, nothing removed or
    added."""
    src = shared(*A100)
    doc = read_trace(next(p for p in sorted(src.iterdir()) if ".json" in p.name))
    totals: dict[str, float] = {}
    for e in doc["traceEvents"]:
        if e.get("cat") == "kernel" and e["name"].startswith(CUTLASS):
            totals[e["name"]] = totals.get(e["name"], 0) + e["dur"]
    old = max(totals, key=totals.get)
    renamed = "sm80_xmma_gemm_f32f32_tf32f32_f32_nt_n_tilesize128x64x32_stage6_warpsize2x2x1_tensor16x8x8_kernel"

    def rename(rank, d):
        d = slowed(d, lambda e: e.get("cat") == "kernel" and e["name"] == old, 1.2)
        for e in d["traceEvents"]:
            if e.get("name") == old:
                e["name"] = renamed
        return d
    base = copy_dir(src, tmp_path / "base")
    new = copy_dir(src, tmp_path / "new", rename)
    s = diff(str(base), str(new), client=client).summary
    assert s["renamed"] == [{"base": old, "new": renamed}]
    kernel = next(r for r in s["regressions"] if r["what"] == "kernel")
    assert (kernel["name"], kernel["base_kernel"], kernel["rank"]) == (renamed, old, -1)
    assert kernel["delta_pct"] == pytest.approx(20, abs=2) and kernel["new_count"] == kernel["base_count"] > 0
    groups = [r for r in s["regressions"] if r["what"] == "op group" and r["rank"] == -1]
    assert groups and all(r["new_kernel"] == renamed and r["base_kernel"] == old for r in groups)
    assert all(r["delta_pct"] == pytest.approx(20, abs=2) for r in groups)
    assert all(r["name"] not in (old, renamed) for r in s["added"] + s["removed"])
    assert s["verdict"].startswith(f"kernel `{renamed}` +20% on all ranks (renamed from `{label(old)}`), in op `aten::")


def test_the_same_model_on_two_vendors_is_compared_by_op_and_shapes(client, tmp_path):
    """Qwen on an H100 and on an MI300: the GEMM, attention and elementwise kernels have other names on each, the
    op groups are the same: matched by op and shapes, and the verdict names those that changed most per step."""
    h100, mi300 = shared("real", "tracelens_h100_qwen"), shared("real", "tracelens_mi300_qwen")
    got = diff(str(h100), str(mi300), str(tmp_path / "d"), client=client)
    s, items = got.summary, got.tables["items"]
    job = items[items["rank"] == -1]
    groups = job[job["what"] == "op group"]
    both = groups[(groups["base"] > 0) & (groups["new"] > 0)]
    assert len(groups) > 20 and len(both) >= 0.9 * len(groups)
    kernels = job[job["what"] == "kernel"]
    shared_us = kernels[(kernels["base"] > 0) & (kernels["new"] > 0) & kernels["base_kernel"].isna()]["base"].sum()
    assert shared_us < 0.5 * kernels["base"].sum()  # most kernel time is in names the other run lacks
    assert any(n.startswith(f"{len(both)} of {len(groups)} op groups (op, input dims, types and concrete inputs) "
                            "are in both runs") for n in s["notes"])
    assert s["verdict"].startswith("the kernels differ by name; by op and shapes: op `")
    changed = both[both["significant"]]
    top = changed.reindex(changed["delta_us"].abs().sort_values(ascending=False).index).head(3)
    assert len(top) == 3 and all(f"op `{name}`" in s["verdict"] for name in top["label"])
    assert "op `aten::mm [8944×1024 · 1024×2816]` +31% per call (kernel changed: `sm90_xmma_gemm_" in s["verdict"]
    path = items[items["what"] == "critical path"]
    assert len(path) and not path["name"].str.contains(r"\d+ short .* segments").any()  # each names an op


def test_a_self_diff_of_every_shared_set_changes_nothing(client, tmp_path):
    """Each shared job's report against itself, through the CLI: no significant change, exit 0."""
    sets = [p for p in sorted(shared("real").iterdir()) if p.is_dir()] + [shared("gloo_4ranks")]
    multi = 0
    for path in sets:
        analyze(str(path), str(tmp_path / path.name), client=client)
        s = diff(str(tmp_path / path.name), str(tmp_path / path.name), client=client, fail_above=5).summary
        assert s["regressions"] == s["improvements"] == s["failing"] == [], path.name
        assert s["verdict"].startswith("no significant change in step time (+0.0%"), path.name
        multi += len(s["base"]["steps"]) > 1
        if path.name == "hta_negative_queue_length":  # the CLI's exit code on one of them
            assert main(["diff", str(tmp_path / path.name), str(tmp_path / path.name), "-o", str(tmp_path / "cli"),
                         "--fail-above", "5%", "-q"]) == 0
    assert multi >= 5


def test_a_slowed_rank_is_named(client, tmp_path):
    base = copy_set(A100, tmp_path / "base")
    new = copy_set(A100, tmp_path / "new", lambda r, d: slowed(d, lambda e: e.get("cat") == "kernel"
                                                                and not e["name"].startswith("nccl"), 1.3)
                   if r == 1 else d)
    s = diff(str(base), str(new), client=client).summary
    per_rank = [r for r in s["regressions"] if r["rank"] != -1]
    assert per_rank[0]["rank"] == 1  # rank 0's NCCL kernels wait longer for it, but first comes the slow rank
    assert [r["rank"] for r in per_rank if r["what"] == "rank step time"] == [1]
    assert all(r["rank"] == 1 for r in per_rank if r["what"] == "breakdown")
    busy = next(r for r in per_rank if r["what"] == "breakdown" and r["name"] == "computation_us")
    assert busy["delta_pct"] == pytest.approx(30, abs=3)
    assert "rank 1's computation +30%" in s["verdict"]


def test_a_straggler_switched_on_is_a_step_time_regression_that_names_it(client, tmp_path):
    write_example(str(tmp_path / "off"), ranks=4, rank_bytes=300_000, seed=1)
    write_example(str(tmp_path / "on"), ranks=4, rank_bytes=300_000, seed=1, straggler=2)
    got = diff(str(tmp_path / "off"), str(tmp_path / "on"), client=client, fail_above=5)
    s = got.summary
    assert s["step_time"]["significant"] and s["step_time"]["delta_pct"] > 5 and got.failed
    assert s["straggler"] == {**s["straggler"], "base": None, "new": 2, "changed": True}
    assert "the straggler changed from no straggler to rank 2" in s["verdict"]
    assert "on the critical path `straggler_sleep` takes +" in s["verdict"]
    assert not [r for r in s["regressions"] if "short" in r["name"] and r["delta_pct"] is None]  # no count in names
    assert {"what": "op", "name": "straggler_sleep"} in [{k: a[k] for k in ("what", "name")} for a in s["added"]]


def test_the_cli_lists_a_new_name_among_the_regressions(tmp_path, capsys):
    write_example(str(tmp_path / "off"), ranks=2, rank_bytes=200_000, seed=1)
    write_example(str(tmp_path / "on"), ranks=2, rank_bytes=200_000, seed=1, straggler=1)
    code = main(["diff", str(tmp_path / "off"), str(tmp_path / "on"), "-o", str(tmp_path / "d"), "--fail-above",
                 "5%", "--workers", "1"])
    err = capsys.readouterr().err
    assert code == 3 and "regression above 5%: op `straggler_sleep` on the job: new" in err, err
    assert "regression above 5%: step time on rank 1: +" in err and "`step time`" not in err, err


def test_two_copies_of_one_report_are_the_same_run(client, tmp_path):
    """The same run read from two places (a report and its copy elsewhere, a report and its traces) is named as
    such, whatever the paths; a run of one step has no step-to-step spread to be within."""
    import shutil

    events = [{"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "pid": 1, "tid": 1, "ts": 0, "dur": 900},
              {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 10, "dur": 500}]
    write_trace(tmp_path / "job" / "rank0.json", make_trace(0, events))
    analyze(str(tmp_path / "job"), str(tmp_path / "report"), client=client)
    shutil.copytree(tmp_path / "report", tmp_path / "copy")
    for new in (tmp_path / "copy", tmp_path / "job"):
        s = diff(str(tmp_path / "report"), str(new), client=client).summary
        assert any(w.startswith("both sides are the same run (the same inputs, ") for w in s["warnings"]), s
        assert s["verdict"].startswith("no significant change in step time (+0.0%, below the smallest change "
                                       "reported, 1%)"), s["verdict"]
    write_trace(tmp_path / "other" / "rank0.json", make_trace(0, [{**events[0], "dur": 950}, events[1]]))
    s = diff(str(tmp_path / "report"), str(tmp_path / "other"), client=client).summary
    assert not any("same run" in w for w in s["warnings"])


def test_runs_of_different_sizes_and_models_compare_with_a_note(client, tmp_path):
    s = diff(str(shared("gloo_2ranks_tb_nostraggler")), str(shared("gloo_4ranks")), client=client).summary
    assert s["notes"][0] == ("the runs have different ranks (2 and 4): compared by job-wide figures (means over "
                             "ranks); the per-rank rows are left out")
    assert [n for n in s["notes"][1:] if not n.startswith("the critical path changed: ")] == []
    assert all(r["rank"] == -1 for r in s["regressions"] + s["improvements"])
    assert "on the critical path `straggler_sleep`" in s["verdict"]
    s = diff(str(shared("gloo_4ranks")), str(shared(*A100)), client=client).summary
    assert any("kernel and op names match: two different models or programs?" in w for w in s["warnings"])


def test_bad_sides_say_which_run_and_leave_nothing(client, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(TraceFileNotFoundError, match=r"^the new run: .*empty"):
        diff(str(shared("gloo_4ranks")), str(tmp_path / "empty"), str(tmp_path / "out"), client=client)
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "readme.txt").write_text("not a trace")
    with pytest.raises(Exception, match=r"^the base run: .*notes") as e:
        diff(str(tmp_path / "notes"), str(shared("gloo_4ranks")), str(tmp_path / "out"), client=client)
    assert "Traceback" not in str(e.value)
    with pytest.raises(MergeError, match=r"fail_above='five': give a percentage"):
        diff(str(shared("gloo_4ranks")), str(shared("gloo_4ranks")), client=client, fail_above="five")
    with pytest.raises(MergeError, match=r"format='json'; use 'parquet' or 'csv'"):
        diff(str(shared("gloo_4ranks")), str(shared("gloo_4ranks")), client=client, format="json")
    (tmp_path / "uncommitted").mkdir()
    (tmp_path / "uncommitted" / "summary.json").write_text('{"tool": "tracefuse_dask"}')
    with pytest.raises(MergeError, match=r"uncommitted: no commit.json, so not a finished tracefuse folder: a run is "
                                         r"writing it now, one stopped before it finished, or an older tracefuse"):
        diff(str(tmp_path / "uncommitted"), str(shared("gloo_4ranks")), client=client)
    write_folder({"summary.json": b'{"tool": "something else"}'}, str(tmp_path / "other"))
    with pytest.raises(MergeError, match=r"other: not a report folder of tracefuse analyze"):
        diff(str(tmp_path / "other"), str(shared("gloo_4ranks")), client=client)
    write_folder({"summary.json": b'{"tool": "tracefuse_dask", "version": "0.0.9", "ranks": [0]}'}, str(tmp_path / "old"))
    with pytest.raises(MergeError, match=r"report without critical_path, straggler, steps, inputs .*0\.0\.9"):
        diff(str(tmp_path / "old"), str(shared("gloo_4ranks")), client=client)
    assert not (tmp_path / "out").exists()


def test_a_run_without_steps_is_one_line_that_says_what_to_profile(tmp_path, capsys):
    """collective_trace logs alone hold no step: the diff says so and how to fix it, exit 1, no traceback."""
    logs = Path(__file__).parent / "data" / "collective_trace" / "collective_trace.log-*"
    assert main(["diff", str(logs), str(logs), "-o", str(tmp_path / "out"), "-q"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and not (tmp_path / "out").exists()
    assert err.startswith("error: the base run has no step times: its traces hold no ProfilerStep#N") and \
        "torch.profiler recorded its steps" in err


def test_the_cli_exit_codes(a100_kernel, tmp_path):
    base, new, kernel = a100_kernel
    cmd = [sys.executable, "-m", "tracefuse_dask", "diff"]
    same = subprocess.run([*cmd, str(base), str(base), "-o", str(tmp_path / "same"), "--fail-above", "10%"],
                          capture_output=True, text=True, timeout=300, check=False)
    assert same.returncode == 0, same.stderr
    assert "verdict: no significant change in step time" in same.stderr
    worse = subprocess.run([*cmd, str(base), str(new), "-o", str(tmp_path / "worse"), "--fail-above", "10%"],
                           capture_output=True, text=True, timeout=300, check=False)
    assert worse.returncode == 3, worse.stderr
    assert f"regression above 10%: kernel `{label(kernel)}` on the job: +30" in worse.stderr
    assert (tmp_path / "worse" / "diff.html").exists() and (tmp_path / "worse" / "diff.json").exists()
    again = subprocess.run([*cmd, str(base), str(new), "-o", str(tmp_path / "worse")], capture_output=True,
                           text=True, timeout=300, check=False)
    assert again.returncode == 1 and "exists; pass --force" in again.stderr and "Traceback" not in again.stderr


def test_diff_html_renders_offline_in_chromium(a100_kernel, client, tmp_path):
    from browser import chromium, console_errors, open_page

    base, new, kernel = a100_kernel
    diff(str(base), str(new), str(tmp_path / "diff"), client=client, fail_above=10)
    page = tmp_path / "diff" / "diff.html"
    with chromium(tmp_path / "profile") as driver:
        open_page(driver, page, 2)
        assert console_errors(driver) == []
        got = driver.execute_script("""
            const plots = Array.from(document.querySelectorAll('.js-plotly-plot'));
            return {titles: plots.map(p => p.layout.title.text), text: document.body.innerText,
                    bars: plots[1].data[0].hovertext,
                    resources: performance.getEntriesByType('resource').map(e => e.name)}""")
    assert got["titles"][0].startswith("Step time") and got["titles"][1].startswith("Biggest significant changes")
    assert html.escape(f"kernel: {label(kernel)}", quote=False) in got["bars"]  # plotly reads entities
    assert "the check fails (exit code 3)" in got["text"]
    assert all(r.startswith(("file:", "data:", "blob:")) for r in got["resources"])


@pytest.mark.parametrize("name, expected", [
    # template arguments and parameter lists are the kernel: kept whole
    ("void cutlass::Kernel<cutlass_80_tensorop_s1688gemm_256x128_32x3_nt_align1>(cutlass_80_tensorop_s1688gemm_256x12"
     "8_32x3_nt_align1::Params)", None),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, std::array<char*, 1ul> >(int, "
     "at::native::FillFunctor<float>, std::array<char*, 1ul>)", None),
    ("void at::native::elementwise_kernel<128, 2, at::native::gpu_kernel_impl<at::native::direct_copy_kernel_cuda(at::"
     "TensorIteratorBase&)::{lambda()#2}::operator()() const::{lambda()#7}::operator()() const::{lambda(float)#1}> >"
     "(int, …)", None),  # a lambda's number is its own
    ("triton_poi_fused_add_0", None), ("Memcpy HtoD (Pageable -> Device)", None),
    ("<built-in method apply of FunctionMeta object at 0x55d3c8a1e6b0>",
     "<built-in method apply of FunctionMeta object at 0x…>"),
    ("not yet in ProfilerStep#12", "not yet in ProfilerStep#…"), ("ProfilerStep#551", "ProfilerStep#…"),
])
def test_only_what_differs_between_runs_of_one_program_is_normalised(name, expected):
    assert name_key(name) == (expected or name)


@pytest.mark.parametrize("name, expected", [
    ("void cutlass::Kernel<cutlass_80_tensorop_s1688gemm_256x128_32x3_nt_align1>(cutlass_80_tensorop_s1688gemm_256x12"
     "8_32x3_nt_align1::Params)", "cutlass::Kernel<cutlass_80_tensorop_s1688gemm_256x128_32x3_nt_align1>(…)"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, std::array<char*, 1ul> >(int, "
     "at::native::FillFunctor<float>, std::array<char*, 1ul>)",
     "vectorized_elementwise_kernel<4, FillFunctor<float>, array<char*, 1ul> >(…)"),
    ("ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t(ncclDevComm*, unsigned long, ncclWork*)",
     "ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t(ncclDevComm*, unsigned long, ncclWork*)"),  # no template: kept
    ("x" * 200, "x" * 59 + "…" + "x" * 59),
])
def test_labels_shorten_for_reading_only(name, expected):
    assert label(name) == expected


def test_diff_from_and_to_s3_with_reports_in_the_bucket(client, s3, bucket_name):
    """Tonight's traces against last night's report, both in the bucket, and diff/ written beside them."""
    bucket, fs = s3.bucket(bucket_name), s3.fs()
    for night in ("2026-11-24", "2026-11-25"):
        for p in sorted(shared("gloo_4ranks").glob("rank*.json.gz")):
            fs.put(str(p), f"{bucket}/{night}/{p.name}")
    analyze(f"s3://{bucket}/2026-11-24/", f"s3://{bucket}/2026-11-24/tracefuse/report", client=client,
            storage_options=s3.options)
    got = diff(f"s3://{bucket}/2026-11-24/tracefuse/report", f"s3://{bucket}/2026-11-25/",
               f"s3://{bucket}/2026-11-25/tracefuse/diff", client=client, storage_options=s3.options, fail_above=5)
    assert not got.failed and got.summary["verdict"].startswith("no significant change")
    written = json.loads(fs.cat_file(f"{bucket}/2026-11-25/tracefuse/diff/diff.json"))
    assert written["verdict"] == got.summary["verdict"]
    assert sorted(p.rsplit("/", 1)[1] for p in fs.ls(f"{bucket}/2026-11-25/tracefuse/diff")) == [
        "commit.json", "diff.html", "diff.json", "items.parquet", "step_stats.parquet", "steps.parquet"]


@pytest.mark.parametrize("steps, spread", [
    ([100.0], 0.0), ([100.0, 100.0, 400.0], 0.0),  # one warm-up or checkpoint step does not blind the check
    ([90.0, 100.0, 110.0], 2 * 1.4826 * 10), ([608.0, 632.0], 2 * 1.4826 * 12 / 620 * 100),
])
def test_the_spread_is_robust_to_one_odd_step(steps, spread):
    assert step_spread(steps) == pytest.approx(spread)


def test_report_sides_refuse_trace_options_and_paths_are_accepted(client, tmp_path):
    analyze(str(shared("gloo_4ranks")), str(tmp_path / "report"), client=client)
    with pytest.raises(MergeError, match=r"the base run, .*report, is an analyze report: --ranks and --steps"):
        diff(str(tmp_path / "report"), str(shared("gloo_4ranks")), client=client, steps="2-3")
    got = diff(tmp_path / "report", shared("gloo_4ranks"), client=client)  # pathlib paths, as users pass them
    assert got.summary["step_time"]["delta_pct"] == 0
    with pytest.raises(MergeError, match="inside the report folder"):
        analyze(str(shared("gloo_4ranks")), str(tmp_path / "rep"), client=client,
                critical_path_trace=str(tmp_path / "rep" / "path.json.gz"))


def test_reports_in_csv_and_of_an_earlier_version_compare_their_op_groups_or_say_why_not(client, tmp_path):
    """A CSV report reads empty texts back as missing: its op groups still compare with the Parquet one's. A report
    of an earlier version without op_perf compares everything else, with a note."""
    analyze(str(shared(*A100)), str(tmp_path / "parquet"), client=client)
    analyze(str(shared(*A100)), str(tmp_path / "csv"), client=client, format="csv")
    s = diff(str(tmp_path / "parquet"), str(tmp_path / "csv"), client=client).summary
    assert s["regressions"] == s["improvements"] == [] and not any("op_perf" in n for n in s["notes"])
    got = diff(str(tmp_path / "csv"), str(tmp_path / "csv"), client=client)
    groups = got.tables["items"].query("what == 'op group' and rank == -1")
    assert len(groups) > 20 and groups["label"].str.startswith("aten::").any()
    older = {p.name: p.read_bytes() for p in sorted((tmp_path / "parquet").iterdir())
             if p.name not in ("op_perf.parquet", "commit.json")}
    write_folder(older, str(tmp_path / "parquet"))  # committed, as an earlier version wrote it
    s = diff(str(tmp_path / "parquet"), str(tmp_path / "csv"), client=client).summary
    assert ("the base run's report has no op_perf table (an earlier version): op groups are not compared; run "
            "tracefuse analyze on its traces again") in s["notes"]
    assert s["regressions"] == s["improvements"] == []
