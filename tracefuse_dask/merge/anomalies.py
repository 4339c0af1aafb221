"""The anomalies of one rank's events as a merge keeps them (``kineto.anomalies``), from the slices the lanes read
(``lanes.slices``): the profiler's window from its marks, each launch and its device work from their
correlation flows (``ac2g``), and the steps from the host's ``ProfilerStep#N`` slices."""
from __future__ import annotations

from collections.abc import Callable, Iterable
from itertools import compress
from operator import attrgetter, methodcaller
from typing import Any

import numpy as np
from msgspec import UNSET

from ..kineto.anomalies import WINDOW, count_anomalies
from ..kineto.vocabulary import STEP, is_correlation_flow
from .lanes import Slices, column, get

__all__ = ["rank_anomalies"]

_INSTANT = frozenset(("i", "I"))
_ENDS = frozenset(("s", "f"))
_NAME = attrgetter("name")


def rank_anomalies(body: list[Any], s: Slices, device_pids: set[int], structs: bool, shifted: bool,
                   negative_dur: int) -> dict[str, int]:
    """``kineto.anomalies.count_anomalies`` of ``body`` (one rank's events after the merge's rewrite, ``s`` its
    slices); ``device_pids``: the merged pids of its devices; ``shifted`` as for ``lanes.slices``;
    ``negative_dur``: the slices left out for a negative duration."""
    marks = s.marks
    ph, cat, name = (attrgetter(k) if structs else methodcaller("get", k) for k in ("ph", "cat", "name"))
    if s.kinds is not None:  # the marks' phases and categories, from their kinds (slices() gives both)
        keys = s.kinds.keys
        instants = list(compress(marks, np.array([k[0] in _INSTANT for k in keys], dtype=bool)[s.mark_codes]))
        flows = list(compress(marks, np.array([k[0] in _ENDS and is_correlation_flow(k[3]) for k in keys],
                                              dtype=bool)[s.mark_codes]))
    else:
        instants = list(compress(marks, map(_INSTANT.__contains__, map(ph, marks))))
        flows = list(compress(marks, map(_ENDS.__contains__, map(ph, marks))))
        linking = {c for c in set(map(cat, flows)) if is_correlation_flow(c)}
        flows = list(compress(flows, map(linking.__contains__, map(cat, flows))))
    instants = [e for e in instants if name(e) in WINDOW]
    at = column(instants, "ts", structs, shifted).tolist()
    opens = [t for e, t in zip(instants, at) if name(e) == WINDOW[0]]
    closes = [t for e, t in zip(instants, at) if name(e) == WINDOW[1]]
    launched_at, device_start = _linked(flows, ph, attrgetter("id") if structs else methodcaller("get", "id"),
                                        column(flows, "ts", structs, shifted))
    return count_anomalies(s.start, _ends(body, s, structs, shifted), opens, closes, launched_at, device_start,
                           _steps(s, device_pids, structs) if len(launched_at) else (), negative_dur)


def _ends(body: list[Any], s: Slices, structs: bool, shifted: bool) -> np.ndarray:
    """The slices' ends, where a ``B`` that no ``E`` closes ends as the analysis ends it: at the rank's last time
    (the latest start or end of an event that is not metadata or a python_function)."""
    if not any(t is None for *_, t in s.pairs):
        return s.end
    timed = [e for e in body if get(e, "ph") != "M" and get(e, "cat") != "python_function"]
    last = int((column(timed, "ts", structs, shifted) + column(timed, "dur", structs)).max())
    return np.where(s.end > s.last, last, s.end)


def _linked(flows: list[Any], ph: Callable[[Any], Any], flow_id: Callable[[Any], Any],
            at: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For each flow end (``f``) whose start (``s``, the first of its id) is among ``flows``: the start's time and
    its own (``at``, ns), a launch and the device work it links to. ``ph`` and ``flow_id`` read an event's."""
    try:
        ids = np.fromiter(map(flow_id, flows), dtype=np.int64, count=len(flows))
    except (TypeError, ValueError, OverflowError):  # an id that is text or beyond int64: numbered; absent: unpaired
        codes: dict[Any, int] = {}
        ids = np.array([-1 - k if i is None or i is UNSET else codes.setdefault(i, len(codes))
                        for k, i in enumerate(map(flow_id, flows))], dtype=np.int64)
    starts = np.fromiter(map("s".__eq__, map(ph, flows)), dtype=bool, count=len(flows))
    s_ids, first = np.unique(ids[starts], return_index=True)
    if not len(s_ids):
        return at[:0], at[:0]
    e_ids, e_at = ids[~starts], at[~starts]
    pos = np.minimum(np.searchsorted(s_ids, e_ids), len(s_ids) - 1)
    found = s_ids[pos] == e_ids
    return at[starts][first][pos[found]], e_at[found]


def _steps(s: Slices, device_pids: set[int], structs: bool) -> Iterable[tuple[int, int]]:
    """The ``[start, end)`` of each host ``ProfilerStep#N`` slice."""
    rows = np.arange(len(s.x) + len(s.pairs))  # each name's slice (its row of s.start)
    x = s.x
    if s.x_tracks is not None:  # the names of the host's slices only (a device's slice is never a step)
        on_host = np.isin(s.x_tracks >> 32, list(device_pids), invert=True)
        x = list(compress(x, on_host.tolist()))
        rows = np.concatenate([np.flatnonzero(on_host), rows[len(s.x):]])
    names = (list(map(_NAME, x)) if structs else [e.get("name") for e in x]) + [get(b, "name") for b, *_ in s.pairs]
    stepped = {n for n in set(names) if type(n) is str and STEP.match(n)}
    at_step = rows[np.fromiter(compress(range(len(names)), map(stepped.__contains__, names)), dtype=np.int64)]
    host = [get(s.x[i] if i < len(s.x) else s.pairs[i - len(s.x)][0], "pid") not in device_pids
            for i in at_step.tolist()]  # the pairs', and the slices' where x_tracks did not leave them out
    at_step = at_step[np.array(host, dtype=bool)]
    return zip(s.start[at_step].tolist(), s.end[at_step].tolist())
