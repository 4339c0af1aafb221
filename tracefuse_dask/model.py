"""Plain data types shared by the IO, rewrite and merge layers; no IO here."""
from __future__ import annotations

import re
import statistics
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from decimal import Decimal, InvalidOperation
from typing import Any, Callable, Literal

from .kineto.anomalies import ANOMALIES, LABELS

__all__ = [
    "DEFAULT_RANK_REGEX",
    "KEEP_PRESETS",
    "LEFT_OUT",
    "InputFile",
    "Marks",
    "MergeOptions",
    "MergeSummary",
    "PortableFilter",
    "anomaly_line",
    "repair_line",
    "RankHeader",
    "RankResult",
    "RankSet",
    "rank_subset",
    "RankTask",
    "job_account",
    "merge_account",
    "rank_account",
    "parse_steps",
    "parse_window",
]

KEEP_PRESETS = ("gpu", "comm", "cpu")
# A rank in a file name, for files without distributedInfo.rank: rank3, rank-3, rank_3, rank[3], worker3.
DEFAULT_RANK_REGEX = r"(?:rank|worker)[\[\-_]?(?P<rank>\d+)"


@dataclass(frozen=True)
class RankSet:
    """A set of ranks written as ``A-B`` ranges, ``:S`` strides and commas: ``0-63:8,100``."""

    spec: str
    parts: tuple[tuple[int, int, int], ...]

    @classmethod
    def parse(cls, spec: str) -> RankSet:
        """Parse a rank spec; raise ``ValueError`` with the accepted syntax on a bad one."""
        parts = []
        for item in spec.split(","):
            m = re.fullmatch(r"\s*(\d+)(?:\s*-\s*(\d+))?(?:\s*:\s*(\d+))?\s*", item)
            if not m or (m.group(3) is not None and int(m.group(3)) == 0):
                raise ValueError(
                    f"bad rank spec {spec!r} at {item!r}; use A-B (inclusive), :S for a stride "
                    "and commas for a union, e.g. 0-63:8,100"
                )
            lo = int(m.group(1))
            hi = int(m.group(2)) if m.group(2) is not None else lo
            if hi < lo:
                raise ValueError(f"bad rank spec {spec!r}: {lo}-{hi} is empty; write the low rank first")
            parts.append((lo, hi, int(m.group(3) or 1)))
        return cls(spec, tuple(parts))

    @classmethod
    def of(cls, ranks: Iterable[int]) -> RankSet:
        """The set of ``ranks`` (ints ≥ 0), spelled short: runs of one stride as ``A-B:S``.

        A process group of any size has a short spelling this way (all ranks ``0-9999``,
        a data-parallel group ``3-9995:8``), so a group costs the same whatever the world size.

        >>> RankSet.of([16, 0, 1, 2, 8, 24, 5]).spec
        '0-2,5,8-24:8'
        """
        values = list(ranks)
        if not values or set(map(type, values)) != {int} or min(values) < 0:
            raise ValueError(f"a rank set needs one or more ranks, ints >= 0; got {values[:5]}")
        values = sorted(set(values))
        if len(values) > 2 and values == list(range(values[0], values[-1] + 1, step := values[1] - values[0])):
            # one run, as most groups are: checked at C speed
            return cls.parse(f"{values[0]}-{values[-1]}" + (f":{step}" if step > 1 else ""))
        items, i = [], 0
        while i < len(values):
            lo = values[i]
            step = values[i + 1] - lo if i + 1 < len(values) else 1
            j = i  # the run's last index
            while j + 1 < len(values) and values[j + 1] - values[j] == step:
                j += 1
            if j - i < (1 if step == 1 else 2):  # a pair of stride > 1 is two ranks, not a run
                items.append(str(lo))
                i += 1
                continue
            items.append(f"{lo}-{values[j]}" + (f":{step}" if step > 1 else ""))
            i = j + 1
        return cls.parse(",".join(items))

    def ranks(self) -> set[int]:
        """Every rank of the set."""
        return set().union(*(range(lo, hi + 1, step) for lo, hi, step in self.parts))

    def __contains__(self, rank: object) -> bool:
        return isinstance(rank, int) and any(
            lo <= rank <= hi and (rank - lo) % step == 0 for lo, hi, step in self.parts
        )


