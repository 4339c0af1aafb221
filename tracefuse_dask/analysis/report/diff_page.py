"""``diff.html``: the page of ``tracefuse diff`` (``page`` draws it)."""
from __future__ import annotations

import html

import pandas as pd

from ..schema import ITEM_COLUMNS, Diff
from .page import (
    TOP_N,
    Page,
    _axis,
    _document,
    _html_table,
    _label,
    _layout,
    _name_axis,
)

__all__ = ["render_diff"]


def render_diff(diff: Diff) -> str:
    """``tracefuse diff``'s page (HTML text): the verdict, the step times of both runs, the biggest changes first,
    and the tables of significant regressions and improvements; self-contained and escaped as the report is."""
    s = diff.summary
    page = Page(dict(diff.tables), dict(s))
    parts = ["<h1>tracefuse diff</h1>"]
    for label in ("base", "new"):
        side = s[label]
        shown = ", ".join(f"<code>{html.escape(str(p))}</code>" for p in side["inputs"])
        left = side["inputs_count"] - len(side["inputs"])
        more = f" and {left:,} more" if left > 0 else ""
        parts.append(f'<p class="meta">{label}: {side["ranks"]:,} rank(s), {len(side["steps"]):,} step(s), step time '
                     f'{side["step_time_us"]["median"] / 1e3:,.1f} ms median · {shown}{more}</p>')
    parts.append(f'<p class="note"><b>{html.escape(s["verdict"])}</b></p>')
    if s["failing"]:
        parts.append(f'<p class="note">{len(s["failing"]):,} regression(s) above {s["fail_above_pct"]:g}%: the check '
                     "fails (exit code 3).</p>")
    notes = [*s["notes"], *s["warnings"]]
    if notes:
        parts.append('<ul class="warnings">' + "".join(f"<li>{html.escape(str(n))}</li>" for n in notes) + "</ul>")
    parts.append('<p class="caption">Figures are per step; job-wide ones are means over ranks. A change is '
                 f"significant when it is larger than both runs' step-to-step spread (2 × 1.4826 × MAD / median of "
                 f"the step times; here up to {s['noise_pct']:.1f}%) and than 1%; a rank's step time is held to that "
                 "rank's spreads.</p>")
    steps = page.table("steps")
    job = steps[steps["rank"] == -1] if len(steps) else steps
    if len(job):
        boxes = [{"type": "box", "name": run, "y": g["step_us"] / 1e3, "boxpoints": "all", "marker": {"color": colour}}
                 for (run, g), colour in zip(job.groupby("run", sort=False), ("#4c78a8", "#e45756"))]
        parts.append("<h2>Step time</h2>" + page.figure(boxes, _layout(
            "Step time of each step (the job: earliest start to latest end)", 360, yaxis=_axis("ms"))))
    changed = pd.DataFrame(s["regressions"] + s["improvements"], columns=ITEM_COLUMNS)
    top = changed[(changed["rank"] == -1) & (changed["what"] != "step time")]
    top = top.reindex(top["delta_us"].abs().sort_values(ascending=False).index).head(TOP_N)
    if len(top):
        labels = [f"{w}: {n}" for w, n in zip(top["what"], top["label"])]
        bars = {"type": "bar", "orientation": "h", "x": top["delta_us"] / 1e3, "y": list(range(len(top))),
                "marker": {"color": ["#e45756" if d > 0 else "#54a24b" for d in top["delta_us"]]},
                "hovertext": [_label(t, None) for t in labels],
                "customdata": [f"{p:+.1f}%" if pd.notna(p) else "new" for p in top["delta_pct"]],
                "hovertemplate": "%{hovertext}<br>%{x:+,.3f} ms per step (%{customdata})<extra></extra>"}
        parts.append("<h2>Biggest changes</h2>" + page.figure([bars], _layout(
            "Biggest significant changes, job-wide (ms per step)", 160 + 26 * len(top),
            yaxis=_name_axis(pd.Series(labels)), xaxis=_axis("ms per step, new - base"))))
    for title, rows, ascending in (("Regressions", s["regressions"], False), ("Improvements", s["improvements"], True)):
        df = pd.DataFrame(rows, columns=ITEM_COLUMNS)
        parts.append(f"<h2>{title}</h2>" + (_html_table(df, "delta_us", ascending=ascending, what="significant changes")
                                            if len(df) else "<p>None significant.</p>"))
    st = s["straggler"]
    parts.append("<h2>Straggler</h2>" + _html_table(pd.DataFrame([
        {"run": "base", "straggler": st["base"], "cause": st["cause_base"]},
        {"run": "new", "straggler": st["new"], "cause": st["cause_new"]}]), "run", ascending=True))
    return _document(page, "\n".join(parts), "tracefuse diff")
