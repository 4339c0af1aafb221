"""Which kernels and ops of two runs are one (``compare``'s notes: Identity): a name's identity across runs
(``name_key``), an op group's label, and the kernels a new library build renamed."""
from __future__ import annotations

import json
import re
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import pandas as pd

from ...kineto.vocabulary import kernel_label, kernel_type
from ..schema import LABELS

__all__ = ["MIN_KERNEL_OVERLAP", "MIN_NAME_OVERLAP", "PATH_LABEL", "RUN_VARIANT", "STEP", "group_label", "labelled",
           "matched_groups", "name_key", "renamed_kernels"]

# What differs between two runs of one program and says nothing about the kernel or op, each with an example from
# a real trace; the rest of a name is its identity.
RUN_VARIANT = (
    # an address: "<built-in method apply of FunctionMeta object at 0x55d3c8a1e6b0>"
    (re.compile(r"0x[0-9a-fA-F]+"), "0x…"),
    # a step counter after a word: "ProfilerStep#551", "not yet in ProfilerStep#551"; not a lambda's number,
    # which is the kernel's ("…direct_copy_kernel_cuda(…)::{lambda()#3}::operator()() const::{lambda()#7}…")
    (re.compile(r"(?<=[A-Za-z_])#\d+"), "#…"),
)
STEP = "ProfilerStep#"  # the step itself: its time is the step's, never a root change
PATH_LABEL = "(?:" + "|".join(map(re.escape, LABELS)) + ")$"  # what a critical-path name adds to its op's
MIN_NAME_OVERLAP = 0.2  # below this share of matching kernel and op names, two runs look like different models
MIN_KERNEL_OVERLAP = 0.5  # below this share of a run's kernel time in names both runs have, compare by op group


def name_key(name: str) -> str:
    """A kernel's or op's identity across runs: its exact name, with what ``RUN_VARIANT`` lists normalised."""
    text = str(name)
    for pattern, replacement in RUN_VARIANT:
        text = pattern.sub(replacement, text)
    return text


def group_label(name: str, dims: str) -> str:
    """An op group for reading: ``aten::mm [8944×1024 · 1024×2816]`` from its name and input dims, without the
    trailing scalars."""
    try:
        shapes = json.loads(dims) if dims else []
    except (TypeError, ValueError):
        shapes = []
    def shape(d: Any) -> str:
        if d and all(isinstance(x, list) for x in d):  # a list of tensors (aten::cat's)
            return "(" + ", ".join(map(shape, d)) + ")"
        return "×".join(map(str, d)) if d else "scalar"

    parts = [shape(d) for d in shapes if isinstance(d, list)]
    while parts and parts[-1] == "scalar":  # trailing scalar arguments (alpha, dropout, flags) say little
        parts.pop()
    return f"{name} [{' · '.join(parts)}]" if parts else name


def renamed_kernels(groups: Sequence[pd.DataFrame], kernels: Sequence[pd.DataFrame]) -> dict[str, str]:
    """Kernels renamed between the runs, old name to new (``compare``'s notes: Identity): an op group's main
    kernel in each run that the other run does not have, one to one."""
    main = [g.drop_duplicates("name").set_index("name")["kernel"].dropna().map(name_key) for g in groups]
    have = [set(k["name"]) for k in kernels]
    news: dict[str, set[str]] = defaultdict(set)
    for key in main[0].index.intersection(main[1].index):
        old, new = main[0][key], main[1][key]
        if old != new and old not in have[1] and new not in have[0] and kernel_type(old) == kernel_type(new) \
                == "COMPUTATION":  # a copy of another kind is another op's work, not a new build's
            news[old].add(new)
    olds = Counter(n for v in news.values() for n in v)
    return {o: n for o, (n, *more) in news.items() if not more and olds[n] == 1}


def labelled(items: pd.DataFrame, renamed: Mapping[str, str]) -> pd.DataFrame:
    """Each item's ``label`` (kernel names shortened, ``label``, also on the critical path; op groups have theirs),
    and a renamed kernel's names in ``base_kernel`` and ``new_kernel``."""
    kernel = items["what"] == "kernel"
    named = kernel | (items["what"] == "critical path")
    short = {n: kernel_label(n) for n in items.loc[named & (items["rank"] == -1), "name"]}
    items["label"] = items["label"].fillna(items["name"].where(~named, items["name"].map(short)))
    old = {n: o for o, n in renamed.items()}
    renamed_rows = kernel & items["name"].isin(old.keys())
    items.loc[renamed_rows, "base_kernel"] = items.loc[renamed_rows, "name"].map(old)
    items.loc[renamed_rows, "new_kernel"] = items.loc[renamed_rows, "name"]
    return items


def matched_groups(groups: Sequence[pd.DataFrame]) -> str | None:
    """How many op groups the runs share (by op and shapes), and their share of the op kernel time."""
    job = [g.groupby("name")["us"].sum() for g in groups]
    if not len(job[0]) or not len(job[1]):
        return None
    both = job[0].index.intersection(job[1].index)
    share = [100 * float(j.reindex(both).sum() / j.sum()) if j.sum() else 0.0 for j in job]
    return (f"{len(both):,} of {len(job[0].index.union(job[1].index)):,} op groups (op, input dims, types and "
            f"concrete inputs) are in both runs: {share[0]:.0f}% of the base run's op kernel time, {share[1]:.0f}% "
            "of the new run's")
