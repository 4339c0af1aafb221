"""The straggler verdict and its what-if, on real gloo jobs with an injected straggler and their clean twins.

The jobs are made here (``tests/gloo_job.py``, torch from the test extras), once for the module: ``CASES``, a
rank late in every step or in one, in the forward pass, the backward pass or the optimizer step, on 2, 3, 4 and 8
ranks, and one clean twin per size. A twin that names a straggler, or a case whose late rank is not named as it
should be, is made once more, and the second stands: on these 2-core VMs the machine makes stragglers of its own.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gloo_job import CASES, _median, case_name, measured_gain, predicted_gain, step_times
from tracefuse_dask import analyze
from tracefuse_dask.analysis.cross_rank.what_if import NOISE, SIGNIFICANT, TRANSIENT

pytest.importorskip("torch", reason="the gloo jobs need torch (a test extra: pip install -e '.[test]')")
# gloo jobs timed against their twins; one worker makes them all (--dist loadscope), with the machine to itself
pytestmark = [pytest.mark.integration, pytest.mark.serial]

GENERATOR = Path(__file__).with_name("gloo_job.py")


def make(out: Path, ws: int, rank: int = -1, ms: float = 0, placement: str = "forward",
         late: list[int] | None = None, also: tuple[int, float] | None = None) -> Path:
    """One job, in a fresh interpreter (its ranks fork from it: not from this one, with its threads); once more if
    gloo fails to start, which is the machine, not the job."""
    cmd = [sys.executable, str(GENERATOR), "--out", str(out), "--world-size", str(ws), "--slow-rank", str(rank),
           "--slow-ms", str(ms), "--placement", placement]
    if late is not None:
        cmd += ["--late-steps", *map(str, late)]
    if also is not None:
        cmd += ["--also", *map(str, also)]
    for attempt in range(2):
        quiet()
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
        if done.returncode == 0:
            return out
    raise AssertionError(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")


def quiet(limit: float = 25.0, wait: float = 60.0) -> None:
    """Wait (up to ``wait`` s) until the machine's CPUs are at most ``limit``% busy over half a second: a server
    that an earlier test stopped can still be exiting, and a job made meanwhile has a slow rank of the machine's
    making, not the job's."""
    import psutil

    end = time.monotonic() + wait
    while psutil.cpu_percent(interval=0.5) > limit and time.monotonic() < end:
        pass


@pytest.fixture(scope="module")
def jobs(tmp_path_factory, client):
    """Each case and clean twin: (its folder, its clean twin's folder, its straggler verdict)."""
    root = tmp_path_factory.mktemp("gloo")
    # a job thrown away first: in a fresh environment the first job's steps compile torch's modules as they use
    # them, and its step times are twice a warm job's (CI's fresh clone made the 2-rank twin so, twice)
    make(root / "warm-up", 2)
    got = {}
    for ws in sorted({c[0] for c in CASES}):  # each size's twin first, then its cases, back to back
        # a twin with more ranks than cores can hold a straggler of the machine's making: in CI a 3-rank twin had
        # rank 0 late in most steps, over its 6.6 ms bar; such a twin is made once more, and the second stands
        for again in ("", "-again"):
            clean = make(root / f"clean{ws}{again}", ws)
            verdict = analyze(str(clean), client=client).summary["straggler"]
            if verdict["rank"] is None:
                break
        got[case_name(ws)] = (clean, clean, verdict)
        # so is a job whose late rank is not named as it should be (``named_as_made``): in a 2-rank job with a core
        # per rank, a 30 ms sleep in one step, rank 1 also ran 7 ms behind in every other step (24 ms steps against
        # the twin's 17-20; the same job named it transient in 4 runs of 4 alone), and was rightly named chronic; in
        # CI a 2-rank job whose rank 1 was late in ProfilerStep#5 alone was named transient in steps 5 and 9
        for case in (c for c in CASES if c[0] == ws):
            for again in ("", "-again"):
                out = make(root / ("_".join(map(str, case[:4])) + again), *case)
                verdict = analyze(str(out), client=client).summary["straggler"]
                if named_as_made(verdict, case):
                    break
            got[case_name(*case)] = (out, clean, verdict)
    return got


def named_as_made(verdict: dict, case: tuple) -> bool:
    """The case's late rank is named, chronic or transient as it was made, and a transient one in its late step
    alone."""
    _, rank, _, _, late = case
    if (verdict["rank"], verdict["pattern"]) != (rank, "chronic" if late is None else "transient"):
        return False
    return late is None or verdict["late_steps"] == [min(st["step"] for st in verdict["what_if"]["steps"]) + late[0]]


# With more ranks than cores, the other ranks use the cores while one sleeps: the job loses 25-40% less than the sleep
# (the comment above test_the_what_if_predicts_the_clean_twin_within_30_percent), so a sleep shows as 60% of itself
SHOWN_WITH_FEW_CORES = 0.6


