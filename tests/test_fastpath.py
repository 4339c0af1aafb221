"""The msgspec fast path gives exactly the events of the general path, or steps aside."""
from __future__ import annotations

import copy
import gzip
import json
from collections import Counter
from decimal import Decimal
from typing import Any

import orjson
import pytest
from conftest import BASE, SHARED, make_trace, shared, shared_params
from hypothesis import given, settings
from hypothesis import strategies as st
from test_properties import QUARTER, SEEDS, mutate, rank_events, seed

from tracefuse_dask.errors import TraceFuseError
from tracefuse_dask.kineto.events import decode_or_none
from tracefuse_dask.merge.fastpath import _decoders, _KinetoEvent, handles, rewrite_fast
from tracefuse_dask.merge.tasks import rewrite_general
from tracefuse_dask.model import MergeOptions, RankTask
from tracefuse_dask.synth import make_rank_trace

TRACE_FILES = shared_params(sorted(str(p.relative_to(SHARED)) for p in SHARED.glob("**/*.json*")
                                   if p.name != "generation_info.json"))
OPTIONS = [pytest.param(MergeOptions(), id="default"),
           pytest.param(MergeOptions(include_pyfunc=True, keep_empty_processes=True, annotate_rank=True),
                        id="pyfunc-empty-annotate")]


def exact(text: bytes) -> Any:
    """Parsed JSON with ts and dur as exact integer ns, read from the text itself."""
    events = json.loads(text, parse_float=Decimal)
    for e in events:
        for key in ("ts", "dur"):
            if key in e:
                e[key] = int(Decimal(e[key]) * 1000)
    return events


def general(data: bytes, rank: int, base: int, base_out: int, opts: MergeOptions) -> tuple[Any, Any, Any]:
    """The general path as the merge's task runs it (the rewrite, then the lanes): head, body, the account of
    what it left out and the anomalies of what it kept."""
    left_out: Counter = Counter()
    anomalies: dict[str, int] = {}
    head, body, n_in, n_out, _, _ = rewrite_general(RankTask(rank, "f", base, base_out, opts), orjson.loads(data),
                                                    "f (rank 0)", left_out, anomalies)
    head, body = exact(head), exact(body)
    assert n_out == len(head) + len(body) and n_in - sum(left_out.values()) <= n_out
    return head, body, dict(+left_out), anomalies


def fast(data: bytes, rank: int, base: int, base_out: int, opts: MergeOptions) -> tuple[Any, ...] | None:
    left_out: Counter = Counter()
    anomalies: dict[str, int] = {}
    got = rewrite_fast(data, rank, base, base_out, opts, "f (rank 0)", left_out, anomalies)
    if got is None:
        return None
    head, body, n_in, n_out, _, _ = got
    head, body = exact(head), exact(body)
    assert n_in == len(json.loads(data)["traceEvents"]) and n_out == len(head) + len(body)
    return head, body, dict(+left_out), anomalies


def text(path: str) -> bytes:
    raw = shared(*path.split("/")).read_bytes()
    return gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw


@pytest.mark.parametrize("opts", OPTIONS)
@pytest.mark.parametrize("shift", [0, QUARTER], ids=["same-base", "later-base"])
@pytest.mark.parametrize("path", TRACE_FILES)
def test_fast_path_equals_general_path_on_every_shared_trace(path, shift, opts):
    data = text(path)
    base = orjson.loads(data).get("baseTimeNanoseconds")
    got = fast(data, 3, (base or 0) + shift, base or 0, opts)
    assert got is not None, "a real trace fell back to the general path"
    assert got == general(data, 3, (base or 0) + shift, base or 0, opts)


@pytest.mark.parametrize("path", TRACE_FILES)
def test_real_traces_decode_with_known_phases_and_categories(path):
    """The cheaper decoding (phases and categories as Literals) covers real traces and the synthetic ones; others
    decode again with plain strings (``unknown-category-and-phase`` below)."""
    events = decode_or_none(text(path), *_decoders).traceEvents
    assert events and all(type(e) is _KinetoEvent for e in events)


