"""``report.html``: the analysis's page, a section each of the answers, outliers, collectives and stragglers, the
critical path, efficiency, the breakdown, launches, kernels, ops, idle time and steps (``page`` draws it).

A page is the concatenation of :data:`SECTIONS`; to add one, append a function that takes a :class:`Page` and
returns HTML (``Page.leave_out`` to leave it out and say why).
"""
from __future__ import annotations

import html
from collections.abc import Callable, Sequence
from typing import Any

import pandas as pd

from ..schema import OVER_ROOF
from .text import answers, notes
from .page import (MAX_LISTED, MAX_ROWS, TOP_N, Figure, Page, _axis, _document, _html_table, _label, _layout,
                   _name_axis, _ranges, _slug)

__all__ = ["SECTIONS", "render_report"]

MAX_RANK_TICKS = 64
"""Up to this many ranks, every rank gets its own tick label."""

TITLES = {"answers": "Answers", "outliers": "Outliers", "collectives": "Collectives and stragglers",
          "path": "Critical path", "collective_trace": "collective_trace logs",
          "efficiency": "Efficiency: op performance and roofline", "breakdown": "Per-rank breakdown",
          "launches": "Launches and queues", "kernels": "Kernels", "ops": "Operators",
          "idle": "GPU idle time by stream", "steps": "Steps"}
"""Each section's heading, by what the answers link to."""

MAX_HEATMAP_COLUMNS = 200
"""Collective instances shown in the wait heatmap (the first ones, in order)."""

MAX_PATH_BARS = 2000
"""Segments of the slowest step's critical path drawn (the longest ones)."""

_REDS = [[k / 8, c] for k, c in enumerate((
    "rgb(255,245,240)", "rgb(254,224,210)", "rgb(252,187,161)", "rgb(252,146,114)", "rgb(251,106,74)", "rgb(239,59,44)",
    "rgb(203,24,29)", "rgb(165,15,21)", "rgb(103,0,13)"))]
"""The wait heatmap's colours: plotly's sequential Reds (ColorBrewer's), which plotly.js's own "Reds" is not."""

_BREAKDOWN = (("computation_us", "computation", "#4c78a8"), ("non_compute_us", "non-compute", "#f58518"),
              ("idle_us", "idle", "#bab0ac"))

_COMM = (("communication_us", "communication", "#72b7b2"), ("exposed_comm_us", "exposed communication", "#e45756"))

_PLOTTED = {"gpu_span_us", *(c for c, _, _ in _BREAKDOWN + _COMM)}

# the larger first: an overlay draws the later bars over it, and marks an outlier at the first's height
_LAUNCH_DELAY = (("p95_launch_delay_us", "95th percentile", "#9ecae9"), ("median_launch_delay_us", "median", "#4c78a8"))

_QUEUE = (("queue_length_max", "maximum", "#ffbf79"), ("queue_length_mean", "mean", "#f58518"))

_CATEGORY_COLORS = {"GEMM": "#4c78a8", "attention": "#b279a2", "elementwise": "#f58518", "reduce": "#54a24b",
                    "communication": "#72b7b2", "memory": "#eeca3b", "other": "#bab0ac", "SDPA_fwd": "#b279a2",
                    "SDPA_bwd": "#9d755d", "CONV_fwd": "#e45756", "CONV_bwd": "#ff9da6", "NORM_fwd": "#72b7b2",
                    "NORM_bwd": "#17becf", "softmax_fwd": "#eeca3b", "softmax_bwd": "#bcbd22", "triton": "#8c564b"}

_PATH_COLORS = {"cpu_op": "#4c78a8", "kernel": "#54a24b", "memcpy": "#eeca3b", "launch gap": "#f58518",
                "sync wait": "#b279a2", "collective transfer": "#72b7b2", "idle": "#bab0ac",
                "sync overhead": "#9d755d"}


