"""What fixing a straggler is worth: the job's steps replayed across ranks, with late work at the others' duration.

The replay is a dependency graph of each rank's timeline. A rank's *nodes* are its steps' starts and ends
(``ProfilerStep#N``) and its arrivals at collectives (the first kernel's start, else the call's start, clocks
corrected). Each node waits for its *predecessor*, the latest of the rank's previous node, the latest end of a
collective on the rank before it (``done_ns``: a collective's last kernel, gloo's execution, else the call) and,
for a collective without kernels that the rank arrived at before, its start when the node came after it but before
its recorded end; it then works for ``work``, its time since that predecessor. A collective starts when the last of
its ranks arrives and ends as long after that as it did on the first rank to end it (gloo's threads end late on a
busy machine; the ranks that go on before their own end show when it really ended). gloo's thread records the end
after it has let the waiting rank go: on 2 cores, a rank that waited 30 ms for a late rank went on 0.1 ms before
the end on record, and its next node waits for the start, or the wait would count as its own work and no fix of
the late rank could shorten it. Replayed as measured, the graph gives back every step's time exactly.

A what-if gives a rank's nodes the work the other ranks did: each node's work, where it is more than the median of
the other ranks' work at the same node (the same collective, or the same step's start or end), becomes that
median, and the graph is replayed. A step's time is its slowest rank's, from the step's start to its end.

``stragglers`` names the ranks whose fix is worth it: the ranks whose fix alone shortens the steps by a significant
share of the step time, beyond the job's step-to-step noise, in most steps (chronic) or in a few by much
(transient). Pure functions, no IO, no Dask.
"""
from __future__ import annotations

from bisect import bisect_left
from collections import defaultdict
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from .critical_path import CAUSE_SHARE

__all__ = ["ASSUMES", "NOISE", "SIGNIFICANT", "TRANSIENT", "Timeline", "replay", "stragglers", "timeline", "verdict"]

SIGNIFICANT = 0.15
"""A straggler's fix must save this share of the median step time (and ``NOISE`` times the step-to-step spread)."""
NOISE = 2.5
"""... and this many times the step-to-step spread (the median absolute deviation of the step times)."""
TRANSIENT = 0.4
"""A rank late in a few steps only must save this share of the median step time in each."""
ASSUMES = ("assumes the late ranks do the median other rank's work between collectives, and that every collective "
           "and every other rank's work takes as long as it did")
_END, _START, _ARRIVE = 0, 1, 2  # node kinds, in the order they sort at one time: a step ends before the next starts


@dataclass
class Timeline:
    """Every rank's nodes and the collectives between them, ready to replay (``timeline``)."""

    steps: list[int]  # the steps every replayed rank has, ascending
    ranks: list[int]
    order: list[tuple[int, int, int, int]]  # what to compute, in an order that has each item's inputs first
    time: dict[tuple[int, int], int]  # (rank, node): measured time (ns, clocks corrected)
    work: dict[tuple[int, int], int]  # (rank, node): time since its predecessor
    # (rank, node): ("node", n), ("end", instance) or ("start", instance), or None
    pred: dict[tuple[int, int], tuple[str, int] | None]
    slot: dict[tuple[int, int], tuple[int, int]]  # (rank, node): (kind, step or instance)
    members: dict[int, list[int]]  # instance: its ranks
    arrival: dict[tuple[int, int], int]  # (instance, rank): the node of its arrival
    transfer: dict[int, int]  # instance: its end (on the first rank to end it) after its last arrival
    start: dict[int, int]  # instance: its last arrival
    bounds: dict[tuple[int, int], tuple[int, int]]  # (rank, step): its start and end nodes
    # (rank, node): the median other rank's work at the same slot, and its predecessor in this rank's terms
    others: dict[tuple[int, int], tuple[int, tuple[str, int] | None]]
    on_host: set[int]  # the instances without kernels (gloo's): a node may wait for their start