def test_synthetic_traces_decode_with_known_phases_and_categories():
    events = decode_or_none(orjson.dumps(make_rank_trace(0, 8, target_bytes=2**20, seed=0)), *_decoders).traceEvents
    assert events and all(type(e) is _KinetoEvent for e in events)
    odd = orjson.dumps({"traceEvents": [{"ph": "X", "cat": "my_category", "name": "a", "pid": 1, "ts": 1.0}]})
    assert type(decode_or_none(odd, *_decoders).traceEvents[0]) is not _KinetoEvent


def doc_with(*events: dict[str, Any]) -> bytes:
    x = {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 7, "tid": 7, "ts": 10.5, "dur": 2.25,
         "args": {"External id": 1}}
    return orjson.dumps(make_trace(0, [x, *events]))


EV = {"ph": "X", "cat": "cpu_op", "name": "a", "pid": 7, "tid": 7, "ts": 11.0, "dur": 1.0}
# An accelerator the vocabulary does not know by name (as MTIA's mtia_ccp_events): device work where args.stream is
# an integer, whatever else the args hold; a flow ends on it.
ACCEL = [dict(EV, cat="npu_events", pid=17, tid=4, ts=t, args=a) for t, a in [
    (20.0, {"stream": 4}), (21.0, {"stream": 4, "x": [1, {"stream": "no"}]}), (22.0, {"stream": "4"}),
    (23.0, {"stream": 4.0}), (24.0, {"stream": True}), (25.0, {"stream": None}), (26.0, {"other": 4}), (27.0, [4]),
    (28.0, None)]] + [dict(EV, cat="npu_events", pid=17, tid=5, ts=29.0), dict(EV, ph="s", id=3, cat="ac2g"),
                      dict(EV, ph="f", id=3, pid=17, tid=4, ts=20.0, cat="ac2g", bp="e"),
                      {"ph": "M", "name": "thread_name", "pid": 17, "tid": 4, "ts": 0, "args": {"name": "Stream 4"}},
                      {"ph": "M", "name": "process_labels", "pid": 17, "tid": 0, "ts": 0, "args": {"labels": "NPU 17"}}]


# Two kernels on stream 9 of pid 8, the second starting before the first ends, each launched from pid 7 (an ac2g flow).
CROSSING = [dict(EV, pid=8, tid=9, cat="kernel", ts=20.0, dur=5.0, args={"stream": 9}),
            dict(EV, pid=8, tid=9, cat="kernel", ts=22.0, dur=5.0, args={"stream": 9}),
            dict(EV, ph="s", id=1, cat="ac2g", ts=12.0),
            dict(EV, ph="f", id=1, pid=8, tid=9, ts=20.0, cat="ac2g", bp="e"),
            dict(EV, ph="s", id=2, cat="ac2g", ts=13.0),
            dict(EV, ph="f", id=2, pid=8, tid=9, ts=22.0, cat="ac2g", bp="e")]


