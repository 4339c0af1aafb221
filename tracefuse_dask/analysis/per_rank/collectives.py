"""Each rank's collective calls (a map task's table, ``CALL_COLUMNS``), which ``cross_rank.collectives``
matches across ranks. Pure functions on events; no IO, no Dask."""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from typing import Any

import numpy as np
import orjson
import pandas as pd

from ...kineto.collectives import ITEMSIZE, canonical_op, group_members, group_spec
from ...kineto.vocabulary import COLLECTIVE_OP_PREFIXES, is_collective_call, is_comm_kernel
from .model import RankModel

__all__ = ["CALL_COLUMNS", "calls_frame", "rank_collectives"]

CALL_COLUMNS = ["index", "op", "name", "pg_name", "pg_desc", "group_ranks", "group_size", "dtype", "in_nelems",
                "out_nelems", "in_bytes", "out_bytes", "input_dims", "seq", "comms_id", "step", "tid",
                "cpu_start_ns", "cpu_end_ns", "gpu_start_ns", "gpu_end_ns", "stream", "done_ns"]

_TYPES = dict.fromkeys(("group_size", "in_nelems", "out_nelems", "in_bytes", "out_bytes", "seq", "step", "gpu_start_ns",
                        "gpu_end_ns", "stream", "done_ns"), "Int64") | dict.fromkeys(
    ("op", "name", "pg_name", "pg_desc", "group_ranks", "dtype", "input_dims", "comms_id", "tid"), "string")


def rank_collectives(model: RankModel, pg_config: Mapping[str, str]) -> pd.DataFrame:
    """One rank's collective calls, one row each, times in absolute ns.

    A call is the outermost of a chain of ``c10d::*``, ``record_param_comms``, ``nccl:*``, ``gloo:*``
    and symmetric-memory collective events (``is_collective_call``); its args are gathered over the chain, and its GPU times are those
    of the collective kernels launched inside it (``is_comm_kernel``). A ``gloo:*`` annotation on its own runloop
    thread is the execution of a ``c10d::*`` call, not a call, when the rank has ``c10d::*`` calls.
    Only the chains' events are read, not the whole rank's.

    ``done_ns`` is when the collective was done on this rank: its last kernel's end; for a gloo call, the end of
    its execution (the first unpaired ``gloo:*`` of its op that starts after it, in order: gloo runs a group's
    work in the order it was queued), as ``c10d::*`` returns once the work is queued; else the call's end.

    ``pg_config``: ``distributedInfo.pg_config`` as ``{pg_name: rank spec of its global ranks}`` (``group_spec``).
    """
    name_code, names, tids, args, start, end = (model.name_code, model.names, model.tid, model.args, model.start,
                                                model.end)
    order, stop, launch_pos, gpu, steps, base = (model.tree.order, model.tree.stop, model.launch_pos, model.gpu,
                                                 model.steps, model.base)
    # the positions, ascending, of the events whose name ``is_collective_call``
    members = np.flatnonzero(np.array([is_collective_call(nm) for nm in names], dtype=bool)[name_code[order]])
    root = np.full(len(order), -1, dtype=np.int64)  # the outermost member holding each position
    chain = []  # (its event, its root's event) of each member
    reach = top = 0
    for k in members.tolist():
        if k >= reach:
            top, reach = k, int(stop[k])
            root[k:reach] = k
        chain.append((int(order[k]), int(order[top])))
    has_c10d = any(names[name_code[i]].startswith("c10d::") for i, _ in chain)
    calls: dict[int, dict[str, Any]] = {}  # by the root's event
    runs: dict[str, list[tuple[int, int]]] = defaultdict(list)  # gloo's executions, by op: (start, end)
    for i, r in chain:
        if r not in calls:
            name = names[name_code[r]]
            if has_c10d and name.startswith("gloo:"):
                if i == r:
                    runs[canonical_op(name)].append((int(start[r]) + base, int(end[r]) + base))
                continue
            calls[r] = {"name": name, "tid": tids[r], "cpu_start_ns": int(start[r]) + base,
                        "cpu_end_ns": int(end[r]) + base}
        _gather(calls[r], names[name_code[i]], args[i])
    held = root[launch_pos] if len(root) else launch_pos  # -1: not inside a call
    for j in np.flatnonzero((launch_pos >= 0) & (held >= 0)).tolist():  # the GPU work launched inside calls
        r = int(order[held[j]])
        if r in calls and is_comm_kernel(gpu.name[j], gpu.args[j]):
            c = calls[r]
            s, e = int(gpu.start[j]) + base, int(gpu.end[j]) + base
            c["gpu_start_ns"] = min(c.get("gpu_start_ns", s), s)
            c["gpu_end_ns"] = max(c.get("gpu_end_ns", e), e)
            c["stream"] = gpu.stream[j]
    rows = []
    sizes = {pg: len(group_members(spec)) for pg, spec in pg_config.items()}
    for run in runs.values():
        run.sort(reverse=True)
    for k, r in enumerate(sorted(calls, key=lambda r: (calls[r]["cpu_start_ns"], r))):
        c = calls[r]
        op = canonical_op(c.get("collective") or c.get("op_name") or c["name"])
        run = runs.get(op, [])
        while run and run[-1][0] < c["cpu_start_ns"]:  # an execution of work queued before the trace began
            run.pop()
        done = c.get("gpu_end_ns") or (run.pop()[1] if run else c["cpu_end_ns"])
        pg = c.get("pg_name")
        text = c.get("group_ranks")
        # Kineto writes the first 30 ranks of a bigger group and "...": then pg_config has them all
        ranks = group_spec(text) or pg_config.get(pg) or text
        itemsize = ITEMSIZE.get(str(c.get("dtype", "")).lower().removeprefix("c10::"))  # ``Input type``'s c10::
        in_n, out_n = c.get("in_nelems"), c.get("out_nelems")
        rows.append({
            "index": k, "op": op,
            "name": c["name"], "pg_name": pg, "pg_desc": c.get("pg_desc"), "group_ranks": ranks,
            "group_size": c.get("group_size") or sizes.get(pg),
            "dtype": c.get("dtype"), "in_nelems": in_n, "out_nelems": out_n,
            "in_bytes": in_n * itemsize if in_n is not None and itemsize else None,
            "out_bytes": out_n * itemsize if out_n is not None and itemsize else None,
            "input_dims": c.get("input_dims"), "seq": c.get("seq"), "comms_id": c.get("comms_id"),
            "step": _step_of(steps, c["cpu_start_ns"] - base), "tid": str(c["tid"]),
            "cpu_start_ns": c["cpu_start_ns"], "cpu_end_ns": c["cpu_end_ns"],
            "gpu_start_ns": c.get("gpu_start_ns"), "gpu_end_ns": c.get("gpu_end_ns"), "stream": c.get("stream"),
            "done_ns": done,
        })
    return calls_frame(rows)


