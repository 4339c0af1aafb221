"""``tracefuse info``: what a set of trace files holds, one parse task per file, nothing written."""
from __future__ import annotations

import io
from collections import Counter
from collections.abc import Iterable, Mapping
from operator import attrgetter
from typing import Any

import msgspec
import numpy as np
import orjson

from .cluster import batches, connect
from .errors import (
    SKIPPABLE,
    MergeError,
    RankError,
    TraceFormatError,
    every_rank_failed,
    skipped_rank,
)
from .kineto.array_form import COMPOSER_MERGED, MERGED_BY_COMPOSER
from .kineto.document import check_document, decode_json, paused_gc
from .kineto.events import FLOW_PH, is_device_event
from .kineto.header import read_header
from .kineto.layout import is_merged, split_merged
from .kineto.times import to_ns, to_ns_array
from .kineto.vocabulary import host_category, on_device
from .merge.fastpath import account_fast
from .merge.tasks import rewrite_general
from .model import (
    DEFAULT_RANK_REGEX,
    InputFile,
    MergeOptions,
    RankTask,
    anomaly_line,
    job_account,
    rank_account,
    repair_line,
)
from .storage.files import read_bytes, retry_unreachable
from .storage.inputs import expand_inputs, resolve_rank

__all__ = ["describe_traces", "figures_of_dicts", "figures_of_structs", "format_table"]

_U32 = 1 << 32


def _describe(f: InputFile, storage_options: Mapping[str, Any] | None,
              repair: bool) -> tuple[int, list[dict[str, Any]], str | None] | str:
    """The file's uncompressed size, a row per rank it holds (its own, or each rank of a trace that tracefuse
    merged) and what ``repair`` recovered; for a listed file that is not a per-rank trace, why it is ignored (in
    the merge's words). A per-rank trace's row has the account of a merge with the default options (``account``:
    ``model.rank_account``), from the merge's own rewrite, on its fast path where the merge would take it."""
    data, cut_gzip = read_bytes(f.path, storage_options, repair=repair)
    fast = None if cut_gzip else _described_fast(f, data)
    if fast is not None:
        return fast
    doc, nbytes, repaired = decode_json(data, f.path, rank=f.rank_hint, cut_gzip=cut_gzip, repair=repair)
    del data
    if isinstance(doc, dict) and COMPOSER_MERGED in doc:
        if f.listed:
            return f"{f.path}: {MERGED_BY_COMPOSER}"
        raise TraceFormatError(f"{f.path}: this is {MERGED_BY_COMPOSER}, not a per-rank trace; describe the per-rank "
                               "files instead")
    merged = isinstance(doc, dict) and is_merged(doc.get("metadata"))
    if f.listed and isinstance(doc, dict) and "traceEvents" not in doc:
        return f"{f.path}: a JSON file without traceEvents, not a trace"
    if f.listed and merged:  # beside per-rank ones, as the merge ignores it
        return f"{f.path}: a merged trace written by tracefuse"
    check_document(doc, f.path)
    base = doc.get("baseTimeNanoseconds") if type(doc.get("baseTimeNanoseconds")) is int else None
    if not merged:
        row = _row(f, doc, nbytes, figures_of_dicts(doc["traceEvents"], base))
        left_out: Counter[str] = Counter()
        anomalies: dict[str, int] = {}
        try:  # after the figures: the rewrite changes the events
            _, _, n_in, n_out, moved, _ = rewrite_general(RankTask(0, f.path, 0, 0, MergeOptions()), doc,
                                                          f.path, left_out, anomalies)
            row["account"] = rank_account(n_in, n_out, left_out, moved, anomalies, repaired is not None)
        except (MergeError, TraceFormatError):  # an event or a layout the merge refuses: no account of it
            pass
        return nbytes, [row], repaired
    parts = split_merged(doc["traceEvents"])
    block = doc["metadata"]["tracefuse"]
    entries = block.get("ranks") if isinstance(block, dict) and isinstance(block.get("ranks"), dict) else {}
    for key in entries:  # a merged rank whose events were all filtered out still gets its row
        if key.isdigit():
            parts.setdefault(int(key), [])
    rows = []
    for rank, events in sorted(parts.items()):
        entry = entries.get(str(rank)) if isinstance(entries.get(str(rank)), dict) else {}
        info = entry.get("distributedInfo") if isinstance(entry.get("distributedInfo"), dict) else {}
        rows.append({"rank": rank, "path": f.path, "source": entry.get("source"), "bytes": None,
                     "bytes_uncompressed": None, "world_size": info.get("world_size"),
                     "host_name": entry.get("host_name"), **figures_of_dicts(events, base)})
    return nbytes, rows, repaired


