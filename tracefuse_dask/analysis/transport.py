"""How the tasks' tables travel to the client: text columns as categoricals on the way (``as_categories``), as text
again at the client (``as_text``), and the tasks' parts joined (``join_parts``)."""
from __future__ import annotations

import contextlib

import pandas as pd
from pandas.api.types import union_categoricals

__all__ = ["as_categories", "as_text", "in_rank_order", "join_parts"]


def as_categories(table: pd.DataFrame) -> pd.DataFrame:
    """``table`` with its text columns as categoricals, as reduce tasks' results travel to the client: the same
    names repeat in every rank (10,000 ranks of an A100 job: 0.3 GB of text in the ops, kernels and launchers
    tables, which the client held up to three times while it gathered and joined them). ``join_parts`` keeps them
    so; ``as_text`` turns them back."""
    text = [c for c, t in table.dtypes.items() if isinstance(t, pd.StringDtype)]  # pandas 3's text (2's is object:
    # left as it is, since categories of object text come back as str in pandas 3)
    return table.astype(dict.fromkeys(text, "category")) if text and len(table) else table


def as_text(table: pd.DataFrame) -> pd.DataFrame:
    """``table`` with the categorical columns of ``as_categories`` as text again, and pandas's text in its Python storage
    (``_text``) whichever way the table came: the same tables for any number of tasks."""
    coded = {c: table[c] for c, t in table.dtypes.items() if isinstance(t, pd.CategoricalDtype)}
    coded |= {c: table[c].astype("category") for c, t in table.dtypes.items()
              if isinstance(t, pd.StringDtype) and t.storage != "python"}
    return table.assign(**{c: _text(v) for c, v in coded.items()}) if coded else table


def _text(column: pd.Series) -> pd.Series:
    """A categorical column as text again, taken from its categories (``astype`` would build every row's text as
    a Python string first: twice the memory).

    pandas's text (``str``, ``string``) comes back in its Python storage, where each row refers to its category's
    one string: Arrow's would copy every row's text (10,000 A100 ranks: 315 MB of ops, kernels and launchers).
    Other categories (pandas 2's object text) give their own type."""
    if not isinstance(column.dtype, pd.CategoricalDtype):
        return column
    values = column.cat.categories.array
    if isinstance(values.dtype, pd.StringDtype) and values.dtype.storage != "python":
        with contextlib.suppress(TypeError):  # pandas < 2.3 has no Python storage for text missing as NaN
            python = pd.StringDtype("python", na_value=values.dtype.na_value)
            values = pd.array(values.to_numpy(dtype=object), dtype=python)
    return pd.Series(values.take(column.cat.codes.to_numpy(), allow_fill=True), index=column.index, name=column.name)


def join_parts(parts: list[pd.DataFrame]) -> pd.DataFrame:
    """One table from the tasks' parts, their rows one after the other (one part: that part itself); a column
    that is categorical in every part, over categories of one type, stays categorical over their union."""
    rows = [p for p in parts if len(p)]
    if not rows:
        return max(parts, key=lambda p: len(p.columns))  # the columns of a task that had ranks
    if len(rows) == 1:
        return rows[0]
    if not any(isinstance(t, pd.CategoricalDtype) for p in rows for t in p.dtypes):
        return pd.concat(rows, ignore_index=True)
    if any(not p.columns.equals(rows[0].columns) for p in rows):
        return pd.concat([as_text(p) for p in rows], ignore_index=True)
    columns = {}
    for c in rows[0].columns:
        col = [p[c] for p in rows]
        coded = all(isinstance(s.dtype, pd.CategoricalDtype) for s in col) and len(
            {s.cat.categories.dtype for s in col}) == 1
        columns[c] = union_categoricals(col) if coded else pd.concat([_text(s) for s in col], ignore_index=True)
    return pd.DataFrame(columns)


def in_rank_order(parts: list[pd.DataFrame]) -> pd.DataFrame:
    """One table from the tasks' parts: their rows by rank (a rank is in one task), each rank's in its order.
    ``parts`` is emptied, so that the parts can be freed once joined."""
    out = join_parts(parts)
    parts.clear()
    return out if out["rank"].is_monotonic_increasing else out.sort_values("rank", kind="stable", ignore_index=True)