def render_report(tables: dict[str, pd.DataFrame], summary: dict[str, Any]) -> str:
    """The self-contained report page (HTML text).

    The page embeds plotly.js once (about 4.6 MB, only when it has a plot) and loads nothing from
    the network. Names, shapes, paths and warnings are escaped, so a hostile trace cannot inject
    markup or script.

    Parameters
    ----------
    tables : dict of str to DataFrame
        The per-rank analysis: ``breakdown``, ``breakdown_by_step``, ``kernels``,
        ``kernel_categories``, ``ops``, ``kernel_launchers``, ``idle`` and ``rank_stats``. Missing or
        empty tables leave their plots and tables out.
    summary : dict
        ``tool``, ``version``, ``inputs``, ``ranks``, ``steps``, ``gpu``, ``why_no_gpu`` and
        ``warnings``; with ``gpu`` False the page has no GPU plots and says why.

    Returns
    -------
    str
        The HTML document.

    Examples
    --------
    >>> page = render_report({}, {"tool": "tracefuse_dask", "version": "0.1", "inputs": ["t/rank0.json"],
    ...                           "ranks": [0], "steps": [], "gpu": False, "why_no_gpu": "no GPU events",
    ...                           "warnings": []})
    >>> page.startswith("<!DOCTYPE html>") and "no GPU events" in page
    True
    """
    page = Page(dict(tables), dict(summary))
    body = "\n".join(part for section in SECTIONS if (part := section(page)))
    return _document(page, body, f"{summary.get('tool', 'tracefuse_dask')} report")


def _header(page: Page) -> str:
    s = page.summary
    inputs = [str(p) for p in s.get("inputs") or []]
    shown = ", ".join(f"<code>{html.escape(p)}</code>" for p in inputs[:MAX_LISTED])
    if len(inputs) > MAX_LISTED:
        shown += f" and {len(inputs) - MAX_LISTED:,} more"
    ranks, steps = list(s.get("ranks") or []), list(s.get("steps") or [])
    parts = [f"<h1>{html.escape(str(s.get('tool', 'tracefuse_dask')))} report</h1>",
             f'<p class="meta">version {html.escape(str(s.get("version", "")))} · {len(inputs):,} input(s): '
             f"{shown or 'none'}</p>",
             f'<p class="meta">{len(ranks):,} rank(s): {html.escape(_ranges(ranks)) or "none"} · '
             f'{len(steps):,} step(s): {html.escape(_ranges(steps)) or "none"}</p>']
    if not page.gpu:
        why = s.get("why_no_gpu") or "the traces have no GPU events"
        parts.append(f'<p class="note">No GPU plots: {html.escape(str(why))}.</p>')
    parts += [f'<p class="note">{html.escape(note)}.</p>' for note in notes(s)]
    warnings = [*(f"skipped rank {sk['rank']}: {sk['reason']}" for sk in s.get("skipped") or []),
                *(str(w) for w in (*(s.get("repaired") or []), *(s.get("warnings") or [])))]
    if warnings:
        items = "".join(f"<li>{html.escape(w)}</li>" for w in warnings[:MAX_LISTED])
        more = f"<li>and {len(warnings) - MAX_LISTED:,} more</li>" if len(warnings) > MAX_LISTED else ""
        parts.append(f'<h2>Warnings</h2><ul class="warnings">{items}{more}</ul>')
    return "\n".join(parts)


def _answers(page: Page) -> str:
    """The answers before any table (``text.answers``, which the CLI prints too), each linking to its section."""
    lines = [(f"{a.label}: {a.text}." if a.label else a.text, a.section) for a in answers(page.summary)]
    if not lines:
        return page.leave_out(TITLES["answers"], "no steps, collectives or op models to answer from")
    items = "".join(f'<li>{html.escape(text)}<a class="to" href="#{_slug(TITLES[key])}">→ '
                    f"{html.escape(TITLES[key])}</a></li>" for text, key in lines)
    return f'<h2>{TITLES["answers"]}</h2><ul class="answers">{items}</ul>'