def rank_subset(ranks: str | Iterable[int] | None) -> RankSet | set[int] | None:
    """The ranks to keep: a spec such as ``"0-63:8,100"``, an iterable of ints, or None for all.

    Raises ``ValueError`` with the accepted syntax on a bad spec.
    """
    if ranks is None:
        return None
    return RankSet.parse(ranks) if isinstance(ranks, str) else set(ranks)


def parse_steps(spec: str) -> tuple[int, int]:
    """Parse ``A-B`` (or ``A``) into an inclusive ``(A, B)`` range of ``ProfilerStep#N``."""
    m = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", spec)
    if not m:
        raise ValueError(f"bad step range {spec!r}; use A-B (inclusive) or A, e.g. 3-5")
    lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
    if hi < lo:
        raise ValueError(f"bad step range {spec!r}: write the lower step first")
    return lo, hi


def parse_window(spec: str) -> tuple[int, int]:
    """Parse ``START_MS:END_MS`` into integer nanoseconds ``(start, end)``, exactly."""
    try:
        start, end = (Decimal(x) for x in spec.split(":"))
    except (ValueError, InvalidOperation):
        raise ValueError(f"bad window {spec!r}; use START_MS:END_MS, e.g. 0:250.5") from None
    if not (start.is_finite() and end.is_finite()) or start < 0 or end <= start:
        raise ValueError(f"bad window {spec!r}: need 0 <= START_MS < END_MS")
    return int(start * 1_000_000), int(end * 1_000_000)


GZIP_RATIO = 8  # about how many times a .gz trace's size its JSON is: Kineto's compresses 8-14x


@dataclass(frozen=True)
class InputFile:
    """One input trace before it is read: where it is and what its name or key says of its rank."""

    path: str
    size: int | None = None
    rank_hint: int | None = None
    hint_source: Literal["key", "name", "order"] | None = None
    listed: bool = False  # found by expanding a folder or glob, not named explicitly
    stamp: str | None = None  # the storage's etag, or else its mtime: changes when the file does
    part: str | None = None  # the event store's part that holds the file's rank, read instead (``store.source``)

    @property
    def identity(self) -> dict[str, Any]:
        """What a ``--skip-if-unchanged`` record keeps of the file: path, size, stamp, a rank given as a key, and the
        store part read instead (whose name hashes all it was made from)."""
        identity = {"path": self.path, "size": self.size, "stamp": self.stamp,
                    "rank": self.rank_hint if self.hint_source == "key" else None}
        return identity if self.part is None else {**identity, "part": self.part}

    @property
    def trace_bytes(self) -> int | None:
        """About how many bytes of trace the file holds: its size, a ``.gz`` file's times ``GZIP_RATIO``; None
        when unknown. What tasks are grouped (``cluster.batches``) and the embedded cluster sized by."""
        if self.size is None:
            return None
        return self.size * (GZIP_RATIO if self.path.lower().endswith(".gz") else 1)