def hidden(s: dict, ms: float, late: list[int] | None, ws: int) -> bool:
    """Nobody named, and the job's own noise bar above what the sleep it was given can show: the job does not show
    it (an 8-rank job with 30 ms in one step on 2 cores once gained 18.2 ms against a 19.3 ms bar)."""
    bar = s["what_if"]["bar_us"] if late is None else s["what_if"]["transient_us"]
    shown = ms * (SHOWN_WITH_FEW_CORES if ws > len(os.sched_getaffinity(0)) else 1.0)
    return s["rank"] is None and shown * 1e3 < bar


def test_the_late_rank_is_named_chronic_or_transient_with_its_cause(jobs):
    """Each late rank is named, unless its job's noise hides it: a sleep under the job's own bar (15% of its median
    step and 2.5 times its step-to-step spread; 40% of the median step in one step), as on these 2-core VMs where a
    4-rank job with 15 ms in every forward pass once ran at a 69.8 ms median step (22-27 ms in other runs), with a
    bar of 37.7 ms. A sleep over the bar that is not named fails."""
    missed = []
    for case in CASES:
        ws, rank, ms, placement, late = case
        _, _, s = jobs[case_name(*case)]
        pattern = "chronic" if late is None else "transient"
        if (s["rank"], s["pattern"]) != (rank, pattern) or (s["cause"] or {}).get("op") != "straggler_sleep":
            if not hidden(s, ms, late, ws):
                missed.append((case_name(*case), s["evidence"], (s["cause"] or {}).get("verdict")))
            continue
        first = min(st["step"] for st in s["what_if"]["steps"])
        assert s["late_steps"] == ([first + late[0]] if late else list(range(first, first + 10))) or \
            late is None and len(s["late_steps"]) >= 5, s["evidence"]
        assert s["evidence"].startswith(f"rank {rank} is " + ("the straggler, chronic: late in" if late is None else
                                                               "a straggler in 1 of 10 steps only, transient: "))
    assert not missed, "\n".join(map(str, missed))


# Two clean runs of one size differ by up to 2 ms in their median step here (3 ranks: up to 5 ms): a gain under 15 ms
# cannot be measured within 30% against a twin (docs/stragglers.md shows those cases too). With more ranks than
# cores, the twin is not the job without the sleep: its all-reduces stall for a core while every rank runs, and not
# while one rank sleeps, so it gains 25-40% less than the sleep in some runs (a 4-rank one-step straggler of 30 ms
# once measured 19.3 ms against its twin), while the what-if predicts the steps without the stalls
# (docs/stragglers.md). There, the prediction is held to the sleep it was given, within 30%; every row of the table
# in docs/stragglers.md shows it against the twin.
@pytest.mark.parametrize("case", [c for c in CASES if c[0] <= 4 and c[2] >= 15], ids=lambda c: case_name(*c))
def test_the_what_if_predicts_the_clean_twin_within_30_percent(case, jobs, tmp_path):
    out, clean, s = jobs[case_name(*case)]
    if hidden(s, case[2], case[4], case[0]):
        pytest.skip(f"this run's noise hides the sleep (test_the_late_rank_is_named...): {s['evidence']}")
    predicted = predicted_gain(str(out), s)
    if case[0] <= len(os.sched_getaffinity(0)):  # a core per rank
        # the twin's median step is itself measured: within 30%, plus its own step-to-step spread (a 2-rank
        # twin once ran 4 ms slower than usual, and its 20 ms straggler measured 16.0 ms against 21.2 predicted);
        # a twin that misses is measured once more, afresh (another ran 7.7 ms off a 20.8 ms prediction)
        for twin in (clean, tmp_path / "twin-again"):
            if twin != clean:
                make(twin, case[0])
            measured = measured_gain(str(out), str(twin))
            times = step_times(str(twin)).values()
            spread = _median(abs(t - _median(times)) for t in times)
            if abs(predicted - measured) <= 0.3 * measured + spread:
                break
        assert abs(predicted - measured) <= 0.3 * measured + spread, (s["what_if_text"], measured, spread)
    else:
        assert predicted == pytest.approx(case[2] * 1e3, rel=0.3), s["what_if_text"]