def _efficiency(page: Page) -> str:
    """How good the op time is: the roofline plot, the top op groups with their % of roofline, the per-rank
    spread by category and how each rank's GPU compares at equal shapes."""
    perf = page.table("op_perf")
    if perf.empty or "roofline_pct" not in perf:
        return page.leave_out(TITLES["efficiency"], "no op launched device work")
    parts = [f"<h2>{TITLES['efficiency']}</h2>",
             '<p class="caption">Per op group (name, input dims, input types, concrete inputs): FLOPs and bytes per '
             "call from its shapes (TraceLens's models), the kernel time its calls launched, and the achieved "
             "TFLOP/s against the device's roofline at the op's arithmetic intensity.</p>"]
    modelled = perf[perf["flops_per_byte"].notna() & (perf["tflops_s"] > 0)]
    if not modelled.empty:
        parts.append(page.figure(*_roofline(modelled, page.summary)))
    else:
        page.leave_out("the roofline plot", "no op with a FLOP and byte model and recorded shapes (record_shapes)")
    key = [c for c in ("name", "category", "input_dims", "input_types", "concrete_inputs", "context") if c in perf]
    top = (perf.groupby(key, dropna=False, sort=False)
           .agg(ranks=("rank", "nunique"), calls=("calls", "sum"), kernel_us=("kernel_us", "sum"),
                gflop=("gflop", "first"), data_mib=("data_mib", "first"), tflops_s=("tflops_s", "median"),
                tb_s=("tb_s", "median"), roof=("roof", "first"), roofline_pct=("roofline_pct", "median"),
                over_roof=("over_roof", "any"), bound=("bound", "first"))
           .reset_index().nlargest(MAX_ROWS, "kernel_us"))
    over = perf[perf["over_roof"].eq(True)] if "over_roof" in perf else perf.iloc[:0]
    if len(over):
        parts.append(f'<p class="note">{len(over):,} op group(s) on {over["rank"].nunique():,} rank(s) are '
                     f'{html.escape(OVER_ROOF)} (<code>over_roof</code> in <code>op_perf</code>; the highest: '
                     f'{over["roofline_pct"].max():,.0f}%).</p>')
    parts.append("<h3>Top op groups by kernel time, all ranks (median TFLOP/s and % of roofline over ranks)</h3>"
                 + _html_table(top, "kernel_us", what="op groups"))
    spread = page.table("op_perf_by_category")
    if not spread.empty:
        wide = spread.pivot_table(index="rank", columns="category", values="roofline_pct").reset_index()
        wide.columns = [str(c) if c == "rank" else f"{c} roofline_pct" for c in wide.columns]
        parts.append("<h3>Per-rank efficiency: time-weighted % of roofline by category</h3>"
                     + _html_table(wide, "rank", ascending=True, what="ranks"))
    speed = page.table("gpu_speed")
    if not speed.empty:
        parts.append("<h3>Kernel time per call against the median rank at equal shapes</h3>"
                     + _html_table(speed, "factor", what="rows"))
    return "".join(parts)


