"""The anomalies of one rank's events as a merge keeps them (``kineto.anomalies``), from the slices the lanes read
(``lanes.slices``): the profiler's window from its marks, each launch and its device work from their
correlation flows (``ac2g``), and the steps from the host's ``ProfilerStep#N`` slices."""
from __future__ import annotations

from itertools import compress
from operator import attrgetter
from typing import Any

import numpy as np

from ..kineto.anomalies import WINDOW, count_anomalies
from ..kineto.vocabulary import STEP, is_correlation_flow
from .lanes import Slices, column, get

__all__ = ["rank_anomalies"]

_INSTANT = ("i", "I")
_FIELDS = attrgetter("ph", "cat", "name", "id")
_NAME = attrgetter("name")


def rank_anomalies(body: list[Any], s: Slices, device_pids: set[int], structs: bool, shifted: bool,
                   negative_dur: int) -> dict[str, int]:
    """``kineto.anomalies.count_anomalies`` of ``body`` (one rank's events after the merge's rewrite, ``s`` its
    slices); ``device_pids``: the merged pids of its devices; ``shifted`` as for ``lanes.slices``;
    ``negative_dur``: the slices left out for a negative duration."""
    marks = s.marks
    rows = list(map(_FIELDS, marks)) if structs else [(e["ph"], e.get("cat"), e.get("name"), e.get("id"))
                                                      for e in marks]
    at = column(marks, "ts", structs, shifted).tolist()
    linking = {c for c in {r[1] for r in rows} if is_correlation_flow(c)}
    opens = [t for (p, _, name, _), t in zip(rows, at) if name == WINDOW[0] and p in _INSTANT]
    closes = [t for (p, _, name, _), t in zip(rows, at) if name == WINDOW[1] and p in _INSTANT]
    launches = {i: t for (p, cat, _, i), t in zip(rows, at) if p == "s" and cat in linking}
    linked = [(launches[i], t) for (p, cat, _, i), t in zip(rows, at) if p == "f" and cat in linking and i in launches]
    launched_at, device_start = (np.array(c, dtype=np.int64) for c in (zip(*linked) if linked else ([], [])))
    names = (list(map(_NAME, s.x)) if structs else [e.get("name") for e in s.x]) + [get(b, "name") for b, *_ in s.pairs]
    stepped = {n for n in set(names) if type(n) is str and STEP.match(n)}
    at_step = np.fromiter(compress(range(len(names)), map(stepped.__contains__, names)), dtype=np.int64)
    host = [get(s.x[i] if i < len(s.x) else s.pairs[i - len(s.x)][0], "pid") not in device_pids
            for i in at_step.tolist()]
    at_step = at_step[np.array(host, dtype=bool)]
    steps = zip(s.start[at_step].tolist(), s.end[at_step].tolist())
    return count_anomalies(s.start, np.minimum(s.end, s.last), opens, closes, launched_at, device_start, steps,
                           negative_dur)