def _described_fast(f: InputFile, data: bytes) -> tuple[int, list[dict[str, Any]], None] | None:
    """``_describe`` of a per-rank trace on the merge's fast path (``merge.fastpath.account_fast``), its figures
    taken from the decoded events (``figures_of_structs``); None for any other file or input that path leaves to
    the general one."""
    header, complete, _ = read_header(io.BytesIO(data))
    if not complete or COMPOSER_MERGED in header or is_merged(header.get("metadata")):
        return None
    base = header.get("baseTimeNanoseconds") if type(header.get("baseTimeNanoseconds")) is int else None
    figures: dict[str, Any] = {}
    try:
        got = account_fast(data, f.path, lambda events: figures.update(figures_of_structs(events, base)))
    except MergeError:  # the general path describes it
        return None
    if got is None:
        return None
    n_in, n_out, moved, left_out, anomalies = got
    return len(data), [_row(f, header, len(data), figures)
                       | {"account": rank_account(n_in, n_out, left_out, moved, anomalies)}], None


def _row(f: InputFile, header: Mapping[str, Any], nbytes: int, figures: dict[str, Any]) -> dict[str, Any]:
    """A per-rank trace's row: its rank and world size as the merge would resolve them (rank ``None`` where
    nothing gives it), sizes, host and ``figures``."""
    try:
        rank, world_size, _ = resolve_rank(f, header)
    except RankError:  # nothing gives the rank: info still describes the file, as rank "?"
        rank, world_size = None, None
    return {"rank": rank, "path": f.path, "bytes": f.size, "bytes_uncompressed": nbytes, "world_size": world_size,
            "host_name": header.get("host_name"), **figures}


def figures_of_dicts(events: list[Any], base: int | None) -> dict[str, Any]:
    """Events per category, time span, pids and flows of one rank's events."""
    cats: Counter[str] = Counter()
    host: set[Any] = set()
    device: set[Any] = set()
    strings: set[str] = set()
    flow_ends: dict[Any, set[str]] = {}
    lo = hi = None
    for ev in events:
        if not isinstance(ev, dict):
            continue
        ph = ev.get("ph")
        pid = ev.get("pid")
        if ph == "M":
            continue
        cats[str(ev.get("cat", ph))] += 1
        if isinstance(pid, str):
            strings.add(pid)
        elif is_device_event(ev):
            device.add(pid)
        elif ph not in ("s", "t", "f"):
            host.add(pid)
        if ph in ("s", "f", "t"):
            flow_ends.setdefault((ev.get("cat"), ev.get("name"), ev.get("id")), set()).add(ph)
        try:
            start = to_ns(ev["ts"])
            end = start + to_ns(ev.get("dur", 0))
        except (KeyError, TypeError, ValueError):
            continue
        lo = start if lo is None or start < lo else lo
        hi = end if hi is None or end > hi else hi
    return _figures(len(events), cats, host, device, strings, flow_ends, (lo, hi), base)