def _roofline(perf: pd.DataFrame, summary: dict[str, Any]) -> Figure:
    """Achieved TFLOP/s against arithmetic intensity, log-log, a trace per category, with the roofs of the ranks'
    devices (their memory slope, and the flat peak of each precision the ops ran at)."""
    data = []
    for cat, part in perf.groupby("category", sort=True):
        data.append({
            "type": "scatter", "x": part["flops_per_byte"], "y": part["tflops_s"], "mode": "markers",
            "name": _label(cat), "marker": {"size": 7} | ({"color": _CATEGORY_COLORS[str(cat)]}
                                                       if str(cat) in _CATEGORY_COLORS else {}),
            "hovertext": [f"rank {r}: {_label(n, None)} {_label(d, None)}, {p:,.0f}% of roofline"
                          for r, n, d, p in zip(part["rank"], part["name"], part["input_dims"],
                                                part["roofline_pct"].fillna(0))],
            "hovertemplate": "%{hovertext}<br>%{x:,.2f} FLOP/byte, %{y:,.2f} TFLOP/s<extra></extra>"})
    lo = max(float(perf["flops_per_byte"].min()) / 2, 1e-3)
    hi = float(perf["flops_per_byte"].max()) * 2
    roofs = perf.dropna(subset=["peak_tflops"]).groupby(["peak_tb_s", "peak_tflops", "roof"], sort=True).size()
    for (bw, peak, roof), _ in roofs.items():
        knee = peak / bw
        xs = [lo, min(max(knee, lo), hi), hi]
        data.append({"type": "scatter", "x": xs, "y": [min(x * bw, peak) for x in xs], "mode": "lines",
                     "name": f"{roof} roof: {peak:,.0f} TFLOP/s, {bw:,.2f} TB/s", "line": {"dash": "dot", "width": 1},
                     "hoverinfo": "name"})
    devices = ", ".join(_label(d) for d in (summary.get("devices") or {}).get("ranks", {})) or "unknown device"
    return data, _layout(f"Roofline ({devices}): achieved TFLOP/s against FLOP per byte", 460,
                         xaxis=_axis("arithmetic intensity (FLOP/byte)", type="log"),
                         yaxis=_axis("TFLOP/s", type="log"))


def _outliers(page: Page) -> str:
    stats = page.table("rank_stats")
    if stats.empty:
        return page.leave_out(TITLES["outliers"], "no per-rank figures")
    if len(page.summary.get("ranks") or []) == 1:
        return page.leave_out(TITLES["outliers"], "one rank: nothing to compare it with")
    notes = [str(n) for n in stats["note"].dropna() if str(n)] if "note" in stats else []
    listed = ('<ul class="outliers">' + "".join(f"<li>{html.escape(n)}</li>" for n in notes) + "</ul>"
              if notes else "<p>No outlier ranks.</p>")
    table = _html_table(stats, "metric", ascending=True)
    return f"<h2>{TITLES['outliers']}</h2>{listed}<h3>Spread over ranks</h3>{table}"


def _breakdown(page: Page) -> str:
    df = page.table("breakdown")
    if not page.gpu or df.empty:
        return page.leave_out(TITLES["breakdown"], "no GPU kernels, memcpy or memset in the traces")
    df = df.sort_values("rank")
    plots, outliers = "", page.outlier_ranks(_PLOTTED)
    if {c for c, _, _ in _BREAKDOWN} <= set(df.columns):
        plots = page.figure(*_rank_bars(df, _BREAKDOWN, "stack", "GPU time per rank (µs): the bars partition the "
                                       "GPU span", outliers))
        if {c for c, _, _ in _COMM} <= set(df.columns) and not df["communication_us"].gt(0).any():
            page.leave_out("the communication plot", "no communication kernels in the traces")
        elif {c for c, _, _ in _COMM} <= set(df.columns):
            plots += page.figure(*_rank_bars(df, _COMM, "overlay", "Communication per rank (µs): total and "
                                            "exposed (not overlapped with computation)", outliers))
    return f"<h2>{TITLES['breakdown']}</h2>{plots}{_html_table(df, 'gpu_span_us', what='ranks')}"


