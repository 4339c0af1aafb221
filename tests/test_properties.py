"""Property tests of the per-rank rewrite rules (spec §3, §6) and a fuzz test of the loader."""
from __future__ import annotations

import copy
import functools
import gzip
import json
import re
from decimal import Decimal
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import shared
from perfetto_rules import assert_inputs_kept, assert_perfetto_rules, ns
from tracefuse_dask.errors import TraceFuseError
from tracefuse_dask.storage.files import parse_json
from tracefuse_dask.kineto.document import check_document
from tracefuse_dask.model import MergeOptions
from tracefuse_dask.kineto.events import RankEvents
from tracefuse_dask.merge.lanes import slices, to_lanes
from tracefuse_dask.merge.rewrite import device_pids, order_slots, rewrite

HERE = Path(__file__).parent
BASE0 = 1790857026000000000
QUARTER = 7889238 * 10**9  # Kineto floors its base to this period
MAX_NS = 2**43 * 1000 - 1
CATS = ["cpu_op", "user_annotation", "kernel", "gpu_memcpy", "cuda_runtime", "python_function", "Trace"]
NAMES = ["aten::mm", "ProfilerStep#1", "gemm_kernel", "Memcpy HtoD", "cudaLaunchKernel", "nccl:all_reduce"]

PIDS = st.one_of(st.integers(0, 20), st.integers(30000, 4000000), st.sampled_from([-1, "Spans", "Traces", ""]))
TIDS = st.one_of(st.integers(0, 2**32 - 1), st.integers(0, 40).map(lambda n: f"stream {n}"),
                 st.just("PyTorch Profiler"))
FLOW_IDS = st.one_of(st.integers(0, 2**32 + 10), st.integers(0, 50), st.integers(2**32 - 3, 2**32 + 10))