def _figures(n: int, cats: Counter[str], host: set[Any], device: set[Any], strings: set[str],
             flow_ends: dict[Any, set[str]], span: tuple[int | None, int | None], base: int | None) -> dict[str, Any]:
    """A rank's figures as ``info`` reports them, from what ``figures_of_dicts`` or ``figures_of_structs`` gathered."""
    ids = [k[2] for k in flow_ends]
    offset = base or 0
    lo, hi = span
    return {
        "base_time_ns": base,
        "events": n,
        "categories": dict(sorted(cats.items())),
        "start_ns": None if lo is None else offset + lo,
        "end_ns": None if hi is None else offset + hi,
        "pids": {"host": sorted(p for p in host if isinstance(p, int)), "device": sorted(device),
                 "string": sorted(strings)},
        "flows": {
            "ids": len(flow_ends),
            "unpaired": sum(1 for ends in flow_ends.values() if not {"s", "f"} <= ends),
            "max_id": max((i for i in ids if isinstance(i, int)), default=None),
            "ids_over_32_bits": sum(1 for i in ids if isinstance(i, int) and i >= _U32),
        },
    }


def figures_of_structs(events: list[Any], base: int | None) -> dict[str, Any]:
    """``figures_of_dicts`` of the events as the merge's fast path decodes them (``merge.fastpath``: structs whose absent
    fields are ``UNSET`` and whose ``args`` is raw JSON text), before any is dropped or rewritten: the same
    figures, from C-level passes over the fields and one pass per distinct ``(ph, pid, cat)``."""
    unset = msgspec.UNSET
    timed = [e for e in events if e.ph != "M"]
    cats = Counter(e.ph if e.cat is unset else e.cat for e in timed)
    host: set[Any] = set()
    device: set[Any] = set()
    strings: set[str] = set()
    unknown = set()  # the categories whose events are device work by their args.stream
    for ph, pid, cat in set(map(attrgetter("ph", "pid", "cat"), timed)):
        cat = None if cat is unset else cat
        if type(pid) is str:
            strings.add(pid)
        elif host_category(cat) is None:
            unknown.add(cat)
        elif on_device(cat):
            device.add(pid)
        elif ph not in FLOW_PH:
            host.add(pid)
    for e in timed if unknown else ():
        cat = None if e.cat is unset else e.cat
        if cat in unknown and type(e.pid) is not str:
            if on_device(cat, _args(e.args)):
                device.add(e.pid)
            elif e.ph not in FLOW_PH:
                host.add(e.pid)
    flow_ends: dict[Any, set[str]] = {}
    for e in timed:
        if e.ph in FLOW_PH:
            flow_ends.setdefault(tuple(None if v is unset else v for v in (e.cat, e.name, e.id)), set()).add(e.ph)
    ts = list(map(attrgetter("ts"), timed))
    durs = [0 if d is unset else d for d in map(attrgetter("dur"), timed)]
    start, dur = (to_ns_array(np.array(v, dtype=np.float64)) for v in (ts, durs))
    for i in [i for i, t in enumerate(ts) if type(t) is int and not -2**53 < t < 2**53]:  # beyond a float's ints
        start[i] = to_ns(ts[i])
    end = start + dur
    return _figures(len(events), cats, host, device, strings, flow_ends,
                    (int(start.min()), int(end.max())) if len(timed) else (None, None), base)


def _args(raw: Any) -> Any:
    """An ``args`` raw text as JSON (None when absent or not JSON)."""
    try:
        return None if raw is msgspec.UNSET else orjson.loads(bytes(raw))
    except orjson.JSONDecodeError:
        return None


@retry_unreachable
def _describe_ranks(files: list[InputFile], storage_options: Mapping[str, Any] | None, repair: bool,
                    on_error: str) -> list[Any]:
    """Task: describe several small files (or one big one); with ``on_error="skip"``, a bad file gives why
    (``{rank, path, reason}``), as in merge."""
    out: list[Any] = []
    with paused_gc():
        for f in files:
            try:
                out.append(_describe(f, storage_options, repair))
            except SKIPPABLE as e:
                out.append(skipped_rank(e, f.rank_hint, f.path, on_error))
    return out