def _launches(page: Page) -> str:
    """HTA's launch statistics and queue length per rank, as small plots with the ranks that stand out marked, and
    the longest launch delays with their kernels and ops."""
    s = page.summary.get("launches")
    launches, queues = page.table("launch_stats"), page.table("queue_length")
    if not s or launches.empty:
        return page.leave_out(TITLES["launches"], "no GPU kernels, memcpy or memset in the traces" if not page.gpu
                              else "no kernel launches in the traces")
    outliers = page.outlier_ranks(["median_launch_delay_us", "queue_length_mean"])
    caption = (f"{s['text']}. A launch delay is the time from a launch call's end to its kernel's start; the queue of "
               "a stream counts the work launched on it and not yet started (HTA's definitions).")
    parts = [f"<h2>{TITLES['launches']}</h2>", f'<p class="caption">{html.escape(caption)}</p>']
    df = launches[launches["launches"] > 0].sort_values("rank")
    parts.append(page.figure(*_rank_bars(df, _LAUNCH_DELAY, "overlay", "Launch delay per rank (µs): 95th percentile "
                                        "and median", outliers)))
    if not queues.empty:
        per_rank = queues.groupby("rank", as_index=False).agg(queue_length_mean=("mean", "max"),
                                                              queue_length_max=("max", "max"))
        parts.append(page.figure(*_rank_bars(per_rank, _QUEUE, "overlay", "Queue length per rank, busiest stream: "
                                            "maximum and mean over its changes", outliers, unit="operations")))
    worst = page.table("launch_worst")
    if not worst.empty:
        parts.append(f"<h3>Longest launch delays</h3>{_html_table(worst, 'launch_delay_us', what='launches')}")
    return "".join(parts)


def _kernels(page: Page) -> str:
    kernels, categories = page.table("kernels"), page.table("kernel_categories")
    if not page.gpu or (kernels.empty and categories.empty):
        return page.leave_out(TITLES["kernels"], "no GPU kernels, memcpy or memset in the traces")
    parts = [f"<h2>{TITLES['kernels']}</h2>"]
    if not kernels.empty:
        top = (kernels.groupby("name", sort=False)
               .agg(total_us=("total_us", "sum"), count=("count", "sum"), category=("category", "first"),
                    ranks=("rank", "nunique"))
               .nlargest(TOP_N, "total_us").reset_index())
        parts.append(page.figure(*_top_kernels(top)))
    if not categories.empty:
        cats = categories.groupby("category").agg(total_us=("total_us", "sum"), count=("count", "sum"))
        cats = cats.sort_values("total_us", ascending=False).reset_index()
        bars = {"type": "bar", "x": [_label(c) for c in cats["category"]], "y": cats["total_us"],
                "customdata": cats["count"],
                "marker": {"color": [_CATEGORY_COLORS.get(str(c), "#888") for c in cats["category"]]},
                "hovertemplate": "%{x}: %{y:,.0f} µs in %{customdata:,} kernels<extra></extra>"}
        parts.append(page.figure([bars], _layout("Kernel time by category, all ranks (µs)", 360,
                                                 xaxis=_axis(type="category"))))
    if not kernels.empty:
        parts.append(f"<h3>Kernels per rank</h3>{_html_table(kernels, 'total_us')}")
    return "".join(parts)


def _ops(page: Page) -> str:
    ops, launchers = page.table("ops"), page.table("kernel_launchers")
    if ops.empty and launchers.empty:
        return page.leave_out(TITLES["ops"], "no cpu_op events in the traces")
    parts = [f"<h2>{TITLES['ops']}</h2>"]
    key = "gpu_time_us" if page.gpu else "cpu_time_us"
    if key in ops and ops[key].notna().any():
        top = ops.groupby("name", sort=False).agg(time=(key, "sum"), count=("count", "sum"))
        top = top.nlargest(TOP_N, "time").reset_index()
        parts.append(page.figure(*_top_ops(top, key.removesuffix("_us").replace("_", " "))))
    if not ops.empty:
        parts.append(f"<h3>Operators per rank</h3>{_html_table(ops, key)}")
    if not launchers.empty:
        parts.append(f"<h3>Kernel launchers by input shape</h3>{_html_table(launchers, 'gpu_time_us')}")
    return "".join(parts)


def _idle(page: Page) -> str:
    idle = page.table("idle")
    if not page.gpu or idle.empty:
        return page.leave_out(TITLES["idle"], "no GPU kernels, memcpy or memset in the traces")
    return f"<h2>{TITLES['idle']}</h2>{_html_table(idle, 'idle_us')}"


