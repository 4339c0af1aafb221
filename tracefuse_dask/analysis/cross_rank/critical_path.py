"""The cross-rank critical path of each step (``stitch``) from the ranks' walks (``per_rank.walker``), what bounds
it (``bound``), and why the straggler is late (``straggler_cause``). Pure functions, no IO, no Dask.

Reduce (``stitch``): from the end of each step on the rank that finished last (clocks corrected), follow the
walks; at a matched collective, the transfer runs from the last participant's arrival, and the walk goes on
from that rank's arrival. The chain is what determined the step's length.

``straggler_cause`` compares, for the collectives the straggler reached last, the work each rank did since its
previous collective (``path_work``, by name) with the median rank's.
"""
from __future__ import annotations

from collections import defaultdict, namedtuple
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

from ...kineto.vocabulary import BLOCKING_CALLS, BLOCKING_COPIES, kernel_label
from ..schema import CATEGORIES, GPU_KINDS, KINDS, NO_EVENT, PATH_COLUMNS, WORK_KINDS, step_name

__all__ = ["CAUSE_SHARE", "bound", "stitch", "straggler_cause", "walks_in"]

CAUSE_SHARE = 0.2
"""An op is a straggler's cause when it accounts for at least this share of the straggler's extra time."""

_CAUSES = {"cpu_op": "host-bound", "launch gap": "host-bound", "idle": "host-bound", "memcpy": "memcpy or data loading",
           "sync wait": "synchronisation", "collective transfer": "synchronisation"}

_Anchor = namedtuple("_Anchor", ["shift", "stop", "stop_call", "stop_ns"])  # what ``stitch`` reads of an anchor

_Walks = namedtuple("_Walks", ["anchor", "shift"])  # in ``stitch``: an anchor's walks, on its rank's corrected clock


def stitch(anchors: pd.DataFrame, segments_of: Callable[[list[tuple[int, int]]], pd.DataFrame], calls: pd.DataFrame,
           matched: pd.DataFrame, offsets_ns: Mapping[int, float],
           texts: Mapping[int, Sequence[str]]) -> tuple[pd.DataFrame, list[dict[str, Any]], int]:
    """The critical path of each step across ranks (reduce), from every rank's walks.

    Parameters
    ----------
    anchors
        Every rank's ``rank_pieces`` anchors, with a leading ``rank`` column.
    segments_of
        The segments of the walks ``[(rank, walk), ...]`` (sorted), as ``rank_pieces`` gives them with a leading
        ``rank`` column, each walk's rows together and in order: only the walks the path takes are asked for,
        once, and only when there are any (most of a big job's segments are off the path, and they can stay
        where the ranks were analysed).
    calls
        Every rank's collective calls; ``matched``: those matched into instances (``match_collectives``).
    offsets_ns
        Each rank's clock offset (what to subtract).
    texts
        Each rank's texts (``RankTables.texts``).

    Returns
    -------
    path, steps, origin
        One row per segment (``PATH_COLUMNS``, ``start_us`` from ``origin``); per step ``{step, start_us,
        duration_us, host_us, path_us, gpu_us, by_rank, by_kind, by_category, syncs, top}``; the absolute ns
        (clocks corrected) where the first step starts. A step runs from its earliest start on any rank to its
        latest end, the end of the device work launched in it included (``host_us``: to its latest host end, the
        step's period on the host); steps whose device work runs into the next step's overlap. When the path's
        first rank began it later, that wait is an ``idle`` segment. Step -1 is the whole trace, for ranks without
        steps.
    """
    if anchors.empty:
        return pd.DataFrame(columns=PATH_COLUMNS), [], 0
    off = {int(r): round(v) for r, v in offsets_ns.items()}  # whole ns: absolute ns overflow a float's 53 bits
    a = anchors.assign(shift=anchors["rank"].map(lambda r: off.get(int(r), 0)).astype("int64"))
    by_anchor = {(r, k, key): _Anchor(*row) for r, k, key, *row in zip(
        *(a[c].tolist() for c in ("rank", "anchor", "key", "shift", "stop", "stop_call", "stop_ns")))}
    walks_of: dict[tuple[int, str, int], list[int]] = defaultdict(list)  # a step of a rank can have two anchors
    for r, k, key, walk in zip(a["rank"].tolist(), a["anchor"], a["key"].tolist(), a["walk"].tolist()):
        walks_of[(r, k, key)].append(walk)
    chains, host_end = _chains(a, by_anchor, calls, matched, off)
    wanted = sorted({(w.anchor[0], walk) for _, chain, _, _ in chains for w in chain if type(w) is _Walks
                     for walk in walks_of[w.anchor]})
    segments = segments_of(wanted) if wanted else pd.DataFrame()
    rows_of = _runs(segments["rank"].to_numpy(), segments["walk"].to_numpy()) if len(segments) else {}
    columns = [segments[c].to_numpy() for c in ("kind", "name", "start_ns", "end_ns", "pid", "tid", "event_ns",
                                                "category")] if len(segments) else []

    def segs_of(cur: tuple[int, str, int], shift: int) -> list[tuple[Any, ...]]:
        """The segments of an anchor's walks, decoded, on the rank's corrected clock. ``event_ts`` is the event's
        start as Python divides exact ints (one rounding; numpy's float division would move the last digit)."""
        r, text = cur[0], texts[cur[0]]
        idx = [rows_of[(r, walk)] for walk in walks_of[cur] if (r, walk) in rows_of]
        if not idx:
            return []
        return [(r, KINDS[k], text[n], t0 - shift, t1 - shift, text[p], text[q], t / 1000 if t != NO_EVENT else np.nan,
                 CATEGORIES[c])
                for k, n, t0, t1, p, q, t, c in zip(*(np.concatenate([v[i] for i in idx]).tolist() for v in columns))]
    paths: list[tuple[int, list[tuple[Any, ...]], int, int]] = []
    for step, chain, begin, end in chains:
        path: list[tuple[Any, ...]] = []
        for w in chain:
            path += segs_of(*w) if type(w) is _Walks else [w]
        path.sort(key=lambda p: (p[3], p[4]))
        if begin is None:  # no steps: the whole trace, from where the path starts
            begin = path[0][3] if path else int(end)
        # a call's walk may go back past this step's start (to an earlier step's, whose device work the call ran in)
        path = [p if p[3] >= begin else (*p[:3], begin, *p[4:]) for p in path if p[4] > begin]
        if path and path[0][3] > begin:  # the rank where the path starts began the step after another rank did
            path.insert(0, (path[0][0], "idle", f"not yet in ProfilerStep#{step}", begin, path[0][3], "", "",
                            np.nan, ""))
        paths.append((step, path, begin, end))
    origin = min((b for _, _, b, _ in paths), default=0)
    rows = [(step, k, r, kind, name, (t0 - origin) / 1e3, (t1 - t0) / 1e3, *event)
            for step, path, _, _ in paths for k, (r, kind, name, t0, t1, *event) in enumerate(path)]
    steps = [_step_summary(step, path, (b - origin) / 1e3, e - b, host_end[step] - b) for step, path, b, e in paths]
    return pd.DataFrame(rows, columns=PATH_COLUMNS), steps, int(origin)