def micros(max_ns: int) -> st.SearchStrategy[Any]:
    """µs as Kineto writes them: a float with three decimals (integer ns / 1000), or an int."""
    ns = st.integers(0, max_ns)
    if max_ns > 2**52:  # ts of a long-lived process: where round(ts * 1000) is often 1 ns off
        ns = st.one_of(ns, st.integers(4 * 10**15, 2**52))
    return st.one_of(ns.map(lambda n: n / 1000), ns.map(lambda n: n // 1000))


def rewritten(sel: RankEvents, rank: int, base_out: int) -> list[Any]:
    """A rank's merged events as its task writes them: the rules, then the lanes."""
    head, body = rewrite(sel, rank, base_out)
    body += to_lanes(body, slices(body, structs=False), device_pids(rank, order_slots(*sel.pids, sel.who)),
                     structs=False)[1]
    return head + body


@st.composite
def rank_events(draw: Any) -> list[dict[str, Any]]:
    """One valid Kineto-like rank: X events, flows between them, instants and M events, shuffled."""
    pool = draw(st.lists(PIDS, min_size=1, max_size=6, unique=True))
    tids = draw(st.lists(TIDS, min_size=1, max_size=4, unique=True))
    x = st.fixed_dictionaries(
        {"ph": st.just("X"), "cat": st.sampled_from(CATS), "name": st.sampled_from(NAMES),
         "pid": st.sampled_from(pool), "tid": st.sampled_from(tids), "ts": micros(MAX_NS),
         "dur": micros(10**10)},
        optional={"args": st.fixed_dictionaries({"External id": st.integers(0, 99)})})
    xs = draw(st.lists(x, max_size=25))
    events: list[dict[str, Any]] = list(xs)
    anchors = [e for e in xs if e["cat"] != "python_function"]  # a dropped anchor drops its flow
    for fid in draw(st.lists(FLOW_IDS, max_size=4, unique=True)) if anchors else []:
        cat = draw(st.sampled_from(["ac2g", "fwdbwd"]))
        for ph in "sf":
            a = draw(st.sampled_from(anchors))
            events.append({"ph": ph, "id": fid, "pid": a["pid"], "tid": a["tid"], "ts": a["ts"], "cat": cat,
                           "name": cat, **({"bp": "e"} if ph == "f" else {})})
    for _ in range(draw(st.integers(0, 3))):
        events.append({"ph": "i", "s": draw(st.sampled_from("gpt")), "name": "Iteration Start",
                       "pid": draw(st.sampled_from([*pool, "Traces", ""])), "tid": draw(st.sampled_from(tids)),
                       "ts": draw(micros(MAX_NS))})
    for pid in draw(st.lists(st.sampled_from(pool), unique=True)):
        meta = {"ph": "M", "pid": pid, "tid": 0, **({"ts": draw(micros(MAX_NS))} if draw(st.booleans()) else {})}
        events.append({**meta, "name": "process_name", "args": {"name": "python3"}})
        labels = f"GPU {pid}" if draw(st.booleans()) else "CPU"
        events.append({**meta, "name": "process_labels", "args": {"labels": labels}})
        events.append({**meta, "name": "process_sort_index", "args": {"sort_index": 7}})
        for tid in draw(st.lists(st.sampled_from(tids), max_size=3)):  # duplicates test the dedup
            events.append({**meta, "name": "thread_name", "tid": tid, "args": {"name": f"thread {tid}"}})
    return draw(st.permutations(events))


def decimal_roundtrip(doc: Any) -> Any:
    return json.loads(orjson.dumps(doc), parse_float=Decimal)


@settings(max_examples=120, deadline=None)
@given(ranks=st.lists(st.integers(0, 7) | st.integers(0, 5000), min_size=1, max_size=5, unique=True).map(sorted),
       data=st.data(), has_base=st.booleans(), include_pyfunc=st.booleans())
def test_rewrite_properties(ranks, data, has_base, include_pyfunc):
    inputs = {r: data.draw(rank_events(), label=f"rank {r}") for r in ranks}
    bases = {r: BASE0 + data.draw(st.sampled_from([0, 1, 2])) * QUARTER if has_base else None for r in ranks}
    base_out = min(bases.values()) if has_base else 0
    opts = MergeOptions(include_pyfunc=include_pyfunc)
    chunks = {r: rewritten(RankEvents(copy.deepcopy(inputs[r]), bases[r] or 0, opts, f"r{r}.json (rank {r})"),
                         r, base_out) for r in ranks}
    merged = decimal_roundtrip({"baseTimeNanoseconds": base_out, "traceEvents": [e for r in ranks for e in chunks[r]]})
    docs = {r: decimal_roundtrip({"traceEvents": inputs[r], **({"baseTimeNanoseconds": bases[r]} if has_base else {})})
            for r in ranks}  # the inputs as the file text says them

    def keep(ev: dict[str, Any]) -> bool:
        return include_pyfunc or ev.get("cat") != "python_function"

    assert_perfetto_rules(merged)
    assert_inputs_kept(merged, docs, keep=keep)
    out_by_rank, k = {}, 0
    for r in ranks:
        out_by_rank[r], k = merged["traceEvents"][k:k + len(chunks[r])], k + len(chunks[r])
    pids = [{e["pid"] for e in out_by_rank[r]} for r in ranks]
    assert len(set().union(*pids)) == sum(map(len, pids)), "a pid is shared by two ranks"
    flow_keys = [{(e["id"], e["cat"], e["name"]) for e in out_by_rank[r] if e["ph"] in "stf"} for r in ranks]
    assert len(set().union(*flow_keys)) == sum(map(len, flow_keys)), "a flow key is shared by two ranks"
    threads = [(e["pid"], e["tid"]) for e in merged["traceEvents"] if e["name"] == "thread_name"]
    assert len(threads) == len(set(threads)), "a thread is named twice"
    for r in ranks:
        base = docs[r].get("baseTimeNanoseconds", 0)
        kept = [e for e in docs[r]["traceEvents"] if e["ph"] != "M" and keep(e)]
        out = [e for e in out_by_rank[r] if e["ph"] != "M"]
        # Kept events come out in input order, each at its input absolute ns: per-rank time order holds.
        assert [(e["ph"], e.get("name")) for e in out] == [(e["ph"], e.get("name")) for e in kept]
        assert [base_out + ns(e["ts"]) for e in out] == [base + ns(e["ts"]) for e in kept]
        raw = [e["id"] for e in kept if e["ph"] in "stf"]
        ids = [e["id"] for e in out if e["ph"] in "stf"]
        assert all(i >> 32 == r for i in ids)
        if all(type(i) is int and 0 <= i < 2**32 for i in raw):
            assert ids == [(r << 32) | i for i in raw]
        assert len(set(raw)) == len(set(zip(raw, ids))) == len(set(ids)), "flow ids merged or split"


# --- Loader fuzz: mutated real traces raise TraceFuseError or load and rewrite cleanly ---

SEEDS = ["real/hta_triton_example/triton_example.json.gz", "real/kineto_docs/after_fix_trace.json",
         "real/hta_cuda_event_sync/event_sync_trace.json.gz",
         "data/composer/composer_rank0_ep0-ba5.json.gz"]  # a Composer trace: the array form
TOKENS = [b'"x"', b"[]", b"{}", b"null", b"-1", b"1e400", b"NaN", b"true", b'""', b"18446744073709551616"]
FIELD_VALUES = ["x", [], [1], {}, {"a": 1}, None, -1, 1.5, 2**63, "", "GPU 0", "process_name", "thread_name"]
KINDS = ["flip", "overwrite", "truncate", "insert", "token", "token", "field", "field", "field"]
VALUE = re.compile(rb':\s*("(?:[^"\\]|\\.)*"|-?\d[\d.eE+-]*|true|false|null)')


@functools.cache
def seed(name: str) -> bytes:
    raw = (HERE / name if name.startswith("data/") else shared(*name.split("/"))).read_bytes()
    return gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw


def mutate(data: Any, buf: bytes) -> tuple[bytes, bool]:
    """Apply one to three random mutations; say whether one of them truncated the text."""
    cut = False
    for _ in range(data.draw(st.integers(1, 3), label="mutations")):
        kind = data.draw(st.sampled_from(KINDS), label="kind")
        at = data.draw(st.integers(0, max(len(buf) - 1, 0)), label="at")
        if kind == "flip" and buf:
            buf = buf[:at] + bytes([buf[at] ^ 1 << data.draw(st.integers(0, 7))]) + buf[at + 1:]
        elif kind == "overwrite":
            new = data.draw(st.binary(min_size=1, max_size=8))
            buf = buf[:at] + new + buf[at + len(new):]
        elif kind == "truncate":
            buf, cut = buf[:at], True
        elif kind == "insert":
            buf = buf[:at] + data.draw(st.binary(min_size=1, max_size=8)) + buf[at:]
        elif kind == "field":
            try:
                doc = orjson.loads(buf)
                ev = doc["traceEvents"][data.draw(st.integers(0, len(doc["traceEvents"]) - 1), label="event")]
                key = data.draw(st.sampled_from(sorted({*ev, "args", "cat", "name"})), label="key")
            except Exception:  # an earlier mutation broke the document, or the event is not an object
                continue
            ev[key] = data.draw(st.sampled_from(FIELD_VALUES), label="value")
            buf = orjson.dumps(doc)
        else:
            values = list(VALUE.finditer(buf))
            if values:
                m = values[data.draw(st.integers(0, len(values) - 1), label="value")]
                buf = buf[:m.start(1)] + data.draw(st.sampled_from(TOKENS), label="token") + buf[m.end(1):]
    return buf, cut


def load_and_rewrite(path: str, opts: MergeOptions, repair: bool = False) -> None:
    """Load and rewrite as a rank task does; only TraceFuseError may escape, and it is swallowed."""
    try:
        doc, _, _ = parse_json(path, repair=repair)
        check_document(doc, path)
        base = doc.get("baseTimeNanoseconds")
        base = base if type(base) is int and base >= 0 else 0
        rewritten(RankEvents(doc["traceEvents"], base, opts, "f (rank 0)"), 0, base)
    except TraceFuseError:
        pass


OPTIONS = [MergeOptions(), MergeOptions(include_pyfunc=True, steps=(0, 10**6), rewrite_ids=True),
           MergeOptions(keep=frozenset({"gpu", "comm"}), keep_empty_processes=True)]


@settings(max_examples=400, deadline=None, report_multiple_bugs=False)
@given(data=st.data(), name=st.sampled_from(SEEDS), compress=st.booleans(), opts=st.sampled_from(OPTIONS))
def test_mutated_real_traces_fail_only_with_tracefuse_errors(tmp_path_factory, data, name, compress, opts):
    buf, cut = mutate(data, seed(name))
    if compress:
        buf = gzip.compress(buf, mtime=0)
        if data.draw(st.booleans(), label="cut gzip"):
            buf, cut = buf[:data.draw(st.integers(0, len(buf) - 1))], True
    path = tmp_path_factory.getbasetemp() / "fuzz-trace.json"
    path.write_bytes(buf)
    load_and_rewrite(str(path), opts)
    if cut:
        load_and_rewrite(str(path), opts, repair=True)


# Minimal reproductions of what the fuzz test finds: each must load or raise a TraceFuseError.
@pytest.mark.parametrize("event, opts", [
    pytest.param({"ph": "M", "name": "thread_name", "pid": 7, "tid": 7, "args": {"name": "t"}}, {},
                 id="thread-name-of-pid-without-events-KeyError"),
    pytest.param({"ph": "M", "name": "process_name", "pid": 7, "tid": 0, "args": "x"}, {},
                 id="process-name-str-args-AttributeError"),
    pytest.param({"ph": "M", "name": [], "pid": 7, "tid": 0}, {}, id="metadata-list-name-TypeError"),
    pytest.param({"ph": "X", "cat": [], "name": "a", "pid": 7, "tid": 0, "ts": 1.0}, {}, id="list-cat-TypeError"),
    pytest.param({"ph": "s", "cat": [], "name": "a", "pid": 7, "tid": 0, "ts": 1.0, "id": 1}, {},
                 id="flow-list-cat-TypeError"),
    pytest.param({"ph": "X", "name": "ProfilerStep#1", "pid": 7, "tid": 0, "ts": 1.0, "dur": 5.0,
                  "args": {"correlation": []}}, {"steps": (0, 9)}, id="steps-list-correlation-TypeError"),
])
def test_odd_field_values_fail_only_with_tracefuse_errors(event, opts):
    try:
        rewrite(RankEvents([event], 0, MergeOptions(**opts), "f (rank 0)"), 0, 0)
    except TraceFuseError:
        pass