@pytest.mark.parametrize("data", [
    pytest.param(doc_with(dict(EV, args={"rank": 9, "x": 1})), id="args-with-rank"),
    pytest.param(doc_with(dict(EV, args={"name": "rank"})), id="rank-as-a-value"),
    pytest.param(doc_with(dict(EV, args={"x": 1, "RANK": 7})).replace(b'"RANK"', b'"r\\u0061nk"'),
                 id="escaped-rank-key"),
    pytest.param(doc_with(dict(EV, args={})), id="empty-args"),
    pytest.param(json.dumps(orjson.loads(doc_with(dict(EV, args={}), dict(EV, args={"rank": 9}))), indent=1).encode(),
                 id="pretty-printed"),
    pytest.param(doc_with(dict(EV, args=None)), id="null-args"),
    pytest.param(doc_with(dict(EV, args=[1, 2])), id="list-args"),
    pytest.param(doc_with(dict(EV, args="x")), id="string-args"),
    pytest.param(doc_with(dict(EV, args={"name": "caf\u00e9 \u00b7"})), id="non-ascii-args"),
    pytest.param(doc_with(dict(EV, tid="stream 7")), id="string-tid"),
    pytest.param(doc_with(dict(EV, pid=-1), dict(EV, pid="Spans")), id="overhead-and-string-pids"),
    pytest.param(doc_with({"ph": "i", "s": "g", "name": "i", "pid": "Traces", "tid": 1, "ts": 12.0}),
                 id="global-instant"),
    pytest.param(doc_with({"ph": "M", "name": "thread_name", "pid": 7, "tid": 7, "ts": 0, "args": {"name": "a"}},
                          {"ph": "M", "name": "thread_name", "pid": 7, "tid": 7, "ts": 0, "args": {"name": "b"}}),
                 id="duplicate-thread-name"),
    pytest.param(doc_with(dict(EV, ph="s", id=2**40, cat="fwdbwd"), dict(EV, ph="f", id=2**40, cat="fwdbwd")),
                 id="flow-id-beyond-32-bits"),
    pytest.param(orjson.dumps(make_trace(0, [dict(EV, ts=1682725897226747)], base=None)), id="absolute-int-ts"),
    pytest.param(doc_with(dict(EV, cat="my_category"), dict(EV, ph="Z")), id="unknown-category-and-phase"),
    pytest.param(doc_with(dict(EV, pid=3), dict(EV, pid=3, tid=9, cat="kernel", ts=20.0),
                          dict(EV, ph="s", id=1, pid=3, cat="ac2g"), dict(EV, ph="f", id=1, pid=3, tid=9, ts=20.0, cat="ac2g"),
                          dict(EV, ph="f", id=1, pid=3, tid=9, ts=21.0, cat="ac2g")),
                 id="flows-on-a-pid-with-host-and-device-events"),
    pytest.param(doc_with(*ACCEL), id="unknown-category-on-device-streams"),
    pytest.param(doc_with(*ACCEL, dict(EV, pid=17, tid=2)), id="unknown-category-on-device-streams-and-host"),
    pytest.param(doc_with(dict(ACCEL[0], args={"x": 1, "STREAM": 4})).replace(b'"STREAM"', b'"str\\u0065am"'),
                 id="escaped-stream-key"),
    # Slices that cross, so that one goes to a lane: the fast path knows their threads from their kinds, except
    # where only each event's args place it (the unknown category on a pid with host events)
    pytest.param(doc_with(*CROSSING, dict(EV, pid=3), *[dict(e, pid=3) for e in CROSSING]),
                 id="crossing-kernels-on-a-pid-with-host-and-device-events"),
    pytest.param(doc_with(*[dict(ACCEL[0], ts=t, dur=5.0) for t in (20.0, 22.0)]),
                 id="crossing-unknown-category-on-a-device-stream"),
    pytest.param(doc_with(*[dict(ACCEL[0], ts=t, dur=5.0) for t in (20.0, 22.0)], dict(EV, pid=17, tid=2)),
                 id="crossing-unknown-category-on-a-pid-with-host-events"),
    pytest.param(doc_with(*[dict(EV, tid="stream 7", ts=t, dur=5.0) for t in (11.0, 13.0)]), id="crossing-string-tid"),
    pytest.param(doc_with({k: v for k, v in EV.items() if k != "tid"} | {"dur": 5.0}, dict(EV, tid=0, ts=13.0, dur=5.0),
                          dict(EV, ts=14.0, dur=5.0)), id="crossing-on-no-tid-tid-0-and-the-pid-s"),
    pytest.param(doc_with(dict(EV, name="ProfilerStep#1", dur=30.0), *CROSSING,
                          dict(EV, name="ProfilerStep#3", ts=100.0), dict(CROSSING[0], name="ProfilerStep#2", ts=60.0)),
                 id="steps-and-a-device-slice-so-named"),
])
@pytest.mark.parametrize("shift", [0, 5_000_123, 2**44 * 1000], ids=["same-base", "later-base", "past-2-43-us"])
@pytest.mark.parametrize("annotate", [False, True], ids=["plain", "annotate-rank"])
def test_fast_path_equals_general_path_on_odd_events(data, shift, annotate):
    opts = MergeOptions(annotate_rank=annotate)
    assert fast(data, 2, BASE + shift, BASE, opts) == general(data, 2, BASE + shift, BASE, opts)