def _steps(page: Page) -> str:
    steps = page.table("breakdown_by_step")
    if steps.empty or "step" not in steps:
        return page.leave_out(TITLES["steps"], "no ProfilerStep#N in the traces")
    per_step = steps.drop(columns="rank").select_dtypes("number").groupby("step").median()
    per_step.insert(0, "ranks", steps.groupby("step")["rank"].nunique())
    return (f"<h2>{TITLES['steps']}</h2><p class=\"caption\">Median over ranks.</p>"
            f"{_html_table(per_step.reset_index(), 'step', ascending=True, what='steps')}")


def _collectives(page: Page) -> str:
    s = page.summary
    verdict = s.get("straggler") or {}
    waits, stragglers = page.table("collective_waits"), page.table("straggler_ranks")
    if waits.empty and not verdict.get("what_if") and verdict.get("rank") is None:
        return page.leave_out(TITLES["collectives"], str(verdict.get("evidence") or "no collectives in the traces"))
    parts = [f"<h2>{TITLES['collectives']}</h2>"]
    if verdict.get("evidence"):
        cls = "note" if verdict.get("rank") is not None else "caption"
        parts.append(f'<p class="{cls}"><b>{html.escape(str(verdict["evidence"]))}</b></p>')
    what_if = verdict.get("what_if")
    if what_if:
        said = f"What-if: {html.escape(str(verdict['what_if_text']))}. " if verdict.get("what_if_text") else ""
        parts.append(f'<p class="caption">{said}Each step replayed across ranks from its collectives, with a rank '
                     'doing the median other rank\'s work where it did more; a rank is named when its fix saves '
                     f'{what_if["bar_us"] / 1e3:,.1f} ms per step or more in most steps (the bar), or 40% of a step '
                     'and the bar in a few.</p>')
        parts.append(_html_table(pd.DataFrame([{k: v for k, v in st.items() if k not in ("by_rank", "start_ns")}
                                               for st in what_if["steps"]]), "step", ascending=True, what="steps"))
    if not waits.empty:
        instances = page.table("collective_instances")
        shown = sorted(waits["instance"].unique())[:MAX_HEATMAP_COLUMNS]
        grid = waits[waits["instance"].isin(shown)].pivot(index="rank", columns="instance", values="wait_us")
        ops = instances.set_index("instance")["op"] if "op" in instances else pd.Series(dtype=str)
        labels = [f"{i}: {_label(ops.get(i, ''))}" for i in grid.columns]
        heat = {"type": "heatmap", "z": grid.to_numpy(dtype=float), "x": labels, "y": grid.index.astype(int),
                "colorscale": _REDS, "colorbar": {"title": {"text": "µs"}},
                "hovertemplate": "rank %{y}<br>%{x}<br>waited %{z:,.0f} µs<extra></extra>"}
        first = f" — the first {len(shown)}" if len(shown) < waits["instance"].nunique() else ""
        parts.append(page.figure([heat], _layout(f"Wait per rank and collective (µs){first}",
                                                 min(900, 200 + 12 * len(grid)), xaxis=_axis(type="category"),
                                                 yaxis=_axis("rank"))))
        arrival = waits.groupby("rank")["arrival_us"].mean().reset_index()
        marked = [verdict["rank"]] if verdict.get("rank") is not None else []
        series = [("arrival_us", "mean arrival after the first rank", "#9467bd")]
        title = "Arrival per rank (µs after the first rank, mean over collectives)"
        parts.append(page.figure(*_rank_bars(arrival, series, "stack", title, marked)))
    if not stragglers.empty:
        parts.append(f"<h3>Per rank</h3>{_html_table(stragglers, 'wait_caused_us', what='ranks')}")
    summary = page.table("collective_summary")
    if not summary.empty:
        parts.append(f"<h3>Per op and size</h3>{_html_table(summary, 'latency_total_us')}")
    offsets = s.get("clock_offset_us") or {}
    if offsets:
        spread = s.get("clock_offset_spread_us") or {}
        rows = pd.DataFrame({"rank": [int(r) for r in offsets], "clock_offset_us": list(offsets.values()),
                             "spread_us": [spread.get(r) for r in offsets]})
        parts.append("<h3>Clock offsets</h3><p class=\"caption\">Estimated from the ends of matched GPU "
                     "collectives; subtract from a rank's times to align it with the lowest rank "
                     "(<code>tracefuse merge --align collectives</code>).</p>"
                     + _html_table(rows, "rank", ascending=True, what="ranks"))
    problems = (s.get("collectives") or {}).get("problem_examples") or []
    if problems:
        items = "".join(f"<li>{html.escape(str(p))}</li>" for p in problems)
        parts.append(f"<h3>Unmatched or inconsistent collectives</h3><ul>{items}</ul>")
    return "".join(parts)


