"""The self-contained HTML pages (``analysis_page``'s report.html, ``diff_page``'s diff.html): how a page is drawn,
its plots and tables, readable offline.

Every string from a trace is untrusted. Text and table cells go through :func:`html.escape`;
figures travel as inert JSON in ``<script type="application/json">`` blocks with ``<``, ``>``, ``&``,
U+2028 and U+2029 escaped, and plot labels are entity-escaped because plotly.js renders a subset of HTML in
them. A figure is plotly.js's own form (``{"data": [...], "layout": {...}}``, https://plotly.com/javascript/reference/),
written as plain dicts: plotly's Python figure objects would check every property of every figure (half the time
of a report), and plotly.js checks them again when it draws. A Content-Security-Policy runs only the page's
own scripts, by hash, and allows no network access.

A page is a list of sections, each a function that takes a :class:`Page` and returns HTML (``Page.leave_out`` to
leave it out and say why). Every ``<h2>`` gets an anchor in the table of contents, and every table is sorted,
filtered and paged in the browser by DataTables (itables' offline bundle, inlined).
"""
from __future__ import annotations

import base64
import hashlib
import html
import json
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from typing import Any, TypeGuard

import numpy as np
import orjson
import pandas as pd


__all__ = ["Figure", "Page"]

TOP_N = 20
"""Bars in the top-kernels and top-ops plots."""
MAX_ROWS = 10_000
"""Rows each HTML table holds (sorted, filtered and paged in the browser); the table files hold them all."""
PAGE_ROWS = 25
"""Rows of a table on one page, before its pager."""
MAX_LABEL = 70
"""Characters of a kernel or op name shown on an axis; the hover shows the whole name."""
MAX_LISTED = 10
"""Input paths, warnings and rank ranges listed before "and N more"."""

Figure = tuple[list[dict[str, Any]], dict[str, Any]]
"""A plot as plotly.js draws it: its traces and its layout (``_layout``), for ``Page.figure``."""

_PLOT_CONFIG = {"responsive": True, "displaylogo": False}
_TEMPLATE = "plotly_white"
"""plotly's template that every figure is drawn with (its JSON in plotly's package data): given to plotly.js once in
the page (``_boot``), not in each figure."""


@cache
def _plotly_data(name: str) -> str:
    """A file of plotly's package data: plotly.js (``plotly.min.js``, the version plotly's Python embeds) or a
    template (``templates/<name>.json``)."""
    return (resources.files("plotly") / "package_data" / name).read_text(encoding="utf-8")


@cache
def _boot() -> str:
    """The page's script that draws its figures: each one when it comes within a screen of the view, so that a page
    of many plots is usable at once, with ``_TEMPLATE`` (a copy each: plotly.js keeps what it is given)."""
    template = json.dumps(json.dumps(json.loads(_plotly_data(f"templates/{_TEMPLATE}.json")), separators=(",", ":")))
    return (f"var tfTemplate = {_script_safe(template)};"
            "var tfPlots = new IntersectionObserver(function (seen) { seen.forEach(function (e) {"
            "if (!e.isIntersecting) return; tfPlots.unobserve(e.target);"
            "var f = JSON.parse(e.target.nextElementSibling.textContent);"
            "f.layout.template = JSON.parse(tfTemplate);"
            f"Plotly.newPlot(e.target, f.data, f.layout, {json.dumps(_PLOT_CONFIG)});"
            "}); }, {rootMargin: '100% 0px'});"
            "document.querySelectorAll('script.tf-figure').forEach(function (s) {"
            "tfPlots.observe(s.previousElementSibling); });")