def calls_frame(rows: list[dict[str, Any]]) -> pd.DataFrame:
    """The rows as the ``CALL_COLUMNS`` frame, each column typed at once from its values (the frame pandas makes
    from the rows, then 20 conversions, cost 1-2 ms a rank): absolute ns as ``Int64`` from the rows, not from a
    column, which pandas makes float64 when it has a None, where absolute ns (1.7e18) lose up to 128 ns to a
    float's 53 bits (a call's GPU start then fell after its first kernel's start, so that ``walker.rank_pieces``
    did not find the call's kernels, and the path stopped at its arrival); texts as ``string``."""
    columns = {}
    for c in CALL_COLUMNS:
        values = [r[c] for r in rows]
        if c not in _TYPES:  # ints as pandas infers them (object when there is no row)
            columns[c] = values if values else pd.array([], dtype=object)
        elif _TYPES[c] == "Int64" or all(v is None or type(v) is str for v in values):
            columns[c] = pd.array(values, dtype=_TYPES[c])
        else:  # a number in a text column: as the column pandas infers gives it (7 beside a None as "7.0")
            columns[c] = pd.Series(values, dtype=None if values else object).astype("string").array
    return pd.DataFrame(columns)


def _gather(call: dict[str, Any], name: str, args: Any) -> None:
    """Take a chain member's args into its call; the first value seen wins."""
    if name.startswith(COLLECTIVE_OP_PREFIXES):
        call.setdefault("op_name", name)
    found = {
        "collective": args.collective,
        "pg_name": args.pg_name,
        "pg_desc": args.pg_desc,
        "group_ranks": args.group_ranks,
        "group_size": args.group_size,
        "dtype": args.dtype,
        "in_nelems": args.in_nelems,
        "out_nelems": args.out_nelems,
        "seq": args.seq,
        "comms_id": args.comms_id,
    }
    for key, value in found.items():
        if value is not None and value != "" and key not in call:
            call[key] = str(value) if key in ("pg_name", "comms_id", "group_ranks") else value
    dims = orjson.loads(memoryview(args.input_dims)) if args.input_dims else None  # raw JSON text, empty when absent
    if dims is not None and "input_dims" not in call and _dims_product(dims):
        call["input_dims"] = orjson.dumps(dims).decode()
        n = _dims_product(dims)
        types = orjson.loads(memoryview(args.input_types)) if args.input_types else None
        dtype = next((t for t in types if t and t not in ("Scalar", "TensorList")), None) if isinstance(
            types, list) else None
        call.setdefault("in_nelems", n)
        if dtype:
            call.setdefault("dtype", dtype)


def _step_of(spans: list[tuple[int, int, int]], t: int) -> int | None:
    for step, s, e in spans:
        if s <= t < e:
            return step
    return None


def _dims_product(dims: Any) -> int | None:
    """Elements of the first tensor in ``Input Dims`` (a tensor list counts its first tensor)."""
    if not isinstance(dims, list):
        return None
    for d in dims:
        while isinstance(d, list) and d and isinstance(d[0], list):
            d = d[0]
        if isinstance(d, list) and d and all(type(v) is int for v in d):
            return int(np.prod(d))
    return None