@pytest.mark.parametrize("data, base, base_out", [
    pytest.param(doc_with(dict(EV, color="red")), BASE, BASE, id="unknown-field"),
    pytest.param(doc_with(dict(EV, tid=None)), BASE, BASE, id="null-tid"),
    pytest.param(doc_with(dict(EV, ts="12.5")), BASE, BASE, id="string-ts"),
    pytest.param(doc_with({k: v for k, v in EV.items() if k != "ts"}), BASE, BASE, id="no-ts"),
    pytest.param(doc_with(dict(EV, ts=-1.0)), BASE, BASE, id="negative-ts"),
    pytest.param(doc_with(dict(EV, dur=-1.0)), BASE, BASE, id="negative-dur"),
    pytest.param(doc_with(dict(EV, name=5)), BASE, BASE, id="int-name"),
    pytest.param(doc_with(dict(EV, args={"x": "MARK"})).replace(b"MARK", b"\xff"), BASE, BASE,
                 id="non-utf8-in-args"),
    pytest.param(doc_with(), BASE, BASE + 11_000, id="lands-before-the-base"),
    pytest.param(b'{"traceEvents": [', BASE, BASE, id="truncated"),
    pytest.param(b'{"traceEvents": {}}', BASE, BASE, id="events-not-a-list"),
])
def test_fast_path_steps_aside_for_what_the_general_path_handles(data, base, base_out):
    assert rewrite_fast(data, 0, base, base_out, MergeOptions(), "f (rank 0)", Counter(), {}) is None


@pytest.mark.parametrize("opts, window, ok", [
    (MergeOptions(), None, True),
    (MergeOptions(include_pyfunc=True, keep_empty_processes=True), None, True),
    (MergeOptions(keep=frozenset({"gpu"})), None, False),
    (MergeOptions(steps=(1, 2)), None, False),
    (MergeOptions(filter_fn=bool), None, False),
    (MergeOptions(rewrite_ids=True), None, False),
    (MergeOptions(counters=True), None, False),
    (MergeOptions(), (0, 10), False),
])
def test_fast_path_handles_only_unfiltered_merges(opts, window, ok):
    assert handles(opts, window) is ok


@settings(max_examples=150, deadline=None)
@given(events=rank_events(), rank=st.integers(0, 5000), shift=st.sampled_from([0, 1, QUARTER]),
       include_pyfunc=st.booleans(), annotate=st.booleans())
def test_fast_path_equals_general_path_on_generated_ranks(events, rank, shift, include_pyfunc, annotate):
    data = orjson.dumps({"traceEvents": events})
    opts = MergeOptions(include_pyfunc=include_pyfunc, annotate_rank=annotate)
    got = fast(data, rank, BASE + shift, BASE, opts)
    if got is not None:
        assert got == general(data, rank, BASE + shift, BASE, opts)


@settings(max_examples=200, deadline=None, report_multiple_bugs=False)
@given(data=st.data(), name=st.sampled_from(SEEDS))
def test_fast_path_on_mutated_real_traces_agrees_or_steps_aside(data, name):
    buf, _ = mutate(data, seed(name))
    try:
        got = fast(buf, 1, BASE, BASE, MergeOptions())
    except TraceFuseError:
        got = None
    if got is None:
        return
    try:
        want = general(copy.copy(buf), 1, BASE, BASE, MergeOptions())
    except (TraceFuseError, orjson.JSONDecodeError):
        return  # values the general parser refuses inside args pass as text
    assert as_orjson_reads(got) == want


def as_orjson_reads(value: Any) -> Any:
    """``value`` with every integer beyond 64 bits as orjson reads it on the general path: the nearest float.

    The fast path passes ``args`` through as text, so it keeps such an integer exactly.
    """
    if isinstance(value, (list, tuple)):
        return type(value)(as_orjson_reads(v) for v in value)
    if isinstance(value, dict):
        return {k: as_orjson_reads(v) for k, v in value.items()}
    if type(value) is int and not -2**63 <= value < 2**64:
        return Decimal(orjson.dumps(float(value)).decode())
    return value