def describe_traces(
    urlpath: str | Iterable[str] | Mapping[int, str],
    *,
    storage_options: Mapping[str, Any] | None = None,
    rank_regex: str = DEFAULT_RANK_REGEX,
    client: Any = None,
    workers: int | None = None,
    scheduler: str | None = None,
    scheduler_file: str | None = None,
    timeout: float = 10.0,
    on_error: str = "raise",
    repair: bool = False,
) -> dict[str, Any]:
    """Describe trace files without rewriting or writing anything.

    A merged trace that tracefuse wrote, named on its own, is described rank by rank
    (its ranks told apart by the pid layout, with their sources); in a folder it is
    ignored, as ``merge`` ignores it. An event store (``tracefuse index``), named on its own, is described as the
    traces it was indexed from, from its manifest, without reading them.

    Parameters
    ----------
    on_error, repair
        As in ``merge_traces``: ``"skip"`` goes on without the ranks whose file is bad, missing or unreadable
        and lists them in ``skipped``; ``repair`` recovers the complete events of truncated files and says so in
        ``repaired``.

    Returns
    -------
    dict
        ``files``, ``ranks``, ``world_size``, ``bytes``, ``events``, ``categories``,
        ``start_ns``/``end_ns``/``span_ms`` over all ranks, ``ignored`` (files that are not per-rank traces),
        ``skipped`` (bad ranks: rank, path, reason), ``repaired`` and ``per_rank``.
    """
    if on_error not in ("raise", "skip"):
        raise MergeError(f"on_error={on_error!r}; use 'raise' or 'skip'")
    from .store import store_url

    if (url := store_url(urlpath, storage_options)) is not None:
        return _describe_store(url, storage_options)
    files, unlisted = expand_inputs(urlpath, storage_options=storage_options, rank_regex=rank_regex)
    ignored = [f"{p}: not a JSON trace by name, or written by tracefuse" for p in unlisted]
    so = dict(storage_options or {})
    with connect(client, scheduler=scheduler, scheduler_file=scheduler_file, workers=workers,
                 timeout=timeout, inputs=files) as c:
        groups = [[files[i] for i in b] for b in batches([f.trace_bytes for f in files])]
        described = [d for group in c.gather(c.map(_describe_ranks, groups, storage_options=so, repair=repair,
                                                   on_error=on_error, pure=False))
                     for d in group]
    ignored += [d for d in described if isinstance(d, str)]
    skipped = [d for d in described if isinstance(d, dict)]
    kept = [(f, d) for f, d in zip(files, described) if isinstance(d, tuple)]
    if skipped and not kept:
        raise every_rank_failed(skipped)
    return _report([row for _, (_, rows, _) in kept for row in rows], len(kept), sum(f.size or 0 for f, _ in kept),
                   sum(nbytes for _, (nbytes, _, _) in kept), ignored, skipped,
                   [note for _, (_, _, note) in kept if note])


def _describe_store(url: str, storage_options: Mapping[str, Any] | None) -> dict[str, Any]:
    """``describe_traces`` of the traces an event store was indexed from, from the figures its manifest keeps of
    each (``store.index``), and what its index ignored and skipped."""
    from .store.query import open_store

    manifest = open_store(url, storage_options).manifest
    sizes = {i.get("path"): i.get("size") for i in manifest.get("made_from", {}).get("inputs", [])
             if isinstance(i, dict)}
    rows = [{"rank": r["rank"], "path": r["file"], "bytes": sizes.get(r["file"]), "bytes_uncompressed": r["bytes_in"],
             **{k: v for k, v in r["info"].items() if k != "repaired"}} for r in manifest["ranks"]]
    return _report(rows, len(rows), sum(r["bytes"] or 0 for r in rows), sum(r["bytes_in"] for r in manifest["ranks"]),
                   list(manifest.get("ignored", [])), list(manifest.get("skipped", [])),
                   [n for r in manifest["ranks"] if (n := r["info"].get("repaired"))])


