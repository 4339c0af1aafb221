"""What a diff says: the root change behind a slower or faster run, a critical path that took another route, and
the verdict's sentence."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pandas as pd

from ...kineto.vocabulary import is_comm_kernel, kernel_label
from .identity import PATH_LABEL, STEP, name_key
from .sides import MIN_CHANGE_PCT, Side, pct_change

__all__ = ["ROOTS", "diff_verdict", "path_deltas", "root_change", "route_note"]

ROOTS = ("step time", "rank step time", "kernel", "op group", "op", "collective")  # what can fail a check


def path_deltas(path: pd.DataFrame) -> dict[str, float]:
    """How much each name's time on the critical path changed per step, the ops' time under their labels
    (``aten::linear (host dispatch)``) counting for the op."""
    op = path["name"].str.replace(PATH_LABEL, "", regex=True)
    return {str(k): float(v) for k, v in path.groupby(op)["delta_us"].sum().items()}


def root_change(rows: list[dict[str, Any]], on_path: Mapping[str, float]) -> dict[str, Any] | None:
    """The root change: of the job-wide kernels (not a collective's: its kernels grow when their ranks wait for a
    late one), op groups, collectives and ops that changed, the one whose time on the critical path changed most
    the same way, else the first (in ``compare._ordered``'s order). An op's time holds its waits, so that ops that waited for a late
    rank grow with the one that made it late: the path tells them apart."""
    rows = [r for r in rows if r["rank"] == -1 and r["what"] in ROOTS[2:] and not r["name"].startswith(STEP)
            and not (r["what"] == "kernel" and is_comm_kernel(r["name"]))]
    moved = [r for r in rows if on_path.get(r["name"], 0.0) * r["delta_us"] > 0]
    if moved:
        return max(moved, key=lambda r: abs(on_path[r["name"]]))
    return rows[0] if rows else None


def route_note(path: pd.DataFrame, root: dict[str, Any] | None) -> str | None:
    """The note for a critical path that took another route: its items that changed significantly while the
    figure they are named after did not (such as the GPU's idle time, a collective's wait), and the root change
    behind it where there is one."""
    if path.empty:
        return None
    top = path.reindex(path["delta_us"].abs().sort_values(ascending=False, kind="stable").index).head(3)
    moved = ", ".join(f"`{n}` {d / 1e3:+,.1f} ms per step" for n, d in zip(top["label"], top["delta_us"]))
    cause = f"the root change: {_root_text(root)}" if root else "no root change explains it"
    return f"the critical path changed: {moved}; a route change is not a root change by itself, {cause}"


def diff_verdict(step: dict[str, Any], root: dict[str, Any] | None, groups: list[dict[str, Any]],
                 changes: list[dict[str, Any]], on_path: Mapping[str, float], straggler: dict[str, Any],
                 sides: Sequence[Side], noise: float) -> str:
    """The root change first (``groups``: for runs whose kernels share little time by name, the op groups that
    changed most per step), then the step time and the straggler."""
    lead = []
    if groups:
        lead.append("the kernels differ by name; by op and shapes: " + ", ".join(map(_root_text, groups)))
    elif root is not None:
        lead.append(_root_text(root, sides))
        group = next((r for r in changes if r["rank"] == -1 and r["what"] == "op group" and r["new_kernel"]
                      and name_key(r["new_kernel"]) == root["name"] and r["delta_us"] * root["delta_us"] > 0), None)
        if root["what"] == "kernel" and group is not None:  # the op and shapes it ran for
            lead[0] += f", in op `{group['label']}`"
    pct = step["delta_pct"]
    if step["significant"]:
        text = (f"step time {pct:+.1f}% ({step['base'] / 1e3:,.1f} ms → {step['new'] / 1e3:,.1f} ms, median over "
                "steps)")
        moved = on_path.get(root["name"], 0.0) if root is not None else 0.0
        if moved * step["delta_us"] > 0:
            text += (f"; on the critical path `{root['label']}` takes {moved / 1e3:+,.1f} ms per step "
                     f"({moved / step['delta_us']:.0%} of the change)")
        busy = next((r for r in changes if r["rank"] != -1 and r["what"] == "breakdown"
                     and r["name"] == "computation_us" and r["delta_us"] > 0), None)
        if busy is not None and step["delta_us"] > 0 and len(sides[0].ranks) > 1:
            text += f"; rank {busy['rank']}'s computation {_pct_text(busy)}"
    elif any(len(s.steps_us) < 2 for s in sides):  # a run of one step has no spread to be within
        text = (f"no significant change in step time ({pct:+.1f}%, below the smallest change reported, "
                f"{MIN_CHANGE_PCT:g}%)")
    else:
        text = (f"no significant change in step time ({pct:+.1f}%, within the runs' step-to-step spread of "
                f"{noise:.1f}% and the smallest change reported, {MIN_CHANGE_PCT:g}%)")
    text = "; ".join([*lead, text])
    if straggler["changed"]:
        was = "no straggler" if straggler["base"] is None else f"rank {straggler['base']}"
        now = "no straggler" if straggler["new"] is None else f"rank {straggler['new']}"
        text += f"; the straggler changed from {was} to {now}"
        if straggler["cause_new"]:
            text += f", late because of `{kernel_label(straggler['cause_new'])}`"
    elif straggler["cause_changed"] and straggler["new"] is not None:
        now, was = (f"`{kernel_label(c)}`" if c else "no single op" for c in (straggler["cause_new"],
                                                                               straggler["cause_base"]))
        text += f"; rank {straggler['new']} is still the straggler, now because of {now} (was {was})"
    return text


def _root_text(row: dict[str, Any], sides: Sequence[Side] | None = None) -> str:
    """A change in words: ``kernel `…` +30% on all ranks (renamed from `…`)``, ``op group `aten::mm [8944×1024 ·
    1024×2816]` +31% per call (kernel changed: `…` → `…`)``."""
    where = _where(row, sides) if sides is not None else ""
    if row["what"] == "op group":
        if row["base_mean_us"] and row["new_mean_us"]:
            text = f"op `{row['label']}` {pct_change(row['base_mean_us'], row['new_mean_us']):+.0f}% per call{where}"
        else:  # in one run only
            text = f"op `{row['label']}` {_pct_text(row)}{where}"
        if row["base_kernel"] and row["new_kernel"] and name_key(row["base_kernel"]) != name_key(row["new_kernel"]):
            text += (f" (kernel changed: `{kernel_label(row['base_kernel'], 60)}` → "
                     f"`{kernel_label(row['new_kernel'], 60)}`)")
        return text
    text = f"{row['what']} `{row['label']}` {_pct_text(row)}{where}"
    if row["what"] == "kernel" and row["base_kernel"]:
        text += f" (renamed from `{kernel_label(row['base_kernel'])}`)"
    return text


def _pct_text(row: dict[str, Any]) -> str:
    return "(new)" if row["delta_pct"] is None else f"{row['delta_pct']:+.0f}%"


def _where(row: dict[str, Any], sides: Sequence[Side]) -> str:
    """On how many ranks a job-wide name went up significantly (runs of the same ranks only)."""
    n, ranks = row["ranks_regressed"], len(sides[0].ranks)
    if n is None or row["delta_us"] <= 0:
        return ""
    return " on all ranks" if n == ranks else f" on {n} of {ranks} ranks"