def _critical_path(page: Page) -> str:
    steps = page.summary.get("critical_path") or []
    path = page.table("critical_path")
    if not steps or path.empty:
        return page.leave_out(TITLES["path"], "no step or trace to walk")
    parts = [(f"<h2>{TITLES['path']}</h2><p class=\"caption\">What determined each step's length, across ranks: "
              "walking back from the end of the step on the rank that finished last, to the predecessor that "
              "finished last; at a collective, to the rank that arrived last.</p>")]
    cause = (page.summary.get("straggler") or {}).get("cause")
    if cause:
        parts.append(f'<p class="note"><b>{html.escape(str(cause["verdict"]))}</b>.</p>')
        parts.append(_html_table(pd.DataFrame(cause["top"]), "extra_us", what="differences"))
    slow = max(steps, key=lambda p: p["duration_us"])
    seg = path[path["step"] == slow["step"]].nlargest(MAX_PATH_BARS, "dur_us")
    t0 = float(slow["start_us"])
    data = []
    for kind, colour in _PATH_COLORS.items():
        part = seg[seg["kind"] == kind]
        if len(part):
            data.append({
                "type": "bar", "name": kind, "orientation": "h", "x": part["dur_us"] / 1e3,
                "base": (part["start_us"] - t0) / 1e3, "y": [f"rank {int(r)}" for r in part["rank"]],
                "marker": {"color": colour}, "hovertext": [_label(n, None) for n in part["name"]],
                "hovertemplate": "%{y}: %{hovertext}<br>%{x:,.3f} ms<extra>" + _label(kind) + "</extra>"})
    name = "the whole trace" if slow["step"] < 0 else f"ProfilerStep#{slow['step']}"
    parts.append(page.figure(data, _layout(f"Critical path of the slowest step ({_label(name)}, "
                                           f"{slow['duration_us'] / 1e3:,.1f} ms)", 200 + 40 * len(slow["by_rank"]),
                                           barmode="overlay", xaxis=_axis("ms from the step's start"),
                                           yaxis=_axis(type="category"))))
    rows = pd.DataFrame([{"step": p["step"], "duration_us": p["duration_us"], "path_us": p["path_us"],
                          **{f"{k}_us": v for k, v in p["by_kind"].items()},
                          "top": "; ".join(f"{t['name']} (rank {t['rank']}, {t['share']:.0%})" for t in p["top"][:3])}
                         for p in steps])
    parts.append(_html_table(rows, "step", ascending=True, what="steps"))
    return "".join(parts)


def _collective_trace(page: Page) -> str:
    ct = page.summary.get("collective_trace")
    if not ct:
        return ""
    hint = ct["straggler_hint"]
    cls = "note" if hint.get("rank") is not None else "caption"
    parts = [f"<h2>{TITLES['collective_trace']}</h2><p>{int(ct['calls']):,} calls in {int(ct['files'])} files. Their "
             "timestamps are perf_counter values that cannot be aligned across hosts, so only durations are used.</p>"
             f'<p class="{cls}"><b>{html.escape(str(hint["evidence"]))}</b> '
             f'(confidence {float(hint.get("confidence", 0)):.2f})</p>']
    summary, hints = page.table("collective_trace_summary"), page.table("collective_trace_hints")
    if not summary.empty:
        parts.append(f"<h3>Per op, shape, dtype and group</h3>{_html_table(summary, 'total_us')}")
    if not hints.empty:
        parts.append(f"<h3>Per rank</h3>{_html_table(hints, 'others_waited_us', what='ranks')}")
    return "".join(parts)