def _report(per_rank: list[dict[str, Any]], files: int, size: int, nbytes: int, ignored: list[str],
            skipped: list[dict[str, Any]], repaired: list[str]) -> dict[str, Any]:
    """``describe_traces``'s report of the ranks' rows (``per_rank``, each a rank of one of ``files`` files of
    ``size`` bytes, ``nbytes`` uncompressed), with totals over them."""
    per_rank.sort(key=lambda r: (r["rank"] is None, r["rank"] if r["rank"] is not None else 0, r["path"]))
    cats: Counter[str] = Counter()
    for r in per_rank:
        cats.update(r["categories"])
    starts = [r["start_ns"] for r in per_rank if r["start_ns"] is not None]
    ends = [r["end_ns"] for r in per_rank if r["end_ns"] is not None]
    sizes = sorted({r["world_size"] for r in per_rank if r["world_size"] is not None})
    traces = [r for r in per_rank if "source" not in r]  # per-rank traces, not ranks of a merged one
    ranks = [r["rank"] for r in traces]
    # a merge of these traces: one per rank, each with an account (a trace the merge refuses has none)
    account = job_account({str(r["rank"]): r["account"] for r in traces}) if traces and None not in ranks \
        and len(set(ranks)) == len(ranks) and all(r.get("account") for r in traces) else None
    return {
        "files": files,
        "ranks": [r["rank"] for r in per_rank],
        "world_size": sizes[0] if len(sizes) == 1 else sizes or None,
        "bytes": size,
        "bytes_uncompressed": nbytes,
        "events": sum(r["events"] for r in per_rank),
        "categories": dict(sorted(cats.items())),
        "start_ns": min(starts, default=None),
        "end_ns": max(ends, default=None),
        "span_ms": (max(ends) - min(starts)) / 1e6 if starts and ends else None,
        "ignored": ignored,
        "skipped": skipped,
        "repaired": repaired,
        # a default merge's account of the per-rank traces; None where that merge would refuse them (a rank read
        # twice or not at all, an event it refuses), and for a merged trace or a store
        "account": account,
        "per_rank": per_rank,
    }


def format_table(report: dict[str, Any]) -> str:
    """A human-readable table of ``describe_traces``'s report."""
    lines = [
        f"{report['files']:,} file{'' if report['files'] == 1 else 's'}, ranks {report['ranks']}, world size {report['world_size']}, "
        f"{report['bytes'] / 1e6:,.1f} MB ({report['bytes_uncompressed'] / 1e6:,.1f} MB uncompressed), "
        f"{report['events']:,} events, span {report['span_ms'] or 0:,.3f} ms",
        "",
        f"{'rank':>5} {'MB':>8} {'events':>9} {'base time (ns)':>20} {'span ms':>10} {'host pids':>10} "
        f"{'gpu pids':>8} {'flows':>6} {'unpaired':>8}  path",
    ]
    for r in report["per_rank"]:
        span = (r["end_ns"] - r["start_ns"]) / 1e6 if r["start_ns"] is not None else 0.0
        size = "-" if r["bytes"] is None else f"{r['bytes'] / 1e6:.2f}"
        path = f"{r['path']} (from {r['source']})" if r.get("source") else r["path"]
        lines.append(
            f"{'?' if r['rank'] is None else r['rank']:>5} {size:>8} {r['events']:>9,} "
            f"{r['base_time_ns'] if r['base_time_ns'] is not None else '-':>20} {span:>10.3f} "
            f"{len(r['pids']['host']):>10} {len(r['pids']['device']):>8} {r['flows']['ids']:>6} "
            f"{r['flows']['unpaired']:>8}  {path}"
        )
    lines.append("")
    lines.append("events per category: " + ", ".join(f"{k} {v:,}" for k, v in report["categories"].items()))
    if report["account"]:
        a = report["account"]
        lines.append(f"a merge with the default options keeps {a['kept']:,} of the {a['read']:,} events of the "
                     f"per-rank traces ({a['on_lanes']:,} slices on lanes); --json gives the reasons")
        lines += [anomaly_line(k, v) for k, v in a["anomalies"].items()]
        lines += [repair_line(a["repaired"])] if a.get("repaired") else []
    lines += [f"ignored {path}" for path in report["ignored"]]
    lines += [f"skipped rank {sk['rank']}: {sk['reason']}" for sk in report["skipped"]]
    lines += [f"warning: {note}" for note in report["repaired"]]
    return "\n".join(lines)
