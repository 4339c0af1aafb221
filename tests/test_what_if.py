"""The what-if's replay and the straggler rules, on hand-built jobs (pure functions; the real gloo jobs are in
test_stragglers.py)."""
from __future__ import annotations

import pandas as pd

from tracefuse_dask.analysis.cross_rank.what_if import replay, stragglers, timeline


def hand_built(late_ns: dict[int, int], steps: int = 3, only: int | None = None):
    """A job of one collective per step, 100 ms apart: each rank arrives 20 ms into the step plus its lateness
    (in step ``only`` alone, when given), the collective takes 2 ms after the last arrival, and the step ends 3 ms
    after it."""
    rows, anchors = [], []
    for step in range(steps):
        t0 = step * 100_000_000
        lateness = {r: v if only in (None, step) else 0 for r, v in late_ns.items()}
        last = max(lateness.values())
        for r, late in lateness.items():
            arrive = t0 + 20_000_000 + late
            done = t0 + 20_000_000 + last + 2_000_000
            rows.append({"rank": r, "index": step, "instance": step, "cpu_start_ns": arrive, "cpu_end_ns": arrive + 1,
                         "gpu_start_ns": pd.NA, "done_ns": done})
            anchors.append({"rank": r, "anchor": "step", "key": step, "floor_ns": t0, "host_ns": done + 3_000_000})
    matched = pd.DataFrame(rows).astype({"gpu_start_ns": "Int64"})
    return timeline(matched, pd.DataFrame(anchors), {})


def test_the_replay_gives_a_late_rank_the_median_other_ranks_work():
    tl = hand_built({0: 0, 1: 0, 2: 0, 3: 10_000_000, 4: 20_000_000})
    assert replay(tl) == {s: 45_000_000 for s in range(3)}
    assert replay(tl, {4}) == {s: 35_000_000 for s in range(3)}  # rank 3 is now the last, 10 ms late
    assert replay(tl, {3}) == replay(tl)  # rank 4 still holds the collective
    assert replay(tl, {3, 4}) == {s: 25_000_000 for s in range(3)}


def test_a_second_late_rank_behind_the_first_is_found_and_the_gain_split():
    got = stragglers(hand_built({0: 0, 1: 0, 2: 0, 3: 10_000_000, 4: 20_000_000}), [4, 3, 2, 1, 0])
    assert [(n["rank"], n["pattern"], n["gain_us"]) for n in got["ranks"]] == [(4, "chronic", 10_000.0),
                                                                             (3, "chronic", 10_000.0)]
    assert all(st["by_rank"] == {"4": 10_000.0, "3": 10_000.0} and st["gain_us"] == 20_000.0 for st in got["steps"])
    assert got["what_if_step_us"] == 25_000.0 and got["step_us"] == 45_000.0


def test_a_rank_late_within_the_noise_is_not_named():
    got = stragglers(hand_built({0: 0, 1: 0, 2: 3_000_000}), [2, 1, 0])  # 3 ms of a 28 ms step: under 15%
    assert got["ranks"] == [] and got["most"] == {"rank": 2, "gain_us": 3000.0}
    assert got["most_in_a_step"] == {"rank": 2, "step": 2, "gain_us": 3000.0}


def test_a_rank_late_in_one_step_is_transient_with_that_step():
    got = stragglers(hand_built({0: 0, 1: 0, 2: 20_000_000}, steps=5, only=3), [2, 1, 0])
    assert [(n["rank"], n["pattern"], n["late_steps"], n["gain_us"]) for n in got["ranks"]] == [
        (2, "transient", [3], 20_000.0)]
    assert [st["gain_us"] for st in got["steps"]] == [0.0, 0.0, 0.0, 20_000.0, 0.0]
    assert got["gain_us"] == 0.0 and got["what_if_step_us"] == got["step_us"] == 25_000.0


