"""A rank's model, which the per-rank analyses read (``RankModel``): its events as arrays, its host events nested
per thread (``CallTree``) and its device work (``GpuWork``), with the codes they are built of."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from .decode import Args

__all__ = ["CallTree", "GpuWork", "RankModel", "before_in_group", "codes", "factorized", "first_seen",
           "sorted_codes"]


@dataclass
class GpuWork:
    """A rank's GPU activity (kernels, memcpy, memset) as arrays, in input order."""

    start: np.ndarray
    end: np.ndarray
    stream: list[Any]
    stream_code: np.ndarray  # each stream as a code
    name: np.ndarray
    code: np.ndarray  # each name's code into the rank's distinct names
    kind: np.ndarray
    ktype: np.ndarray  # HTA kernel type per event
    launch: np.ndarray  # index of the launching host event, or -1
    dur: np.ndarray  # per-event duration (ns), clipped at the next start on its stream (``_clipped``)
    clipped: int  # how many durations were clipped
    args: list[Args]  # per event, for the collective matching (``Collective name``)
    index: np.ndarray  # each event's index among the X events


@dataclass
class CallTree:
    """The host events nested per thread, in tree order: each thread's events by (ts, -dur), parents first."""

    order: np.ndarray  # the event at each position
    parent: list[int]  # the position of each position's innermost enclosing event, -1 for a root
    stop: np.ndarray  # the end (exclusive) of each position's subtree, which runs from the position itself
    pos: np.ndarray  # the position of each event, -1 for events not in the tree
    thread: np.ndarray  # each position's thread, as a code

    @property
    def depth(self) -> np.ndarray:
        """Each position's depth (0 for a root): how many subtrees that start before it are still open."""
        m = len(self.order)
        return np.arange(m) - np.cumsum(np.bincount(self.stop, minlength=m + 1))[:m]


@dataclass
class RankModel:
    """One rank as every per-rank analysis reads it (TraceLens's Trace2Tree is the precedent; ``rank.rank_model``
    builds it): its complete events (X events, and B/E pairs as spans) in input order as arrays, nested per thread
    (``tree``), its device work (``gpu``) and its steps. Times are relative ns; ``base`` makes them absolute."""

    start: np.ndarray  # per event
    end: np.ndarray
    dur: np.ndarray  # per event, its ``dur`` as parsed (objects: the ops sum them as Python does)
    name_code: np.ndarray  # per event, its name as a code into ``names``
    names: np.ndarray  # the distinct names
    cat_code: np.ndarray  # per event, its category as a code into ``cats``
    cats: np.ndarray
    args: list[Args]  # per event
    pid: np.ndarray  # per event, as in the trace (objects)
    tid: np.ndarray
    is_span: np.ndarray  # per event: a B/E pair's span
    step_of: np.ndarray  # per name code: the step N of a ``ProfilerStep#N``, else -1
    tree: CallTree
    gpu: GpuWork
    launch_pos: np.ndarray  # per device event, the position of the call that launched it (-1: none known)
    steps: list[tuple[int, int, int]]  # ``(step, start, end)`` of each ``ProfilerStep#N``, by step
    step_event: dict[int, int]  # each step's own event
    base: int
    left_out: int  # device slices left out: launched by no call in the trace (``keep_unlaunched_gpu``)
    begin_end: tuple[int, int, int]  # B/E pairs matched, B left open and E never opened
    events_left_out: dict[str, int] = field(default_factory=dict)  # events (a B/E pair is two) outside --steps
    # (``steps``) and of the device work left out (``unlaunched_gpu``)


def factorized(values: list[Any]) -> tuple[np.ndarray, np.ndarray]:
    """Each value's code (equal values, None included, get equal codes, in order of first appearance) and the
    distinct values: ``pd.factorize`` in C-level passes over a dict, which hashes each text once (a string keeps
    its hash) where ``pd.factorize`` of an object array takes half as long again. For ints (pids, tids) pandas is
    the faster one (``codes``)."""
    code = {v: i for i, v in enumerate(dict.fromkeys(values))}
    return np.fromiter(map(code.__getitem__, values), np.int64, len(values)), np.array(list(code), dtype=object)


def codes(values: np.ndarray) -> np.ndarray:
    """Equal values get equal integer codes (None included); for pids and tids, 3 ms against the dict's 5 ms on
    96,000 host events (``factorized`` is the faster for texts)."""
    return pd.factorize(values, use_na_sentinel=False)[0]


def before_in_group(e: np.ndarray, group: np.ndarray) -> np.ndarray:
    """Per row, the largest ``e`` of the rows before it in its ``group`` (int64's least for a group's first row);
    ``group`` sorted."""
    n = len(e)
    if not n:
        return e
    rank = np.empty(n, dtype=np.int64)
    rank[np.argsort(e, kind="stable")] = np.arange(n)
    # a group's rows outrank every row of the groups before it, so the running maximum restarts at each group
    top = np.maximum.accumulate(group * n + rank) - group * n
    reach = np.concatenate([[np.iinfo(np.int64).min], np.sort(e)[top[:-1]]])
    reach[np.flatnonzero(group[1:] != group[:-1]) + 1] = np.iinfo(np.int64).min
    return reach


def first_seen(*keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each row's group by its integer ``keys`` together, numbered in order of first appearance (the groups of
    pandas' ``groupby(sort=False)``), and each group's first row: ``pd.factorize`` of one key at a time, without
    a frame (a groupby costs ~0.3 ms a call whatever its rows, most of a small rank's analysis)."""
    group = np.zeros(len(keys[0]), dtype=np.int64)
    for key in keys:
        local, distinct = pd.factorize(np.asarray(key, dtype=np.int64))
        group, _ = pd.factorize(group * len(distinct) + local)
    # a group's number is one more than any before it where it first appears
    first = np.flatnonzero(group > np.concatenate([[-1], np.maximum.accumulate(group)[:-1]]))
    return group, first


def sorted_codes(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(values, return_inverse=True)`` of ints (the distinct values, sorted, and each value's index into
    them), by hashing (``pd.factorize``) and sorting the distinct values alone: 5-10× faster on the critical path's
    100,000 segments of a few thousand distinct values."""
    code, distinct = pd.factorize(values)
    order = np.argsort(distinct, kind="stable")
    place = np.empty(len(order), dtype=np.int64)
    place[order] = np.arange(len(order))
    return distinct[order], place[code]