def _chains(a: pd.DataFrame, by_anchor: Mapping[tuple[int, str, int], Any], calls: pd.DataFrame,
            matched: pd.DataFrame, off: Mapping[int, int]) -> tuple[list[tuple[int, list[Any], int | None, int]],
                                                                  dict[int, int]]:
    """Per step, from its end on the rank that finished last: the anchors whose walks the path takes, one after the
    other, and the collective transfers between them (at a matched collective, from the last participant's
    arrival); with the step's begin and end. Also each step's latest host end."""
    arrival = _arrivals(calls, off)
    op_of = {(r, c): op for r, c, op in zip(*(calls[k].tolist() for k in ("rank", "index", "op")))}
    members: dict[int, list[tuple[int, int]]] = defaultdict(list)
    instance_of: dict[tuple[int, int], int] = {}
    for r, c, i in zip(*(matched[k].astype("int64").tolist() if k in matched else [] for k in
                         ("rank", "index", "instance"))):
        members[i].append((r, c))
        instance_of[(r, c)] = i
    chains: list[tuple[int, list[Any], int | None, int]] = []  # per step: its anchors' walks and transfers
    ends = a[a["anchor"] == "step"].assign(end=a["at_ns"] - a["shift"], floor=a["floor_ns"] - a["shift"],
                                           host=a["host_ns"] - a["shift"])
    latest = ends["end"] == ends.groupby("key")["end"].transform("max")
    by_step = pd.DataFrame({"last": ends[latest].groupby("key")["rank"].min(),
                            "begin": ends.groupby("key")["floor"].min(), "end": ends.groupby("key")["end"].max(),
                            "host": ends.groupby("key")["host"].max()})
    host_end = dict(zip(by_step.index.tolist(), by_step["host"].astype("int64").tolist()))
    for step, last, begin, end in zip(by_step.index.tolist(), by_step["last"].tolist(), by_step["begin"].tolist(),
                                      by_step["end"].tolist()):
        begin = None if pd.isna(begin) else int(begin)
        chain: list[Any] = []
        cur = (last, "step", int(step))
        seen = set()
        while cur in by_anchor and cur not in seen:
            seen.add(cur)
            r = cur[0]
            row = by_anchor[cur]
            chain.append(_Walks(cur, row.shift))
            if row.stop != "call":
                break
            c, t = int(row.stop_call), int(row.stop_ns) - row.shift
            if begin is not None and t <= begin:  # the walk reached the step's start: the rest is cut anyway
                break
            inst = instance_of.get((r, c))
            nxt = (r, c)
            if inst is not None:
                who = sorted(((arrival[m], m) for m in members[inst] if m in arrival), key=lambda x: (-x[0], x[1][0]))
                if who and who[0][0] <= t:
                    nxt = who[0][1]
            t0 = min(arrival.get(nxt, t), t)
            if t0 < t:
                chain.append((nxt[0], "collective transfer", op_of.get((r, c), "collective"), t0, t, "", "", np.nan,
                              ""))
            if begin is not None and t0 <= begin:
                break
            cur = (nxt[0], "call", nxt[1])
        chains.append((int(step), chain, begin, int(end)))
    return chains, host_end