def test_a_rank_that_goes_on_before_gloos_recorded_end_waited_for_the_late_rank():
    """gloo's thread records a collective's end after it let the waiting ranks go (on 2 cores, 0.1 ms after a
    4-rank job's rank had gone on): what they did next waited for the collective's start, the late rank's arrival,
    and fixing the late rank shortens the step by its sleep (before, the wait counted as their own work, and a 30 ms
    sleep in one step of a real gloo job was found worth 0 ms in 3 runs of 8)."""
    ms = 1_000_000
    rows, anchors = [], []
    for step in range(3):
        t0 = step * 100 * ms
        for r in range(3):
            late = 30 * ms if r == 2 else 0
            # A, reduced while the rank works on; B, the bucket after the late rank's sleep, which every rank waits for
            rows += [{"rank": r, "index": 2 * step, "instance": 2 * step, "cpu_start_ns": t0 + 10 * ms,
                      "cpu_end_ns": t0 + 10 * ms + 1, "gpu_start_ns": pd.NA, "done_ns": t0 + 11 * ms},
                     {"rank": r, "index": 2 * step + 1, "instance": 2 * step + 1, "cpu_start_ns": t0 + 12 * ms + late,
                      "cpu_end_ns": t0 + 12 * ms + late + 1, "gpu_start_ns": pd.NA, "done_ns": t0 + 44_500_000}]
            anchors.append({"rank": r, "anchor": "step", "key": step, "floor_ns": t0, "host_ns": t0 + 44_400_000})
    tl = timeline(pd.DataFrame(rows).astype({"gpu_start_ns": "Int64"}), pd.DataFrame(anchors), {})
    assert replay(tl) == {s: 44_400_000 for s in range(3)}  # as measured
    assert replay(tl, {2}) == {s: 14_400_000 for s in range(3)}
    got = stragglers(tl, [2, 1, 0])
    assert [(n["rank"], n["pattern"], n["gain_us"]) for n in got["ranks"]] == [(2, "chronic", 30_000.0)]


def test_a_node_waits_for_the_latest_begun_of_several_gloo_collectives_in_flight():
    """Two gloo collectives in flight (DDP's buckets): rank 0 arrives at A (10) and B (25) and ends its step at 70,
    after A began (rank 1 arrives at 50) but before B did (80) and before either's recorded end: the step's end
    waited for A's start, not for its own work (the later-arrived B, not yet begun, does not hide A)."""
    rows = [{"rank": r, "index": i, "instance": i, "cpu_start_ns": t, "cpu_end_ns": t + 1, "gpu_start_ns": pd.NA,
             "done_ns": done} for r, i, t, done in ((0, 0, 10, 100), (0, 1, 25, 200), (1, 0, 50, 100),
                                                    (1, 1, 80, 200))]
    anchors = [{"rank": r, "anchor": "step", "key": 0, "floor_ns": 0, "host_ns": end} for r, end in ((0, 70), (1, 210))]
    tl = timeline(pd.DataFrame(rows).astype({"gpu_start_ns": "Int64"}), pd.DataFrame(anchors), {})
    end = tl.bounds[(0, 0)][1]
    assert (tl.pred[(0, end)], tl.work[(0, end)]) == (("start", 0), 20)
    assert replay(tl) == {0: 210}


def test_another_ranks_wait_for_a_gloo_start_is_not_given_at_a_collective_with_kernels():
    """A fixed rank takes the median other rank's work from the same predecessor: where that rank waited for a gloo
    collective's start, and the fixed rank's collective at that place has kernels (whose end is known), it does not
    wait for that start instead (it would skip the collective's transfer and overstate the gain)."""
    rows = [{"rank": r, "index": i, "instance": inst, "cpu_start_ns": t, "cpu_end_ns": t + 1,
             "gpu_start_ns": g, "done_ns": done}
            for r, i, inst, t, g, done in ((1, 0, 0, 10, pd.NA, 60), (2, 0, 0, 20, pd.NA, 60),  # gloo: ranks 1, 2
                                           (2, 1, 1, 25, 25, 40), (0, 0, 1, 30, 30, 40))]  # kernels: ranks 0, 2
    anchors = [{"rank": r, "anchor": "step", "key": 0, "floor_ns": 0, "host_ns": end}
               for r, end in ((0, 150), (1, 55), (2, 58))]
    tl = timeline(pd.DataFrame(rows).astype({"gpu_start_ns": "Int64"}), pd.DataFrame(anchors), {})
    assert tl.pred[(1, 2)] == ("start", 0)  # rank 1's step end waited for the gloo collective's start
    work, pred = tl.others[(0, 2)]
    assert work == 35 and pred is None  # rank 1's work, but no start of rank 0's collective with kernels to wait for
    assert replay(tl, {0}) == replay(tl)