class PortableFilter:
    """A ``filter_fn`` that travels to the workers as cloudpickle bytes and is loaded in the task that uses it.

    Dask unpickles a task's arguments as it receives the task: a function pickled by reference to a module
    the worker cannot import broke the worker's whole message, and the merge waited forever. Loaded in the
    task, the same failure is a ``MergeError`` that names the function and the fix.
    """

    def __init__(self, fn: Callable[[dict[str, Any]], bool]) -> None:
        import cloudpickle

        self.name = getattr(fn, "__qualname__", repr(fn))
        self.blob = cloudpickle.dumps(fn)
        self._fn: Callable[[dict[str, Any]], bool] | None = fn

    def __call__(self, event: dict[str, Any]) -> bool:
        fn = self._fn
        if fn is None:
            import cloudpickle

            from .errors import MergeError

            try:
                fn = self._fn = cloudpickle.loads(self.blob)
            except Exception as e:
                raise MergeError(
                    f"filter_fn {self.name} cannot be loaded in a Dask worker ({type(e).__name__}: {e}); define "
                    "it in the calling script, or make its module importable on every worker") from None
        return fn(event)

    def __getstate__(self) -> tuple[str, bytes]:
        return self.name, self.blob

    def __setstate__(self, state: tuple[str, bytes]) -> None:
        self.name, self.blob = state
        self._fn = None

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PortableFilter) and other.blob == self.blob

    def __hash__(self) -> int:
        return hash(self.blob)


@dataclass(frozen=True)
class MergeOptions:
    """What to keep and how to rewrite it; the same for every rank."""

    include_pyfunc: bool = False
    keep: frozenset[str] | None = None
    steps: tuple[int, int] | None = None
    window_ns: tuple[int, int] | None = None
    filter_fn: PortableFilter | None = None
    rewrite_ids: bool = False
    keep_empty_processes: bool = False
    annotate_rank: bool = False  # "rank" in every event's args (TraceLens's TraceFuse wrote it)
    counters: bool = False  # counter tracks of queue lengths and copy bandwidths (HTA's generate_trace_with_counters)
    keep_overlaps: bool = False  # slices that Perfetto cannot nest stay on their thread (no lanes: merge.lanes)

    def describe(self) -> dict[str, Any]:
        """The options that shape the output, for the output's metadata and the ``--skip-if-unchanged`` manifest.

        ``counters`` and ``keep_overlaps`` are listed only when asked, so that the outputs and manifests of merges
        without them stay byte for byte what they were before the options existed.
        """
        return {
            "include_pyfunc": self.include_pyfunc,
            "keep": sorted(self.keep) if self.keep else None,
            "steps": list(self.steps) if self.steps else None,
            "window_ns": list(self.window_ns) if self.window_ns else None,
            "filter_fn": self.filter_fn.name if self.filter_fn else None,
            "rewrite_ids": self.rewrite_ids,
            "keep_empty_processes": self.keep_empty_processes,
            "annotate_rank": self.annotate_rank,
            **({"counters": True} if self.counters else {}),
            **({"keep_overlaps": True} if self.keep_overlaps else {}),
        }


@dataclass
class RankHeader:
    """Phase A: what one file says about itself, read from its header where possible."""

    path: str
    rank: int | None
    world_size: int | None
    base: int | None
    header: dict[str, Any]
    is_trace: bool = True
    is_merged: bool = False
    merged_by: str = "tracefuse"  # who merged it, when ``is_merged``: "tracefuse" or "Composer"
    full_read: bool = False
    bytes_in: int = 0
    earliest_ns: int | None = None  # absolute, over all events (only when asked)
    earliest_kept_ns: int | None = None  # absolute, over kept events (only when asked)
    repair_note: str | None = None
    relative_times: bool = False  # repaired without a base, but its ts look relative to one
    # where its distributedInfo, deviceProperties and host_name lie as JSON text: (file, offset, length)
    # in a file of Phase A, so that the client never holds them
    meta: tuple[str, int, int] | None = None


@dataclass(frozen=True)
class Marks:
    """Events a merge adds to one rank's, such as ``analyze --critical-path-trace``'s; their ``ts`` are ns
    in the rank's file's frame (``ts`` × 1000), shifted as the rank's events are.

    ``flows`` are ``s``/``f`` events on the rank's own pids and tids, mapped as its events are, whose ``id`` is
    the rank's own (it becomes ``(rank << 32) | id``); ``track`` events keep their pid and tid.
    """

    flows: list[dict[str, Any]]
    track: list[dict[str, Any]]