# what JSON inside a <script> element must not hold as itself; none of the escapes holds another's character, so
# replacing them one after the other is one pass of the mapping (and str.replace is 20× faster than str.translate)
_JSON_ESCAPES = (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"), ("\u2028", "\\u2028"), ("\u2029", "\\u2029"))
_CSS = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 0 auto; max-width: 1500px; padding: 0 1em; color: #222; }
.layout { display: grid; grid-template-columns: 13em minmax(0, 1fr); gap: 1.5em; }
nav.toc { position: sticky; top: 0; align-self: start; max-height: 100vh; overflow-y: auto; padding: 1.2em 0;
  font-size: 13px; } nav.toc ul { list-style: none; padding: 0; margin: .3em 0; } nav.toc li { margin: .25em 0; }
nav.toc a { color: #1f5fa8; text-decoration: none; } nav.toc a:hover { text-decoration: underline; }
main { min-width: 0; padding-bottom: 3em; } a.to { font-size: 12px; margin-left: .4em; white-space: nowrap; }
h1 { font-size: 1.6em; margin-bottom: .2em; } h2 { margin-top: 1.8em; border-bottom: 1px solid #ddd; }
.meta { color: #555; } .note { background: #fff4e5; border-left: 4px solid #f58518; padding: .5em .8em; }
.warnings li { color: #8a4b00; } .outliers li { font-weight: 600; } .answers li { margin: .2em 0; }
table.tf { border-collapse: collapse; font-size: 12.5px; margin: .5em 0 1em; }
table.tf th, table.tf td { border-bottom: 1px solid #e4e4e4; padding: 3px 8px; text-align: right;
  vertical-align: top; white-space: nowrap; }
table.tf th { background: #f6f6f6; } table.tf .text { text-align: left; }
table.tf td.text { max-width: 26em; overflow: hidden; text-overflow: ellipsis; }
.scroll { overflow-x: auto; max-width: 100%; } .left-out li { color: #555; }
.caption { color: #666; font-size: 12px; } .plot { min-height: 300px; }
"""


@dataclass
class Page:
    """What a section function sees: the analysis tables, the summary and the outliers.

    Parameters
    ----------
    tables : dict of str to DataFrame
        The analysis tables, by name; a missing table reads as an empty one.
    summary : dict
        The run summary (``inputs``, ``ranks``, ``steps``, ``gpu``, ``why_no_gpu``, ``warnings``, ...).
    """

    tables: dict[str, pd.DataFrame]
    summary: dict[str, Any]
    figures: int = field(default=0, init=False)
    left_out: dict[str, list[str]] = field(default_factory=dict, init=False)  # why: what was left out for it

    def table(self, name: str) -> pd.DataFrame:
        """The table ``name``, or an empty DataFrame when it is missing."""
        df = self.tables.get(name)
        return df if df is not None else pd.DataFrame()

    @property
    def gpu(self) -> bool:
        """Whether the traces have GPU events."""
        return bool(self.summary.get("gpu", True))

    def outlier_ranks(self, metrics: Iterable[str] | None = None) -> list[int]:
        """Ranks flagged in ``rank_stats`` for any of ``metrics`` (all metrics when None)."""
        stats = self.table("rank_stats")
        if "outlier_ranks" not in stats:
            return []
        if metrics is not None:
            stats = stats[stats["metric"].isin(list(metrics))]
        return sorted({int(r) for ranks in stats["outlier_ranks"] if _is_list(ranks) for r in ranks})

    def leave_out(self, what: str, why: str) -> str:
        """Leave ``what`` (a section, plot or table) out of the page, and say ``why`` in its "Left out" list;
        returns "" for the section's HTML."""
        self.left_out.setdefault(why, []).append(what)
        return ""

    def figure(self, data: list[dict[str, Any]], layout: dict[str, Any]) -> str:
        """A plot placeholder followed by the figure (plotly.js's traces and layout, ``_layout``'s) as inert,
        script-safe JSON. Arrays may be lists, numpy arrays or pandas Series and Indexes; NaN and NA are null."""
        self.figures += 1
        payload = _script_safe(orjson.dumps({"data": data, "layout": layout}, default=_plain,
                                            option=orjson.OPT_SERIALIZE_NUMPY).decode())
        height = int(layout["height"])  # held before it is drawn: the contents' anchors stay put
        return (f'<div class="plot" style="height: {height}px"></div>'
                f'<script type="application/json" class="tf-figure">{payload}</script>')


def _document(page: Page, body: str, title: str) -> str:
    """The self-contained HTML document around ``body``: a table of contents of its ``<h2>`` headings (and of what
    was left out, and why), plotly.js once when it has a plot, DataTables when it has a table, a strict CSP."""
    if page.left_out:
        items = "".join(f"<li>{html.escape(', '.join(what))}: {html.escape(why)}</li>"
                        for why, what in page.left_out.items())
        body += f'\n<h2>Left out</h2><ul class="left-out">{items}</ul>'
    ids: list[tuple[str, str]] = []

    def anchor(m: re.Match[str]) -> str:
        ids.append((_slug(m[1]), m[1]))
        return f'<h2 id="{ids[-1][0]}">{m[1]}</h2>'

    body = re.sub(r"<h2>(.*?)</h2>", anchor, body)
    # an answer links to its section only when the page has it
    body = re.sub(r'<a class="to" href="#([^"]*)">[^<]*</a>',
                  lambda m: m[0] if m[1] in {i for i, _ in ids} else "", body)
    toc = "".join(f'<li><a href="#{i}">{text}</a></li>' for i, text in ids)
    scripts = [_plotly_data("plotly.min.js"), _boot()] if page.figures else []
    if 'class="tf"' in body:
        scripts.append(_tables_script())
    script_src = " ".join(f"'{_sha256(s)}'" for s in scripts) or "'none'"
    csp = (f"default-src 'none'; script-src {script_src}; style-src 'unsafe-inline'; img-src data: blob:; "
           "font-src data:; base-uri 'none'; form-action 'none'")
    title = html.escape(title)
    styles = [_CSS, _tables_css()] if 'class="tf"' in body else [_CSS]
    return "\n".join([
        "<!DOCTYPE html>", '<html lang="en">', "<head>", '<meta charset="utf-8">',
        f'<meta http-equiv="Content-Security-Policy" content="{csp}">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{title}</title>", *(f"<style>{css}</style>" for css in styles), "</head>", "<body>",
        f'<div class="layout"><nav class="toc"><b>{title}</b><ul>{toc}</ul></nav><main>', body, "</main></div>",
        *(f'<script type="module">{s}</script>' if s.startswith(_TABLES_MARK) else f"<script>{s}</script>"
          for s in scripts), "</body>", "</html>", ""])


_TABLES_MARK = "/* tracefuse: DataTables, from itables' offline bundle */"


@cache
def _tables_script() -> str:
    """DataTables (itables' offline bundle, an ES module) as one inline module script: the bundle's exports
    become ``window.tfTables`` (its default, DataTables itself, as ``DataTable``), and every ``table.tf`` is
    filled from the JSON after it when it comes near the view: sortable and searchable, paged by
    :data:`PAGE_ROWS`, in the order the page wrote it, rows drawn as they are shown (``deferRender``)."""
    bundle = (resources.files("itables") / "html" / "dt_bundle.js").read_text(encoding="utf-8")
    found = list(re.finditer(r"export\s*\{([^}]*)\}", bundle))
    if len(found) != 1:  # another itables: its bundle is built otherwise
        raise RuntimeError("itables' dt_bundle.js has not one export list; use an itables version pyproject.toml allows")
    exports = found[0]
    names = ", ".join(f"{'DataTable' if b.strip() == 'default' else b.strip()}: {a.strip()}" for a, b in
                      (e.split(" as ") if " as " in e else (e, e) for e in exports[1].split(",")))
    init = """
var tfEscape = function (v) { return String(v).replace(/[&<>"']/g, function (c) {
  return {'&': '&amp;', '<': '&lt;', '>': '&gt;', '"': '&quot;', "'": '&#39;'}[c]; }); };
var tfNumber = function (digits, grouping) { return function (v, type) {
  if (type !== 'display') { return v === null ? -Infinity : v; }
  return v === null ? '\u2013' : v.toLocaleString('en-US', {minimumFractionDigits: digits,
    maximumFractionDigits: digits, useGrouping: grouping}); }; };
var tfText = function (v, type) { return type === 'display' ? tfEscape(v) : v; };
var tfTable = function (t) {
  var d = JSON.parse(t.nextElementSibling.textContent);
  new window.tfTables.DataTable(t, {data: d.rows, deferRender: true, order: [], autoWidth: false,
    pageLength: %d, lengthMenu: [10, 25, 100, -1],
    columns: d.columns.map(function (c) { return c.kind === 'text'
      ? {title: tfEscape(c.title), className: 'text', type: 'string', render: tfText,
         createdCell: function (td, v) { td.title = v; }}
      : {title: tfEscape(c.title), className: 'dt-right', type: 'num',
         render: c.kind === 'float' ? tfNumber(1, true) : tfNumber(0, c.kind === 'int')}; })});
};
// each table is built when it comes within a screen of the view, as the plots are drawn
var tfNear = new IntersectionObserver(function (seen) { seen.forEach(function (e) {
  if (e.isIntersecting) { tfNear.unobserve(e.target); tfTable(e.target); } }); }, {rootMargin: '100%% 0px'});
document.querySelectorAll('table.tf').forEach(function (t) { tfNear.observe(t); });""" % PAGE_ROWS
    script = (f"{_TABLES_MARK}\n{bundle[:exports.start()]}window.tfTables = {{{names}}};"
              f"{bundle[exports.end():]}\n{init}")
    # "<!--", "<script" and "</script" in its strings and regexes would end or hide the end of the inline script
    return re.sub(r"<(?=!--|/?script)", r"\\x3C", script, flags=re.IGNORECASE)


@cache
def _tables_css() -> str:
    return (resources.files("itables") / "html" / "dt_bundle.css").read_text(encoding="utf-8")


def _slug(heading: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", html.unescape(heading).lower()).strip("-") or "section"


_IDS = {"rank", "step", "stream", "pid", "tid", "device", "instance", "seq", "index", "key"}  # shown without a 1,000s comma


def _html_table(df: pd.DataFrame, sort: str, *, ascending: bool = False, what: str = "rows") -> str:
    """Up to :data:`MAX_ROWS` rows by ``sort``, for DataTables to sort, filter and page: an empty ``table.tf``
    followed by its columns and rows as inert, script-safe JSON, which the page's script shows escaped, with numbers
    right-aligned and sorted by value and long names cut with the whole name on hover."""
    shown = df.sort_values([sort], ascending=ascending, na_position="last", kind="stable") if sort in df else df
    shown = shown.head(MAX_ROWS).dropna(axis=1, how="all").reset_index(drop=True)
    kinds = ["id" if pd.api.types.is_integer_dtype(t) and (c in _IDS or str(c).endswith("_id"))
             else "int" if pd.api.types.is_integer_dtype(t) else "float" if pd.api.types.is_float_dtype(t) else "text"
             for c, t in shown.dtypes.items()]
    for column, kind in zip(list(shown.columns), kinds):
        if kind == "text":
            shown[column] = shown[column].map(_cell)
    columns = [{"title": str(c), "kind": k} for c, k in zip(shown.columns, kinds)]
    payload = _script_safe(f'{{"columns": {json.dumps(columns)}, '
                           f'"rows": {shown.to_json(orient="values", double_precision=15)}}}')
    caption = (f'<p class="caption">{MAX_ROWS:,} of {len(df):,} {what}, by {html.escape(sort)}; the table file holds '
               "them all.</p>" if len(df) > MAX_ROWS else "")
    return f'{caption}<table class="tf"></table><script type="application/json" class="tf-rows">{payload}</script>'


def _script_safe(text: str) -> str:
    """JSON ``text`` with the characters escaped that would end or break the ``<script>`` element it goes in."""
    for char, escape in _JSON_ESCAPES:
        text = text.replace(char, escape)
    return text


def _cell(value: object) -> str:
    if _is_list(value):
        return ", ".join(str(v) for v in value)
    if isinstance(value, float):
        return "–" if math.isnan(value) else f"{value:,.1f}"
    return "–" if value is None or value is pd.NA else str(value)


def _ranges(values: Iterable[int]) -> str:
    """``[0, 1, 2, 3, 7]`` as ``"0–3, 7"``, listing at most :data:`MAX_LISTED` runs."""
    runs: list[list[int]] = []
    for n in sorted({int(v) for v in values}):
        if runs and n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    text = [str(a) if a == b else f"{a}–{b}" for a, b in runs]
    return ", ".join(text[:MAX_LISTED]) + (f", … ({len(runs) - MAX_LISTED:,} more runs)" if len(runs) > MAX_LISTED
                                           else "")


def _is_list(value: object) -> TypeGuard[Iterable[Any]]:
    # outlier_ranks holds lists, or 1-d numpy arrays after a round trip through Arrow.
    return isinstance(value, (list, tuple)) or getattr(value, "ndim", 0) == 1


def _sha256(script: str) -> str:
    return "sha256-" + base64.b64encode(hashlib.sha256(script.encode()).digest()).decode()


def _name_axis(names: pd.Series) -> dict[str, Any]:
    # Positions, not names, on the axis: names cut to MAX_LABEL may collide and would merge their bars.
    return {"tickmode": "array", "tickvals": list(range(len(names))), "ticktext": [_label(n) for n in names],
            "autorange": "reversed", "automargin": True}


def _layout(title: str, height: int, **more: Any) -> dict[str, Any]:
    """A figure's layout: its title and height, the margins and legend every plot shares, and ``more``. No template:
    the page gives plotly.js ``_TEMPLATE`` (``_boot``)."""
    return {"title": {"text": title}, "height": height, "margin": {"l": 60, "r": 20, "t": 60, "b": 50},
            "legend": {"orientation": "h", "y": -0.15}, **more}


def _axis(title: str | None = None, **more: Any) -> dict[str, Any]:
    """An axis of a layout, with its title."""
    return ({"title": {"text": title}} if title is not None else {}) | more


def _plain(value: Any) -> Any:
    """What orjson cannot write itself, as JSON values: a pandas Series or Index, or a numpy array that is not
    C-contiguous (a DataFrame's ``to_numpy`` may be in column order), as a list; NA as null."""
    if isinstance(value, (pd.Series, pd.Index, np.ndarray)):
        return value.tolist()
    if value is pd.NA:
        return None
    raise TypeError(f"{type(value).__name__} in a figure")


def _label(value: object, limit: int | None = MAX_LABEL) -> str:
    """``value`` as literal plotly text: plotly.js reads a subset of HTML and entities in labels."""
    text = str(value)
    if limit is not None and len(text) > limit:
        text = text[:limit - 1] + "…"
    return html.escape(text, quote=False)