def walks_in(segments: pd.DataFrame, wanted: Sequence[tuple[int, int]]) -> pd.DataFrame:
    """The rows of ``segments`` (with a ``rank`` column) of the walks ``wanted`` (``[(rank, walk), ...]``), for
    ``stitch``; ``segments`` as it is when it has no rows (then, with no ranks, it may have no other column)."""
    if not len(segments):
        return segments
    key = segments["rank"].to_numpy(dtype=np.int64) << 32 | segments["walk"].to_numpy(dtype=np.int64)
    return segments[np.isin(key, [r << 32 | w for r, w in wanted])]


def _runs(rank: np.ndarray, walk: np.ndarray) -> dict[tuple[int, int], Any]:
    """The rows of each (rank, walk): a slice, as each rank's walks come one after the other (an index array
    where one's rows are not together)."""
    if len(rank) == 0:
        return {}
    cut = np.flatnonzero((rank[1:] != rank[:-1]) | (walk[1:] != walk[:-1])) + 1
    first, stop = np.r_[0, cut].tolist(), np.r_[cut, len(rank)].tolist()
    runs = {(r, w): slice(a, b) for r, w, a, b in zip(rank[first].tolist(), walk[first].tolist(), first, stop)}
    if len(runs) == len(first):
        return runs
    return pd.DataFrame({"rank": rank, "walk": walk}).groupby(["rank", "walk"], sort=False).indices


def _arrivals(calls: pd.DataFrame, off: Mapping[int, int]) -> dict[tuple[int, int], int]:
    """Each call's arrival, clocks corrected: its first collective kernel's start, else its CPU start."""
    t = calls["gpu_start_ns"].astype("Int64").fillna(calls["cpu_start_ns"].astype("Int64"))
    return {(int(r), int(c)): int(v) - off.get(int(r), 0) for r, c, v in zip(calls["rank"], calls["index"], t)}