SECTIONS: list[Callable[[Page], str]] = [_header, _answers, _outliers, _collectives, _critical_path,
                                         _collective_trace, _efficiency, _breakdown, _launches, _kernels, _ops, _idle,
                                         _steps]
"""The page, in order: each function returns its section's HTML, or "" to leave it out."""


def _rank_bars(df: pd.DataFrame, series: Sequence[tuple[str, str, str]], barmode: str, title: str,
               outliers: list[int], unit: str = "µs") -> Figure:
    ranks = df["rank"].astype(int).tolist()
    many = len(ranks) > MAX_RANK_TICKS
    data = [{"type": "bar", "x": ranks, "y": df[col], "name": name,
             "marker": {"color": color, "line": {"width": 0}} if many else {"color": color},
             "hovertemplate": f"rank %{{x}}<br>{name}: %{{y:,.0f}} {unit}<extra></extra>"}
            for col, name, color in series]
    top = df[[c for c, _, _ in series]].sum(axis=1) if barmode == "stack" else df[series[0][0]]
    flagged = df["rank"].isin(outliers)
    if flagged.any():
        data.append({
            "type": "scatter", "x": df.loc[flagged, "rank"].astype(int), "y": top[flagged], "name": "outlier",
            "mode": "markers+text", "text": [f"rank {r}" for r in df.loc[flagged, "rank"].astype(int)],
            "textposition": "top center", "marker": {"symbol": "triangle-down", "size": 12, "color": "#d62728"},
            "textfont": {"color": "#d62728"}, "hovertemplate": "outlier rank %{x}<extra></extra>"})
    xaxis = _axis("rank", tickformat="d")
    if not many:
        xaxis.update(tickmode="array", tickvals=ranks,
                     ticktext=[f'<span style="color:#d62728"><b>{r}</b></span>' if r in outliers else str(r)
                               for r in ranks])
    return data, _layout(title, 420, barmode=barmode, xaxis=xaxis, yaxis=_axis(unit), bargap=0 if many else 0.15)


def _top_kernels(top: pd.DataFrame) -> Figure:
    data = [{"type": "bar", "y": rows.index, "x": rows["total_us"], "orientation": "h", "name": _label(category),
             "width": 0.8, "marker": {"color": _CATEGORY_COLORS.get(str(category), "#888")},
             "customdata": list(zip([_label(n, None) for n in rows["name"]], rows["count"], rows["ranks"])),
             "hovertemplate": "%{customdata[0]}<br>%{x:,.0f} µs, %{customdata[1]:,} launches on "
                              "%{customdata[2]} rank(s)<extra></extra>"}
            for category, rows in top.groupby("category", sort=False, dropna=False)]
    return data, _layout(f"Top {len(top)} kernels by total time, all ranks (µs)", 140 + 24 * len(top),
                         barmode="overlay", yaxis=_name_axis(top["name"]), xaxis=_axis("µs"))


def _top_ops(top: pd.DataFrame, what: str) -> Figure:
    bars = {"type": "bar", "y": top.index, "x": top["time"], "orientation": "h", "marker": {"color": "#54a24b"},
            "customdata": list(zip([_label(n, None) for n in top["name"]], top["count"])),
            "hovertemplate": "%{customdata[0]}<br>%{x:,.0f} µs in %{customdata[1]:,} calls<extra></extra>"}
    return [bars], _layout(f"Top {len(top)} operators by {what}, all ranks (µs)", 140 + 24 * len(top),
                           yaxis=_name_axis(top["name"]), xaxis=_axis("µs"))