def timeline(matched: pd.DataFrame, anchors: pd.DataFrame, offsets_ns: Mapping[int, float]) -> Timeline | None:
    """The replay graph of a job (None when fewer than two ranks share a step): ``matched``, the collective calls
    matched into instances (``cross_rank.collectives.match_collectives``, with ``done_ns``); ``anchors``, every rank's
    ``per_rank.walker.rank_pieces`` anchors with a leading ``rank`` column (a step's start, ``floor_ns``, and its
    end on the host, ``host_ns``); ``offsets_ns``, each rank's clock offset (what to subtract)."""
    if anchors.empty or matched.empty:
        return None
    off = {int(r): round(v) for r, v in offsets_ns.items()}
    s = anchors[(anchors["anchor"] == "step") & (anchors["key"] >= 0)].dropna(subset=["floor_ns", "host_ns"])
    by_rank: dict[int, dict[int, tuple[int, int]]] = defaultdict(dict)
    for r, step, a, b in zip(*(s[c].tolist() for c in ("rank", "key", "floor_ns", "host_ns"))):
        by_rank[int(r)][int(step)] = (int(a) - off.get(int(r), 0), int(b) - off.get(int(r), 0))
    shared = set.intersection(*(set(v) for v in by_rank.values())) if by_rank else set()
    if len(by_rank) < 2 or not shared:
        return None
    steps, ranks = sorted(shared), sorted(by_rank)
    nodes: dict[int, list[tuple[int, int, int]]] = {r: [] for r in ranks}  # (time, kind, step or instance)
    for r in ranks:
        for step in steps:
            a, b = by_rank[r][step]
            nodes[r] += [(a, _START, step), (b, _END, step)]
    m = matched[matched["rank"].isin(ranks)]
    members: dict[int, list[int]] = defaultdict(list)
    last: dict[int, int] = {}  # each instance's last arrival
    done: dict[int, int] = {}  # and its first end
    on_host: set[int] = set()  # the instances without kernels
    if len(m):
        arrive = m["gpu_start_ns"].astype("Int64").fillna(m["cpu_start_ns"].astype("Int64"))
        ends = m["done_ns"].astype("Int64").fillna(m["cpu_end_ns"].astype("Int64"))
        for r, i, a, d, host in zip(m["rank"].astype(int).tolist(), m["instance"].astype(int).tolist(),
                                    arrive.tolist(), ends.tolist(), m["gpu_start_ns"].isna().tolist()):
            a, d = a - off.get(r, 0), d - off.get(r, 0)
            nodes[r].append((a, _ARRIVE, i))
            members[i].append(r)
            last[i], done[i] = max(last.get(i, a), a), min(done.get(i, d), d)
            if host:
                on_host.add(i)
    for i, t in last.items():
        done[i] = max(t, done[i])  # a collective ends after it starts
    tl = Timeline(steps, ranks, order=[], time={}, work={}, pred={}, slot={},
                  members={i: sorted(v) for i, v in members.items()}, arrival={},
                  transfer={i: done[i] - t for i, t in last.items()}, start=dict(last), bounds={}, others={},
                  on_host=on_host)
    for r in ranks:
        nodes[r].sort()
        ends = sorted((done[i], i) for _, kind, i in nodes[r] if kind == _ARRIVE)
        end_times = [t for t, _ in ends]
        in_flight: list[int] = []  # the collectives without kernels the rank has arrived at, not yet ended
        for n, (t, kind, ref) in enumerate(nodes[r]):
            tl.time[(r, n)], tl.slot[(r, n)] = t, (kind, ref)
            k = bisect_left(end_times, t) - 1  # the latest end before it
            # (time, rank at a tie, predecessor), the latest wins: the previous node, the latest end, a start
            anchors = [(nodes[r][n - 1][0], 2, ("node", n - 1))] if n else []
            if k >= 0:
                anchors.append((end_times[k], 1, ("end", ends[k][1])))
            in_flight = [i for i in in_flight if done[i] > t]  # nodes come in time order: an ended one stays ended
            if begun := [(last[i], i) for i in in_flight if last[i] < t]:
                at, i = max(begun)
                anchors.append((at, 0, ("start", i)))
            if anchors:
                at, _, tl.pred[(r, n)] = max(anchors)
                tl.work[(r, n)] = t - at
            else:
                tl.pred[(r, n)], tl.work[(r, n)] = None, 0
            if kind == _ARRIVE and ref in on_host:
                in_flight.append(ref)
            tl.order.append((t, 0, r, n))
            if kind == _ARRIVE:
                tl.arrival[(ref, r)] = n
            else:
                bound = tl.bounds.setdefault((r, ref), (-1, -1))
                tl.bounds[(r, ref)] = (n, bound[1]) if kind == _START else (bound[0], n)
    tl.order += [(t, 1, -1, i) for i, t in last.items()] + [(t, 2, -1, i) for i, t in done.items()]
    tl.order.sort()
    by_slot: dict[tuple[int, int], list[tuple[int, int, int]]] = defaultdict(list)
    for (r, n), sl in tl.slot.items():
        if tl.pred[(r, n)] is not None:
            by_slot[sl].append((tl.work[(r, n)], r, n))
    for (r, n), sl in tl.slot.items():
        theirs = sorted(x for x in by_slot[sl] if x[1] != r)
        if theirs and tl.pred[(r, n)] is not None:
            w, q, k = theirs[len(theirs) // 2]  # the median other rank (the slower one of two)
            tl.others[(r, n)] = (w, _translated(tl, (q, k), r, n))
    return tl


def _translated(tl: Timeline, theirs: tuple[int, int], r: int, n: int) -> tuple[str, int] | None:
    """Rank ``q``'s predecessor of its node ``k`` (``theirs``) as the same distance back among rank ``r``'s nodes
    from its node ``n``: the node as many nodes back, or the end (the start) of the collective it arrived at as many
    nodes back; None when ``r`` has no such node, or it is not of the same kind."""
    q, k = theirs
    kind, ref = tl.pred[(q, k)]
    back = k - (ref if kind == "node" else tl.arrival[(ref, q)])
    mine = (r, n - back)
    if mine not in tl.slot or tl.slot[mine][0] != tl.slot[(q, k - back)][0]:
        return None
    if kind == "node":
        return ("node", n - back)
    # the end (start) of a collective this rank had not seen end (start) by then is not what it waited for, nor the
    # start of one with kernels, whose end is known
    i = tl.slot[mine][1]
    if kind == "start" and i not in tl.on_host:
        return None
    return (kind, i) if tl.start[i] + (tl.transfer[i] if kind == "end" else 0) < tl.time[(r, n)] else None


def replay(tl: Timeline, fix: Collection[int] = ()) -> dict[int, float]:
    """Each step's time (ns, its slowest rank's) with the ranks of ``fix`` doing, at each node where they worked
    longer than the median other rank, that rank's work from the same predecessor (nothing fixed: the measured
    times)."""
    value = _times(tl, fix)
    return {s: max(value[("node", r, tl.bounds[(r, s)][1])] - value[("node", r, tl.bounds[(r, s)][0])]
                   for r in tl.ranks) for s in tl.steps}


def _times(tl: Timeline, fix: Collection[int]) -> dict[tuple[Any, ...], float]:
    """The replayed time of every node (``("node", rank, node)``), collective start and end."""
    value: dict[tuple[Any, ...], float] = {}

    def inputs(item: tuple[Any, ...]) -> tuple[list[tuple[Any, ...]], Any]:
        """What ``item`` waits for, and how its time follows from theirs."""
        if item[0] == "start":
            return [("node", q, tl.arrival[(item[1], q)]) for q in tl.members[item[1]]], lambda *t: max(t)
        if item[0] == "end":
            d = tl.transfer[item[1]]
            return [("start", item[1])], lambda t: t + d
        _, r, n = item
        pred, work = tl.pred[(r, n)], tl.work[(r, n)]
        if r in fix and (r, n) in tl.others and tl.others[(r, n)][0] < work and tl.others[(r, n)][1]:
            work, pred = tl.others[(r, n)]  # the other rank's work, from the same predecessor
        if pred is None:
            return [], lambda: tl.time[(r, n)]
        return [("node", r, pred[1]) if pred[0] == "node" else pred], lambda t: t + work

    for t, what, r, x in tl.order:  # in measured time order, so that the walk back is short
        stack = [("node", r, x) if what == 0 else ("start", x) if what == 1 else ("end", x)]
        waiting: set[tuple[Any, ...]] = set()
        while stack:
            item = stack[-1]
            if item in value:
                stack.pop()
                continue
            deps, rule = inputs(item)
            todo = [d for d in deps if d not in value]
            if todo:
                if item in waiting:  # never: every input lies before its item in measured time
                    raise RuntimeError(f"the what-if's graph has a cycle through {item}")
                waiting.add(item)
                stack += todo
                continue
            value[item] = rule(*[value[d] for d in deps])
            stack.pop()
    return value


def stragglers(tl: Timeline | None, candidates: Sequence[int]) -> dict[str, Any] | None:
    """Which of ``candidates`` are stragglers, and what fixing them is worth (``summary.json``'s ``what_if``).

    A candidate's gain in a step is how much shorter its fix makes the step (``replay``). The bar a gain must reach
    is ``SIGNIFICANT`` of the median step time, and ``NOISE`` times the step-to-step spread (the median absolute
    deviation of the step times): a gain within the job's own noise is not a finding. A rank is *chronic* when its
    median gain over the steps reaches the bar, and *transient* when it does not, but in some steps it gains
    ``TRANSIENT`` of the median step time and the bar. The rank that gains most is named and stays fixed, and the
    others are tried again on top of it, until none gains enough: a second late rank hidden behind the first is
    found, and each named rank's part of the gain is what it adds (``by_rank``). The last replay is the what-if.
    None without a timeline.
    """
    candidates = [r for r in candidates if r in tl.ranks] if tl is not None else []
    if not candidates:
        return None
    measured = replay(tl)
    times = np.array([measured[s] for s in tl.steps], dtype=float)
    median = float(np.median(times))
    spread = float(np.median(np.abs(times - median)))
    bar = max(SIGNIFICANT * median, NOISE * spread)
    named: list[dict[str, Any]] = []
    now, first = measured, {}
    while True:
        found = []
        for r in (c for c in candidates if c not in {n["rank"] for n in named}):
            fixed = replay(tl, {n["rank"] for n in named} | {r})
            gain = {s: now[s] - fixed[s] for s in tl.steps}
            if not named:
                first[r] = gain
            typical, total = float(np.median(list(gain.values()))), sum(gain.values())
            if bar <= 0:
                continue
            if typical >= bar:
                found.append((total, -r, typical, "chronic", [s for s in tl.steps if gain[s] >= bar], fixed, gain))
            elif late := [s for s in tl.steps if gain[s] >= max(bar, TRANSIENT * median)]:
                found.append((total, -r, float(np.median([gain[s] for s in late])), "transient", late, fixed, gain))
        if not found:
            break
        _, r, typical, pattern, late, now, gain = max(found, key=lambda f: f[:2])  # the one that saves most in all
        named.append({"rank": -r, "pattern": pattern, "late_steps": late, "gain_us": _us(typical),
                      "by_step": {s: gain[s] for s in tl.steps}})
    steps = [{"step": s, "start_ns": min(tl.time[(r, tl.bounds[(r, s)][0])] for r in tl.ranks),
              "measured_us": _us(measured[s]), "predicted_us": _us(now[s]), "gain_us": _us(measured[s] - now[s]),
              "by_rank": {str(n["rank"]): _us(n["by_step"][s]) for n in named}} for s in tl.steps]
    for n in named:
        del n["by_step"]
    best = max(sorted(first.items()), key=lambda kv: float(np.median(list(kv[1].values()))))
    worst = max(((g, -r, s) for r, gain in first.items() for s, g in gain.items()))  # the most in any one step
    return {"ranks": named, "steps": steps, "step_us": _us(median),
            "what_if_step_us": _us(float(np.median([now[s] for s in tl.steps]))),
            "gain_us": _us(float(np.median([measured[s] - now[s] for s in tl.steps]))),
            "bar_us": _us(bar), "spread_us": _us(spread),
            "most": {"rank": best[0], "gain_us": _us(float(np.median(list(best[1].values()))))},
            "most_in_a_step": {"rank": -worst[1], "step": worst[2], "gain_us": _us(worst[0])},
            "transient_us": _us(max(bar, TRANSIENT * median)),
            "assumes": ASSUMES}


def _us(ns: float) -> float:
    return round(ns / 1e3, 3)


def verdict(waiting: dict[str, Any], table: pd.DataFrame, what_if: dict[str, Any] | None,
            causes: Mapping[int, dict[str, Any] | None]) -> dict[str, Any]:
    """``summary.json``'s ``straggler``: the named straggler (the one whose fix saves most), its pattern and late
    steps, every named rank, the what-if and the lines the CLI and the report print (``evidence``,
    ``what_if_text``). ``waiting``: ``collectives.straggler``'s verdict, from the waiting alone, which is the
    verdict when there is no what-if (no step that every rank has); ``table``: its per-rank table; ``causes``:
    each named rank's ``cross_rank.critical_path.straggler_cause``."""
    if what_if is None:
        return {**waiting, "pattern": None, "late_steps": [], "ranks": [], "what_if": None, "what_if_step_us": None,
                "what_if_text": None, "cause": causes.get(waiting["rank"]) if waiting["rank"] is not None else None}
    named, step = what_if["ranks"], what_if["step_us"]
    last = dict(zip(table["rank"].astype(int).tolist(), table["last_count"].astype(int).tolist()))
    n_steps = len(what_if["steps"])
    bar = (f"the bar: {what_if['bar_us'] / 1e3:,.1f} ms, {SIGNIFICANT:.0%} of the {step / 1e3:,.1f} ms median "
           f"step and {NOISE:g}× its step-to-step spread of {what_if['spread_us'] / 1e3:,.1f} ms")
    for n in named:
        n["by_op"] = _by_op(n, causes.get(n["rank"]))
    if not named:
        most, one = what_if["most"], what_if["most_in_a_step"]
        text = (f"no straggler: fixing any one rank would save at most {most['gain_us'] / 1e3:,.1f} ms per step "
                f"(rank {most['rank']}), under {bar}; and at most {one['gain_us'] / 1e3:,.1f} ms in one step (rank "
                f"{one['rank']}, ProfilerStep#{one['step']}), under the {what_if['transient_us'] / 1e3:,.1f} ms a "
                f"one-step straggler must save ({TRANSIENT:.0%} of the median step)")
        return {**waiting, "rank": None, "pattern": None, "late_steps": [], "ranks": [], "what_if": what_if,
                "what_if_step_us": None, "what_if_text": None, "evidence": text, "cause": None}
    top = named[0]
    # the waiting figures of the named rank, which need not be the one that caused most waiting
    row = table.set_index("rank").loc[top["rank"]]
    total = float(table["wait_caused_us"].sum())
    share = float(row["wait_caused_us"]) / total if total else 0.0
    waiting = {**waiting, "last_count": int(row["last_count"]), "wait_caused_ms": round(float(row["wait_caused_us"])
                                                                                         / 1e3, 3),
               "share_of_wait": round(share, 3),
               "confidence": round(max(0.0, (share - 1 / len(table)) / (1 - 1 / len(table))), 3) if len(table) > 1
               else 0.0}
    text = f"{_named(top, n_steps, step, what_if['steps'])}; last to arrive in {last.get(top['rank'], 0)} of " \
           f"{waiting['collectives']} collectives ({bar})"
    if len(named) > 1:
        text += "; also " + "; also ".join(_named(n, n_steps, step, what_if["steps"], first=False)
                                           for n in named[1:])
    return {**waiting, "rank": top["rank"], "pattern": top["pattern"], "late_steps": top["late_steps"],
            "ranks": named, "what_if": what_if, "what_if_step_us": what_if["what_if_step_us"],
            "what_if_text": _what_if_text(named, what_if), "evidence": text, "cause": causes.get(top["rank"])}


def _named(n: Mapping[str, Any], n_steps: int, step_us: float, steps: Sequence[Mapping[str, Any]],
           first: bool = True) -> str:
    """One named rank, as the verdict says it; after the first, what fixing it saves on top of the ones before."""
    fix = "fixing it" if first else "fixing it as well"
    if n["pattern"] == "chronic":
        return (f"rank {n['rank']}{' is the straggler' if first else ''}, chronic: late in "
                f"{len(n['late_steps'])} of {n_steps} steps; {fix} would save {n['gain_us'] / 1e3:,.1f} ms per step "
                f"(median), {n['gain_us'] / step_us:.0%} of the step")
    which = ", ".join(f"ProfilerStep#{s}" for s in n["late_steps"])
    measured = {st["step"]: st["measured_us"] for st in steps}
    return (f"rank {n['rank']}{' is a straggler' if first else ''} in {len(n['late_steps'])} of {n_steps} steps "
            f"only, transient: {which}, where {fix} would save {n['gain_us'] / 1e3:,.1f} ms of a "
            f"{max(measured[s] for s in n['late_steps']) / 1e3:,.1f} ms step")


def _by_op(n: Mapping[str, Any], cause: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    """A named rank's gain (``gain_us``) split over the ops of its extra time by their shares of it
    (``straggler_cause``'s ``top``, scaled to add up to at most 1); ops under ``CAUSE_SHARE`` are left out."""
    if not cause:
        return []
    scale = max(1.0, sum(t["share"] for t in cause["top"]))
    return [{"name": t["name"], "kind": t["kind"], "gain_us": round(n["gain_us"] * t["share"] / scale, 3)}
            for t in cause["top"] if t["share"] >= CAUSE_SHARE]


def _what_if_text(named: Sequence[Mapping[str, Any]], what_if: Mapping[str, Any]) -> str:
    """The what-if, as the CLI and the report print it."""
    who = " and ".join(f"rank {n['rank']}" for n in named)
    chronic = any(n["pattern"] == "chronic" for n in named)
    if chronic:
        text = (f"with {who} doing the median other rank's work, a step would take "
                f"{what_if['what_if_step_us'] / 1e3:,.1f} ms instead of {what_if['step_us'] / 1e3:,.1f} ms "
                f"(median of {len(what_if['steps'])} steps: {what_if['gain_us'] / 1e3:,.1f} ms faster)")
    else:
        late = [st for st in what_if["steps"] if any(st["step"] in n["late_steps"] for n in named)]
        text = f"with {who} doing the median other rank's work, " + ", ".join(
            f"ProfilerStep#{st['step']} would take {st['predicted_us'] / 1e3:,.1f} ms instead of "
            f"{st['measured_us'] / 1e3:,.1f} ms" for st in late)
    if len(named) > 1 or any(n["by_op"] for n in named):
        text += "; by rank: " + ", ".join(
            f"rank {n['rank']} {n['gain_us'] / 1e3:,.1f} ms"
            + (" (" + ", ".join(f"`{o['name']}` {o['gain_us'] / 1e3:,.1f} ms" for o in n["by_op"]) + ")"
               if n["by_op"] else "") for n in named)
    return f"{text}; {ASSUMES}"
