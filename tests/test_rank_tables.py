"""The per-rank tables' numpy steps against the pandas formulations they replaced (a groupby costs ~0.3 ms a call
whatever its rows, most of a small rank's analysis): the same rows, in the same order, to the bit. Ties, repeated
keys and empty inputs are drawn on purpose; the sums pandas compensates (Kahan) must stay pandas'."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pandas as pd
from hypothesis import given, settings
from hypothesis import strategies as st

from tracefuse_dask.analysis.per_rank.counters import _steps
from tracefuse_dask.analysis.per_rank.model import first_seen
from tracefuse_dask.analysis.per_rank.op_perf import _main_kernels
from tracefuse_dask.analysis.per_rank.rank import _kernel_tables
from tracefuse_dask.analysis.per_rank.walker import _before_in_group, _sums
from tracefuse_dask.kineto.vocabulary import kernel_category

LEAST = np.iinfo(np.int64).min
SMALL = st.integers(0, 4)  # few distinct values: repeated keys and ties
NAMES = np.array(["gemm", "nccl:all_reduce", "Memcpy HtoD", "elementwise", "b", "a", "ä"], dtype=object)


def columns(n: int, k: int, values=SMALL):
    return st.lists(st.lists(values, min_size=n, max_size=n), min_size=k, max_size=k).map(
        lambda cols: [np.array(c, dtype=np.int64) for c in cols])


rows_of = st.integers(0, 40).flatmap(lambda n: st.integers(1, 3).flatmap(lambda k: columns(n, k)))


@settings(max_examples=200, deadline=None)
@given(rows_of)
def test_first_seen_numbers_groups_as_a_groupby_without_sorting(keys):
    group, first = first_seen(*keys)
    frame = pd.DataFrame({f"k{i}": k for i, k in enumerate(keys)})
    want = frame.groupby(list(frame.columns), sort=False).ngroup().to_numpy()
    assert group.tolist() == want.tolist()
    assert first.tolist() == [int(np.flatnonzero(want == g)[0]) for g in range(len(first))]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(SMALL, st.integers(-10**12, 10**12)), max_size=40))
def test_before_in_group_is_the_groups_running_maximum_shifted(rows):
    rows = sorted(rows, key=lambda r: r[0])  # grouped, as its caller sorts them
    group = np.array([g for g, _ in rows], dtype=np.int64)
    e = np.array([v for _, v in rows], dtype=np.int64)
    want = pd.Series(e, dtype=np.int64).groupby(group).cummax().groupby(group).shift(fill_value=LEAST).to_numpy()
    assert _before_in_group(e, group).tolist() == want.tolist()


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 30).flatmap(lambda n: st.tuples(columns(n, 3), st.lists(st.integers(0, 10**6), min_size=n,
                                                                               max_size=n))))
def test_sums_count_and_total_per_interval_and_keys_in_order_of_first_appearance(drawn):
    (at, name, cat), ns = drawn
    ns = np.array(ns, dtype=np.int64)
    values = [100, 101, 102, 103, 104]
    seq, part, kind, name_out, cat_out, count, total = _sums(at, 2, ns, kind=(name % 2 == 0, [7, 8]),
                                                             name=(name, None), cat=(cat, values))
    rows = pd.DataFrame({"seq": at, "ns": ns, "kind": name % 2 == 0, "name": name, "cat": cat})
    want = rows.groupby(["seq", "kind", "name", "cat"], sort=False)["ns"].agg(["size", "sum"]).reset_index()
    assert part == 2
    assert seq.tolist() == want["seq"].tolist()
    assert kind.tolist() == np.array([7, 8])[want["kind"].to_numpy(dtype=np.int64)].tolist()
    assert name_out.tolist() == want["name"].tolist()
    assert cat_out.tolist() == np.array(values)[want["cat"].to_numpy()].tolist()
    assert count.tolist() == want["size"].tolist() and total.tolist() == want["sum"].tolist()
    assert total.dtype == np.int64 and count.dtype == np.int64


def _steps_before(t, delta, group, first):
    """``counters._steps`` as it was: a frame and two groupbys."""
    order = np.lexsort((~first, t, group))
    df = pd.DataFrame({"group": group[order], "t": t[order], "delta": delta[order]})
    df["value"] = df.groupby("group", sort=False)["delta"].cumsum()
    df["dur"] = df.groupby("group", sort=False)["t"].shift(-1) - df["t"]
    return df


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 30).flatmap(lambda n: st.tuples(
    columns(n, 2, st.integers(0, 3)), st.lists(st.booleans(), min_size=n, max_size=n),
    st.lists(st.one_of(st.integers(-3, 3), st.floats(-1e16, 1e16, allow_nan=False)), min_size=n, max_size=n))))
def test_steps_give_the_values_and_durations_pandas_gave_counts_exact_and_bandwidths_compensated(drawn):
    (t, group), first, deltas = drawn
    first = np.array(first, dtype=bool)
    ints = np.array([int(d) for d in deltas], dtype=np.int64)
    floats = np.array(deltas, dtype=np.float64)  # 1e16 with 1.0: a plain running sum loses what Kahan keeps
    for delta in (ints, floats):
        g, tt, value, dur, head = _steps(t * 10**15, delta, group, first)
        want = _steps_before(t * 10**15, delta, group, first)
        assert g.tolist() == want["group"].tolist() and tt.tolist() == want["t"].tolist()
        assert value.dtype == want["value"].dtype and value.tolist() == want["value"].tolist()
        np.testing.assert_array_equal(dur, want["dur"].to_numpy())  # NaN where a group ends
        assert head.tolist() == [i for i in range(len(g)) if i == 0 or g[i] != g[i - 1]]


def _main_kernels_before(group, names, dur, n):
    t = pd.DataFrame({"group": group, "name": names, "ns": dur}).groupby(["group", "name"], sort=True)["ns"].sum()
    best = t.reset_index().sort_values(["group", "ns"], ascending=[True, False], kind="stable")
    return best.drop_duplicates("group").set_index("group")["name"].reindex(range(n)).tolist()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(SMALL, st.integers(0, len(NAMES) - 1), st.integers(0, 3)), min_size=1, max_size=40))
def test_main_kernels_are_the_most_time_and_of_equal_times_the_first_name(rows):
    group = np.array([g for g, _, _ in rows], dtype=np.int64)
    names = NAMES[[k for _, k, _ in rows]]
    dur = np.array([d * 1000 for _, _, d in rows], dtype=np.int64)  # few values: ties
    n = int(group.max()) + 2  # and groups without kernels: NaN
    got, want = ([None if v != v else v for v in f(group, names, dur, n)] for f in (_main_kernels, _main_kernels_before))
    assert got == want and got[-1] is None


def _kernel_tables_before(g, names):
    """``rank._kernel_tables`` as it was: six aggregations of one groupby, a groupby per category, two sorts."""
    use = g.ktype != "OTHER"
    dur = g.dur[use] / 1e3
    cut = (g.end[use] - g.start[use] - g.dur[use]) / 1e3
    df = pd.DataFrame({"name": g.code[use], "kind": g.kind[use], "dur": dur, "cut": cut})
    total = dur.sum()
    by = df.groupby(["name", "kind"], sort=False)
    kernels = pd.DataFrame({"count": by["dur"].count(), "total_us": by["dur"].sum(), "mean_us": by["dur"].mean(),
                            "min_us": by["dur"].min(), "max_us": by["dur"].max(),
                            "clipped_us": by["cut"].sum()}).reset_index()
    kernels["name"] = names[kernels["name"].to_numpy()]
    kernels.insert(1, "category", [kernel_category(n, k) for n, k in zip(kernels["name"], kernels["kind"])])
    kernels = kernels.drop(columns="kind")
    kernels.insert(len(kernels.columns) - 1, "pct", 100.0 * kernels["total_us"] / total if total else 0.0)
    kernels = kernels.sort_values(["total_us", "name"], ascending=[False, True], ignore_index=True)
    cats = kernels.groupby("category")[["count", "total_us"]].sum().reset_index()
    cats["pct"] = 100.0 * cats["total_us"] / total if total else 0.0
    return kernels, cats.sort_values(["total_us", "category"], ascending=[False, True], ignore_index=True)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, len(NAMES) - 1), st.sampled_from(["kernel", "memcpy", "memset"]),
                          st.sampled_from(["COMPUTATION", "COMMUNICATION", "MEMORY", "OTHER"]),
                          st.one_of(st.integers(0, 3).map(lambda d: d * 1000), st.integers(0, 10**13)),
                          st.integers(0, 2000)), min_size=1, max_size=40))
def test_kernel_tables_are_the_rows_pandas_gave_to_the_bit(rows):
    code, kind, ktype, dur, cut = (np.array(v) for v in zip(*rows))
    start = np.arange(len(rows), dtype=np.int64) * 10**6
    g = SimpleNamespace(ktype=ktype.astype(object), kind=kind.astype(object), code=code.astype(np.int64),
                        dur=dur.astype(np.int64), start=start, end=start + dur.astype(np.int64) + cut)
    if (ktype == "OTHER").all():
        return  # the empty tables, unchanged
    for got, want in zip(_kernel_tables(g, NAMES), _kernel_tables_before(g, NAMES)):
        pd.testing.assert_frame_equal(got, want, check_exact=True)