@pytest.mark.parametrize("ws", sorted({c[0] for c in CASES}))
def test_a_clean_twin_names_no_straggler_and_shows_why(ws, jobs):
    _, _, s = jobs[case_name(ws)]
    w = s["what_if"]
    assert s["rank"] is None and s["ranks"] == [] and s["cause"] is None and s["what_if_text"] is None
    assert w["most"]["gain_us"] < w["bar_us"] == pytest.approx(max(SIGNIFICANT * w["step_us"], NOISE * w["spread_us"]),
                                                                abs=0.002)
    one = w["most_in_a_step"]
    assert one["gain_us"] < w["transient_us"] == pytest.approx(max(w["bar_us"], TRANSIENT * w["step_us"]), abs=0.002)
    assert s["evidence"] == (
        f"no straggler: fixing any one rank would save at most {w['most']['gain_us'] / 1e3:,.1f} ms per step (rank "
        f"{w['most']['rank']}), under the bar: {w['bar_us'] / 1e3:,.1f} ms, 15% of the {w['step_us'] / 1e3:,.1f} ms "
        f"median step and 2.5× its step-to-step spread of {w['spread_us'] / 1e3:,.1f} ms; and at most "
        f"{one['gain_us'] / 1e3:,.1f} ms in one step (rank {one['rank']}, ProfilerStep#{one['step']}), under the "
        f"{w['transient_us'] / 1e3:,.1f} ms a one-step straggler must save (40% of the median step)")


def test_replayed_as_measured_the_graph_gives_back_every_step_time(jobs, client):
    """The replay with nothing fixed is the job: each step's slowest rank, from the raw ProfilerStep events."""
    for name in (case_name(4), case_name(*next(c for c in CASES if c[0] == 4))):
        out, _, s = jobs[name]
        raw = step_times(str(out))
        assert {st["step"]: st["measured_us"] for st in s["what_if"]["steps"]} == pytest.approx(raw, abs=0.002)


def test_the_cli_report_and_overlay_say_the_same(jobs, tmp_path):
    out, _, _ = jobs[case_name(*next(c for c in CASES if c[0] == 3 and c[4]))]
    cmd = [sys.executable, "-m", "tracefuse_dask", "analyze", str(out), "-o", str(tmp_path / "rep"),
           "--critical-path-trace", str(tmp_path / "path.json.gz"), "--workers", "1"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    s = json.loads((tmp_path / "rep" / "summary.json").read_text())["straggler"]
    assert s["what_if_step_us"] == s["what_if"]["what_if_step_us"] and s["pattern"] == "transient"
    for line in (s["evidence"], f"why: {s['cause']['verdict']}", f"what-if: {s['what_if_text']}"):
        assert line in done.stderr
    page = (tmp_path / "rep" / "report.html").read_text()
    import html

    assert html.escape(s["evidence"]) in page and html.escape(s["what_if_text"]) in page
    assert "ProfilerStep#4 would take" in s["what_if_text"] and "`straggler_sleep`" in s["what_if_text"]
    slices = sum(len(n["late_steps"]) for n in s["ranks"])  # one per late step of each named rank
    assert f"{slices} on its 'straggler what-if' thread" in done.stderr and slices >= 1


def test_two_late_ranks_are_both_named_and_the_gain_split_by_rank_and_op(jobs, client, tmp_path):
    """Ranks 1 and 3 of 4 sleep 30 and 15 ms in every forward pass: fixing rank 1 alone saves only what rank 3
    does not hold up (15 ms), and rank 3, found behind it, the rest; the sum is what the clean twin saves."""
    out = make(tmp_path / "two", 4, 1, 30, "forward", also=(3, 15))
    s = analyze(str(out), client=client).summary["straggler"]
    if hidden(s, 15, None, 4):
        pytest.skip(f"this run's noise hides rank 3's 15 ms: {s['evidence']}")
    assert [(n["rank"], n["pattern"]) for n in s["ranks"]] == [(1, "chronic"), (3, "chronic")], s["evidence"]
    for n, share in zip(s["ranks"], (15_000, 15_000)):
        assert n["gain_us"] == pytest.approx(share, rel=0.3)
        # the sleep first and most of the gain; with 4 ranks on 2 cores a stalled all-reduce can share it
        assert n["by_op"][0]["name"] == "straggler_sleep", n["by_op"]
        assert n["by_op"][0]["gain_us"] >= 0.5 * n["gain_us"], n["by_op"]
    for st in s["what_if"]["steps"]:
        assert sum(st["by_rank"].values()) == pytest.approx(st["gain_us"], abs=0.01)
    # 4 ranks on fewer cores: held to the sleep, as in test_the_what_if_predicts_the_clean_twin_within_30_percent
    # (the twin once saved 11.1 ms here against the 30.7 ms predicted: its all-reduces stall for a core)
    clean, _, _ = jobs[case_name(4)]
    expected = measured_gain(str(out), str(clean)) if 4 <= len(os.sched_getaffinity(0)) else 30_000
    assert predicted_gain(str(out), s) == pytest.approx(expected, rel=0.3)
    assert "; also rank 3, chronic: late in " in s["evidence"] and "fixing it as well would save" in s["evidence"]
    assert "by rank: rank 1 " in s["what_if_text"] and ", rank 3 " in s["what_if_text"]
