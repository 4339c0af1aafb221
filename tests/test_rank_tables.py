"""The per-rank steps that left pandas' groupbys for numpy (a groupby costs ~0.3 ms a call whatever its rows, most of a
small rank's analysis) against the pandas formulations they replaced: the same rows, in the same order, to the bit.
Ties, repeated keys and empty inputs are drawn on purpose; the sums pandas compensates (Kahan) must stay pandas'.
The sorts of the ops, launchers and op groups, and the queue's and bandwidth's rows, are held by the output hash
tests on real traces (``tests/test_output_hashes.py``)."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pandas as pd
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tracefuse_dask.analysis.per_rank.collectives import CALL_COLUMNS, calls_frame
from tracefuse_dask.analysis.per_rank.counters import _steps
from tracefuse_dask.analysis.per_rank.model import before_in_group, first_seen
from tracefuse_dask.analysis.per_rank.op_perf import _main_kernels
from tracefuse_dask.analysis.per_rank.rank import _kernel_tables
from tracefuse_dask.analysis.per_rank.walker import _sums
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
    assert before_in_group(e, group).tolist() == want.tolist()


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
# at least one change: queue_length, memory_bw and counter_series make no step function of none
@given(st.integers(1, 30).flatmap(lambda n: st.tuples(
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
    got, want = ([None if pd.isna(v) else v for v in f(group, names, dur, n)]
                 for f in (_main_kernels, _main_kernels_before))
    assert got == want and got[-1] is None


def _kernel_tables_before(g, names):
    """``rank._kernel_tables`` as it was: six aggregations of one groupby, a groupby per category, two sorts."""
    use = g.ktype != "OTHER"
    dur = g.dur[use] / 1e3
    cut = (g.end[use] - g.start[use] - g.dur[use]) / 1e3
    df = pd.DataFrame({"name": g.code[use], "kind": g.kind[use], "dur": dur, "cut": cut})
    if df.empty:
        kernels = pd.DataFrame(columns=["name", "category", "count", "total_us", "mean_us", "min_us", "max_us",
                                        "pct", "clipped_us"])
        return kernels, pd.DataFrame(columns=["category", "count", "total_us", "pct"])
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


# one kernel six times, whose times a plain sum (and so a mean from it) rounds otherwise than pandas' compensated one
COMPENSATED = [(0, "kernel", "COMPUTATION", d, 0) for d in (8277025938204, 5495936876730, 7535131086748, 1000,
                                                             7884287034284, 4534978894806)]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, len(NAMES) - 1), st.sampled_from(["kernel", "memcpy", "memset"]),
                          st.sampled_from(["COMPUTATION", "COMMUNICATION", "MEMORY", "OTHER"]),
                          st.one_of(st.integers(0, 3).map(lambda d: d * 1000), st.integers(0, 10**13)),
                          st.integers(0, 2000)), max_size=40))
@example(COMPENSATED)
def test_kernel_tables_are_the_rows_pandas_gave_to_the_bit(rows):
    code, kind, ktype, dur, cut = (np.array(v, dtype=t) for v, t in zip(zip(*rows) if rows else [()] * 5,
                                                                          (np.int64, object, object, np.int64,
                                                                           np.int64)))
    start = np.arange(len(rows), dtype=np.int64) * 10**6
    g = SimpleNamespace(ktype=ktype, kind=kind, code=code, dur=dur, start=start, end=start + dur + cut)
    for got, want in zip(_kernel_tables(g, NAMES), _kernel_tables_before(g, NAMES)):
        pd.testing.assert_frame_equal(got, want, check_exact=True)


_INT64 = ("group_size", "in_nelems", "out_nelems", "in_bytes", "out_bytes", "seq", "step", "gpu_start_ns",
          "gpu_end_ns", "stream", "done_ns")


def _calls_frame_before(rows):
    """The collectives' frame as it was: pandas' frame of the rows, then a conversion a typed column."""
    df = pd.DataFrame(rows, columns=CALL_COLUMNS)
    for col in _INT64:
        df[col] = pd.array([r[col] for r in rows], dtype="Int64")
    for col in set(CALL_COLUMNS) - set(_INT64) - {"index", "cpu_start_ns", "cpu_end_ns"}:
        df[col] = df[col].astype("string")
    return df


ABSOLUTE_NS = st.integers(1_700_000_000_000_000_000, 1_800_000_000_000_000_000)
TEXTS = st.one_of(st.none(), st.sampled_from(["0", "default_pg", "[0, 1]", "c10::BFloat16", "ä"]),
                  st.integers(0, 9), st.floats(0, 10, allow_nan=False))  # numbers, as a trace may write them
CALL = st.fixed_dictionaries({c: ABSOLUTE_NS if c in ("cpu_start_ns", "cpu_end_ns") else
                              st.integers(0, 100) if c == "index" else
                              st.one_of(st.none(), ABSOLUTE_NS, st.integers(0, 64)) if c in _INT64 else TEXTS
                              for c in CALL_COLUMNS})


@settings(max_examples=200, deadline=None)
@given(st.lists(CALL, max_size=6))
@example([])  # a rank without collectives
@example([dict.fromkeys(CALL_COLUMNS, 7) | {"pg_desc": None}, dict.fromkeys(CALL_COLUMNS, None)
          | {"index": 1, "cpu_start_ns": 2, "cpu_end_ns": 3}])  # 7 beside a None: "7.0", as pandas gave it
def test_the_collectives_frame_is_the_one_pandas_gave_to_the_bit(rows):
    got, want = calls_frame(rows), _calls_frame_before(rows)
    assert list(got.dtypes) == list(want.dtypes)
    pd.testing.assert_frame_equal(got, want, check_exact=True)
