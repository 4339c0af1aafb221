"""Where every event an analysis read went, for one rank: ``read = analysed + every reason for leaving out``
(``schema.LEFT_OUT``), and the anomalies its slices show (``schema.ANOMALIES``); ``reduce`` adds them up."""
from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from operator import attrgetter
from typing import Any

import numpy as np

from ...kineto.anomalies import WINDOW, count_anomalies
from ...kineto.times import to_ns
from ..schema import LEFT_OUT
from .decode import Event
from .model import RankModel

__all__ = ["event_kinds", "events_account"]


def event_kinds(events: list[Event]) -> Counter[tuple[str, Any]]:
    """How many of ``events`` have each ``(ph, cat)``: the account's figures, and which passes over the events the
    analysis needs (none for ``B``/``E`` pairs or instants where there are none)."""
    return Counter(map(attrgetter("ph", "cat"), events))


def events_account(events: list[Event], m: RankModel, read_before: Mapping[str, int],
                   kinds: Counter[tuple[str, Any]]) -> dict[str, Any]:
    """The account of one rank: ``events`` as the analysis got them (``kinds``, their ``event_kinds``), ``m`` their
    model and ``read_before`` the events left out before (by reason, ``schema.LEFT_OUT``'s), which ``events`` does
    not hold.

    Returns ``{read, analysed, left_out, anomalies}``: ``left_out`` and ``anomalies`` hold only the reasons with a
    count; ``analysed`` is what the model's slices stand for (a B/E pair is two events).
    """
    left: Counter[str] = Counter(read_before)
    for (ph, cat), n in kinds.items():
        if ph == "M":
            left["metadata"] += n
        elif cat == "python_function":
            left["python_function"] += n
        elif ph not in ("X", "B", "E"):
            left["not_slices"] += n
    left["unopened_end"] += m.begin_end[2]
    left.update(m.events_left_out)
    read = len(events) + sum(read_before.values())
    return {"read": read, "analysed": read - sum(left.values()),
            "left_out": {k: left[k] for k in LEFT_OUT if left[k]},
            "anomalies": _anomalies(events, m, left["negative_dur"], any(ph in ("i", "I") for ph, _ in kinds))}


def _anomalies(events: list[Event], m: RankModel, negative_dur: int, instants: bool) -> dict[str, int]:
    g = m.gpu
    has = g.launch >= 0
    marks = [(e.name, to_ns(e.ts)) for e in events if e.ph in ("i", "I") and e.name in WINDOW] if instants else []
    return count_anomalies(m.start, m.end,
                           [t for n, t in marks if n == WINDOW[0]], [t for n, t in marks if n == WINDOW[1]],
                           m.start[g.launch[has]], g.start[has], [(lo, hi) for _, lo, hi in m.steps], negative_dur)