@dataclass(frozen=True)
class RankTask:
    """Phase B: everything one rank's rewrite task needs."""

    rank: int
    path: str
    base: int
    base_out: int
    options: MergeOptions
    window_abs_ns: tuple[int, int] | None = None
    compress: bool = False
    repair: bool = False
    marks: Marks | None = None
    # with ``options.counters``: the analysis's ``analysis.per_rank.counters.counter_series``, which the API hands to the merge
    counter_series: Callable[..., tuple[Any, Any]] | None = None
    estimate_keep: bool = False  # also measure what --keep gpu,comm would write (a merge that may be too big to open)


LEFT_OUT = {  # why an event that a merge read is not in its output: the account's reasons, in its order
    "python_function": "python_function events (--include-pyfunc keeps them)",
    "negative_dur": "slices with a negative duration, which no viewer can draw (an anomaly)",
    "keep": "left out by --keep",
    "steps": "outside --steps",
    "window": "outside --window",
    "filter_fn": "left out by filter_fn",
    "flow_end_left_out": "flow events whose other end was left out",
    "process_metadata": "Kineto's process metadata, which the merge's own names and sort indices replace",
    "thread_metadata": "thread metadata given twice, of a process left with no events, or a sort index that "
                       "lanes renumber",
}


@dataclass
class RankResult:
    """What a rewrite task returns: small counts, never events."""

    rank: int
    path: str
    events_in: int
    events_out: int
    bytes_in: int
    part_bytes: int
    part_path: str  # the file of its task's partitions, which it shares with the other ranks of the task
    head: bytes = b""  # the rank's process metadata events, which go into the output's header
    warnings: list[str] = field(default_factory=list)
    on_lanes: int = 0  # slices moved to lanes (merge.lanes)
    json_bytes: int = 0  # the partition's JSON before any gzip
    left_out: dict[str, int] = field(default_factory=dict)  # events read and not written, by reason (LEFT_OUT)
    anomalies: dict[str, int] = field(default_factory=dict)  # kineto.anomalies.ANOMALIES' counts, those above 0
    repaired: bool = False  # its file was cut, and --repair recovered what it holds
    keep_bytes: int | None = None  # with estimate_keep: the JSON of what --keep gpu,comm would write of it
    step_bytes: dict[int, int] | None = None  # with estimate_keep: that of each ProfilerStep#N, without metadata


@dataclass
class MergeSummary:
    """The outcome of a merge, as printed by ``--summary-json``."""

    ranks: int
    skipped: list[dict[str, Any]]
    events_in: int
    events_out: int
    bytes_in: int
    bytes_out: int
    seconds: float
    mb_per_s: float
    output: str
    status: str
    warnings: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    rank_list: list[int] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)  # every file written: one, or the parts of --split
    on_lanes: int = 0  # slices moved to lanes, where Perfetto shows the slices that cannot nest on their thread
    account: dict[str, Any] = field(default_factory=dict)  # where every event read went (merge_account)

    def to_json(self) -> dict[str, Any]:
        """The summary as a JSON-ready dict."""
        return asdict(self)


def rank_account(read: int, written: int, left_out: Mapping[str, int], on_lanes: int,
                 anomalies: Mapping[str, int], repaired: bool = False) -> dict[str, Any]:
    """One rank's account (``merge_account``): ``kept = read - sum(left_out)``, ``added = written - kept``, and
    the anomalies (``kineto.anomalies.ANOMALIES``) its events show, those above 0; ``repaired``: its file was cut
    and ``--repair`` recovered the ``read`` events (``job_account`` estimates what was lost after the cut)."""
    kept = read - sum(left_out.values())
    return {"read": read, "kept": kept, "left_out": {k: left_out[k] for k in LEFT_OUT if left_out.get(k)},
            "on_lanes": on_lanes, "added": written - kept, "written": written,
            "anomalies": {k: anomalies[k] for k in ANOMALIES if anomalies.get(k)},
            **({"repaired": {"recovered": read}} if repaired else {})}