def _step_summary(step: int, path: Sequence[tuple[Any, ...]], start_us: float, duration_ns: int,
                  host_ns: int) -> dict[str, Any]:
    by_rank: dict[int, float] = defaultdict(float)
    by_kind: dict[str, float] = defaultdict(float)
    by_item: dict[tuple[int, str, str], float] = defaultdict(float)
    by_category: dict[str, float] = defaultdict(float)
    syncs: dict[str, float] = defaultdict(float)
    gpu = 0.0
    for r, kind, name, t0, t1, *_, category in path:
        d = (t1 - t0) / 1e3
        by_rank[r] += d
        by_kind[kind] += d
        by_item[(r, kind, name)] += d
        if category:
            by_category[category] += d
        if kind in GPU_KINDS or name == "GPU idle":
            gpu += d
        elif kind == "sync overhead":
            syncs[name] += d
    total = sum(by_rank.values())
    top = sorted(by_item.items(), key=lambda kv: (-kv[1], kv[0]))[:10]
    return {"step": step, "start_us": round(start_us, 3), "duration_us": round(duration_ns / 1e3, 3),
            "host_us": round(host_ns / 1e3, 3), "path_us": round(total, 3), "gpu_us": round(gpu, 3),
            "by_rank": {str(r): round(v, 3) for r, v in sorted(by_rank.items())},
            "by_kind": {k: round(v, 3) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
            "by_category": {k: round(v, 3) for k, v in sorted(by_category.items(), key=lambda kv: (-kv[1], kv[0]))},
            "syncs": [k for k, _ in sorted(syncs.items(), key=lambda kv: (-kv[1], kv[0]))],
            "top": [{"rank": r, "kind": k, "name": n, "us": round(v, 3), "share": round(v / total, 4) if total else 0.0}
                    for (r, k, n), v in top]}


def straggler_cause(rank: int | None, instances: pd.DataFrame, matched: pd.DataFrame, work: pd.DataFrame,
                    steps: int, gpu: bool, texts: Mapping[int, Sequence[str]],
                    late_steps: Collection[int] | None = None, behind: bool = False) -> dict[str, Any] | None:
    """Why ``rank`` is late: its work before the collectives it reached last (``behind``: after the median rank,
    as for a second straggler, which another one hides; in ``late_steps``, when given), against the median
    rank's, by name.

    For each such collective, the median rank is the other participant whose time since its previous collective
    is the median one. ``extra_us`` is how much longer ``rank`` took to reach those collectives (never less
    than 0 per collective), per step (of ``steps``); the differences by (kind, name) are ranked, and the cause's
    kind is the class of the largest ones (host-bound, slower kernels, more work, memcpy or data loading,
    synchronisation). An op is the cause only when its difference is at least ``CAUSE_SHARE`` of the extra time;
    else the verdict says that no single op explains it. ``work`` is every rank's ``rank_pieces`` work, with a
    leading ``rank`` column; ``texts`` each rank's texts (``RankTables.texts``).
    """
    if rank is None or instances.empty or work.empty:
        return None
    mine = (instances["last_rank"] == rank) | behind
    if late_steps is not None:
        mine &= instances["step"].isin(list(late_steps)).to_numpy(dtype=bool)
    late = instances.loc[mine, "instance"].astype(int).tolist()
    call_of = {(int(i), int(r)): int(c) for i, r, c in zip(matched["instance"], matched["rank"], matched["index"])}
    parts = work.groupby(["rank", "call"], sort=False).indices
    columns = [work[c].to_numpy() for c in ("kind", "name", "cat", "count", "ns")]
    interval = work[work["kind"] == WORK_KINDS.index("interval")]  # one row per call
    length = {(int(r), int(c)): float(ns) for r, c, ns in zip(interval["rank"], interval["call"], interval["ns"])}
    diff: dict[tuple[str, str], float] = defaultdict(float)
    counts: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
    cat_of: dict[tuple[str, str], str] = {}
    extra = idle = span = 0.0
    medians = []
    kept = []
    for inst in late:
        if (inst, rank) not in call_of:
            continue
        mine = (rank, call_of[(inst, rank)])
        others = sorted((length[(r, c)], r) for (i, r), c in call_of.items()
                        if i == inst and r != rank and (r, c) in length)
        if mine not in parts or not others:
            continue
        med_len, med = others[(len(others) - 1) // 2]
        if behind and length[mine] <= med_len:
            continue
        kept.append(inst)
        medians.append(med)
        extra += max(0.0, length[mine] - med_len)
        span += length[mine]
        for key, sign, side in ((mine, 1.0, 0), ((med, call_of[(inst, med)]), -1.0, 1)):
            text = texts[key[0]]
            for code, name_code, cat_code, n, ns in zip(*(v[parts[key]].tolist() for v in columns)):
                kind, name, cat = WORK_KINDS[code], text[name_code], text[cat_code]
                if kind == "idle" and side == 0:
                    idle += ns
                if kind in ("idle", "interval"):
                    continue
                diff[(kind, name)] += sign * ns
                counts[(kind, name)][side] += int(n)
                cat_of.setdefault((kind, name), cat)
    positive = sorted(((v, k) for k, v in diff.items() if v > 0), key=lambda x: (-x[0], x[1]))
    if not positive or not extra:
        return None
    n_steps = max(1, steps)
    classes: dict[str, float] = defaultdict(float)
    top = []
    for v, key in positive[:10]:
        cls = _cause_class(*key, *counts[key])
        classes[cls] += v
        top.append({"name": key[1], "kind": key[0], "cause": cls, "extra_us": round(v / 1e3 / n_steps, 3),
                    "share": round(min(1.0, v / extra), 4)})
    kind = max(classes.items(), key=lambda kv: kv[1])[0]
    lead = top[0]
    per_step = extra / 1e3 / n_steps
    where = "" if late_steps is None else " (in " + ", ".join(f"ProfilerStep#{s}" for s in sorted(late_steps)) + ")"
    if lead["share"] >= CAUSE_SHARE:
        label = (cat_of.get((lead["kind"], lead["name"])) or lead["kind"]).replace("_", " ")
        verdict = (f"rank {rank} is late to {len(kept)} of {len(instances)} collectives{where} because of `{lead['name']}` "
                   f"({label}): {lead['extra_us'] / 1e3:,.1f} ms per step more than the median rank, "
                   f"{lead['share']:.0%} of its {per_step / 1e3:,.1f} ms of extra time; {kind}")
    else:
        verdict = (f"rank {rank} is late to {len(kept)} of {len(instances)} collectives{where} by {per_step / 1e3:,.1f} ms "
                   f"per step, and no single op explains it: the most, `{lead['name']}`, accounts for "
                   f"{lead['share']:.0%} ({lead['extra_us'] / 1e3:,.1f} ms); {kind}")
    if gpu and span:
        verdict += f": its GPU was idle {100 * idle / span:.0f}% of that time"
    return {"rank": rank, "compared_with": int(pd.Series(medians).mode().min()), "collectives_late": len(kept),
            "extra_us": round(per_step, 3), "kind": kind, "op": lead["name"] if lead["share"] >= CAUSE_SHARE else None,
            "top": top, "verdict": verdict}


def _cause_class(kind: str, name: str, n_mine: int, n_theirs: int) -> str:
    if kind == "kernel":
        return "more work" if n_mine > n_theirs else "slower kernels"
    if kind == "cpu_op" and name in BLOCKING_CALLS:
        return "memcpy or data loading" if name in BLOCKING_COPIES else "synchronisation"
    return _CAUSES.get(kind, "host-bound")


def bound(steps: list[dict[str, Any]], launches: Mapping[str, Any] | None,
          idle_pct: float | None) -> dict[str, Any] | None:
    """What bounds the slowest step, from its critical path (``summary.json``'s ``bound``): GPU-bound when most of
    the path is GPU work (kernels, copies, collectives and the GPU's gaps between them, ``GPU_KINDS``), else
    host-bound, with the evidence (the GPU work by kernel category, or the host's biggest items, and the blocking
    calls that waited for the GPU); ``why``, a line where the launches (``launch_summary``) or the breakdown (the
    median rank's GPU idle %, ``idle_pct``) seem to say otherwise. None without a path."""
    if not steps:
        return None
    slow = max(steps, key=lambda p: p["duration_us"])
    total = slow["path_us"]
    share = slow["gpu_us"] / total if total else 0.0
    which = f"{step_name(slow)}, {slow['duration_us'] / 1e3:,.1f} ms"
    delay = launches["median_launch_delay_us"] if launches else None
    why = None
    if share >= 0.5:
        transfer = slow["by_kind"].get("collective transfer", 0.0)
        gaps = slow["gpu_us"] - sum(slow["by_category"].values()) - transfer  # GPU idle between queued work, waits
        parts = sorted([*slow["by_category"].items(), ("collectives", transfer), ("gaps between GPU work", gaps)],
                       key=lambda kv: -kv[1])
        work = ", ".join(f"{c} {v / total:.0%}" for c, v in parts[:3] if v > 0)
        text = f"GPU-bound: {share:.0%} of the slowest step's critical path ({which}) is GPU work: {work}"
        if slow["syncs"]:
            text += f"; the host waits in `{slow['syncs'][0]}` for it"
        if idle_pct is not None and idle_pct > 50:
            why = (f"the GPU is idle {idle_pct:.0f}% of the trace (breakdown), yet the step waited for it: "
                   + (f"{gaps / total:.0%} of the path is gaps between GPU work already queued, held by what the "
                      f"trace does not show (another stream's event, the network, a copy), not by the host"
                      if gaps / total > 0.25 else "its idle time is in other steps, or in gaps the step's end did "
                                                   "not wait for"))
    else:
        host = [t for t in slow["top"] if t["kind"] not in GPU_KINDS and t["name"] != "GPU idle"][:3]
        items = ", ".join(f"`{kernel_label(t['name'], 80)}` {t['share']:.0%}" for t in host)
        text = f"host-bound: {1 - share:.0%} of the slowest step's critical path ({which}) is on the host: {items}"
        if delay is not None and delay > launches["cutoffs"]["launch_delay_us"]:
            why = (f"kernels wait {delay:,.0f} µs in their launch queues (median, launches), so the GPU is behind the "
                   f"host at times; yet the step's end waited for the host, not for that GPU work")
    return {"bound": "GPU" if share >= 0.5 else "host", "step": slow["step"], "gpu_share": round(share, 4),
            "text": text, "why": why}