def merge_account(results: list[RankResult], not_read: int | None = None) -> dict[str, Any]:
    """Where every event a merge read went, in total and per rank: ``read = kept + sum(left_out)`` (reasons in
    ``LEFT_OUT``'s order, those with events only) and ``written = kept + added`` (the merge's own metadata,
    lanes' names, counters and critical-path marks); ``on_lanes`` counts the slices kept on lanes, and
    ``anomalies`` what the ranks' events show (``job_account``).
    ``not_read``: the ranks of the job that ``--ranks`` left unread (their events are not counted), when known."""
    return job_account({str(r.rank): rank_account(r.events_in, r.events_out, r.left_out, r.on_lanes, r.anomalies,
                                                  r.repaired) for r in results}, not_read)


def job_account(ranks: Mapping[str, Mapping[str, Any]], not_read: int | None = None) -> dict[str, Any]:
    """The ranks' accounts (``rank_account``) added up, with them under ``ranks``; each anomaly with its count,
    the ranks that show it and why it matters (as ``analyze``'s ``summary.json`` gives them); and where
    ``--repair`` recovered a cut rank, what it recovered and, where whole ranks give the job's usual count, about
    how many events were lost after each cut (``lost_after_cut``: their median read less its recovered; None
    where no rank is whole). It sets each repaired rank's ``lost_after_cut`` too."""
    whole = [r["read"] for r in ranks.values() if "repaired" not in r]
    usual = round(statistics.median(whole)) if whole else None
    cut = {int(q): r["repaired"] for q, r in ranks.items() if "repaired" in r}
    for got in cut.values():
        got["lost_after_cut"] = None if usual is None else max(usual - got["recovered"], 0)
    total: Counter[str] = Counter()
    odd: Counter[str] = Counter()
    for r in ranks.values():
        total.update(r["left_out"])
        odd.update(r["anomalies"])
    account = rank_account(sum(r["read"] for r in ranks.values()), sum(r["written"] for r in ranks.values()), total,
                           sum(r["on_lanes"] for r in ranks.values()), {})
    account["anomalies"] = {k: {"count": odd[k], "ranks": sorted(int(q) for q, r in ranks.items()
                                                                 if r["anomalies"].get(k)), "why": ANOMALIES[k]}
                            for k in ANOMALIES if odd[k]}
    if cut:
        lost = [got["lost_after_cut"] for got in cut.values()]
        account["repaired"] = {"ranks": sorted(cut), "recovered": sum(got["recovered"] for got in cut.values()),
                               "lost_after_cut": None if None in lost else sum(lost)}
    return {**account, **({"ranks_not_read": not_read} if not_read is not None else {}), "ranks": dict(ranks)}


def anomaly_line(name: str, anomaly: Mapping[str, Any]) -> str:
    """One of ``job_account``'s anomalies as a line of the merge's and ``info``'s output."""
    return f"anomaly: {LABELS[name]}: {anomaly['count']:,} in rank(s) {ranges(anomaly['ranks'])}: {anomaly['why']}"


def repair_line(repaired: Mapping[str, Any]) -> str:
    """What ``--repair`` recovered of the cut ranks, and about how much it lost (``job_account``'s ``repaired``)."""
    lost = repaired["lost_after_cut"]
    return (f"--repair recovered {repaired['recovered']:,} events of rank(s) {ranges(repaired['ranks'])}, "
            + ("the events after the cut are unknown (no whole rank to compare)" if lost is None else
               f"about {lost:,} lost after the cut (the whole ranks' median count less those recovered)"))


def ranges(values: list[int]) -> str:
    """Sorted ranks as a short text: ``[0, 1, 2, 5]`` is ``0-2,5`` (messages)."""
    out: list[str] = []
    start = prev = values[0]
    for v in values[1:] + [None]:  # type: ignore[list-item]
        if v is not None and v == prev + 1:
            prev = v
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if v is not None:
            start = prev = v
    return ",".join(out)
