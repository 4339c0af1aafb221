"""What crosses a boundary between the phases of ``tracefuse analyze``: the per-rank map, the cross-rank reduce,
the diff and the report. Types and the names of tables, columns, kinds and labels; no code of a phase.

- ``RankTables``: what one rank's map task gives (``per_rank``), which ``tasks`` and ``transport`` carry to the
  reduce; its tables are named in ``TABLES`` (reduced by joining their rows) and ``PIECES`` (for the critical path).
- ``Analysis``: the reduced tables (``TABLES`` and ``REDUCED``) and the summary (``cross_rank``, ``reduce``), which
  ``report``, ``diff`` and the report folder (``folder``) read; ``Summary`` declares the summary key by key.
- The critical path's segment kinds and columns, which the walker writes and ``stitch`` reads; op_perf's columns;
  the diff's ``Diff`` and its item columns, which the report draws.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypedDict

import pandas as pd

from ..errors import MergeError
from ..kineto.anomalies import ANOMALIES
from ..kineto.vocabulary import KERNEL_CATEGORIES
from ..model import DEFAULT_RANK_REGEX, InputFile

if TYPE_CHECKING:
    from ..perf.devices import Device

__all__ = ["ANCHOR_COLUMNS", "ANOMALIES", "Analysis", "CATEGORIES", "CT_COLUMNS", "Cutoffs", "Diff", "EXTRAS", "GPU_KINDS",
           "ITEM_COLUMNS", "KINDS", "LABELS", "LEFT_OUT", "MEANS", "MIN_PATTERN_LEN", "NO_EVENT", "OP_PERF_COLUMNS", "OVER_ROOF",
           "PATH_COLUMNS", "PIECES", "REDUCED", "RankTables", "SEGMENT_COLUMNS", "SEQUENCE_COLUMNS", "Summary",
           "TABLES", "WORK_COLUMNS", "WORK_KINDS", "step_name"]

TABLES = ("breakdown", "breakdown_by_step", "kernels", "kernel_categories", "ops", "kernel_launchers", "op_perf",
          "idle", "collectives", "launch_stats", "launch_worst", "queue_length", "memory_bw", "kernel_sequences")

PIECES = ("path_anchors", "path_segments", "path_work")
"""The tables a rank's task gives only for the cross-rank critical path (``per_rank.walker.rank_pieces``)."""

REDUCED = ("rank_stats", "collective_instances", "collective_waits", "collective_summary", "straggler_ranks",
           "critical_path", "collective_trace_calls", "collective_trace_summary", "collective_trace_hints",
           "op_perf_by_category", "gpu_speed")


LEFT_OUT = {  # per_rank.account: why an event that the analysis read is not in its tables, in the account's order
    "metadata": "metadata events: names and sort indices, not timed",
    "python_function": "python_function events, which the analysis leaves out (the ops are read instead)",
    "not_slices": "instant, counter and flow events: the analysis reads slices (X events and B/E pairs)",
    "unopened_end": "E events that closed no B: their B came before the trace began",
    "negative_dur": "slices with a negative duration, which no viewer can draw (an anomaly)",
    "steps": "events outside --steps",
    "not_in_store": "events the event store does not hold: its index's filters left them out (--keep, --steps, "
                    "--window, flows with an end left out)",
    "unlaunched_gpu": "device work that no call in the trace launched, left out as HTA does (--keep-unlaunched-gpu "
                      "keeps it)",
}


@dataclass
class RankTables:
    """What one rank's task returns: small tables, and the numbers ``summary.json`` holds."""

    rank: int
    path: str
    tables: dict[str, pd.DataFrame]
    numbers: dict[str, Any]
    steps: list[int]
    host: str | None = None
    pg_config: dict[str, str] = field(default_factory=dict)  # pg_name: rank spec (``group_spec``)
    base: int = 0  # the file's ``baseTimeNanoseconds``
    texts: list[str] = field(default_factory=list)  # what the codes of path_segments and path_work stand for
    begin_end: tuple[int, int, int] = (0, 0, 0)  # B/E pairs, B left open, E that closed nothing (``durations``)
    # the device table's name for the rank's GPU (None: unknown), the trace's, and how many GPUs the node has
    device: tuple[str | None, str, int] = (None, "", 0)
    account: dict[str, Any] = field(default_factory=dict)  # where its events went (``per_rank.account``)


@dataclass
class Analysis:
    """The reduced cross-rank tables (pandas DataFrames, each with a ``rank`` column) and the summary
    (``summary.json``, a dict shaped as ``Summary`` declares)."""

    breakdown: pd.DataFrame
    breakdown_by_step: pd.DataFrame
    kernels: pd.DataFrame
    kernel_categories: pd.DataFrame
    ops: pd.DataFrame
    kernel_launchers: pd.DataFrame
    op_perf: pd.DataFrame
    idle: pd.DataFrame
    collectives: pd.DataFrame
    launch_stats: pd.DataFrame
    launch_worst: pd.DataFrame
    queue_length: pd.DataFrame
    memory_bw: pd.DataFrame
    kernel_sequences: pd.DataFrame
    rank_stats: pd.DataFrame
    collective_instances: pd.DataFrame
    collective_waits: pd.DataFrame
    collective_summary: pd.DataFrame
    straggler_ranks: pd.DataFrame
    critical_path: pd.DataFrame
    collective_trace_calls: pd.DataFrame
    collective_trace_summary: pd.DataFrame
    collective_trace_hints: pd.DataFrame
    op_perf_by_category: pd.DataFrame
    gpu_speed: pd.DataFrame
    summary: Summary = field(default_factory=dict)  # type: ignore[assignment]
    made_from: dict[str, Any] | None = field(default=None, repr=False)
    """What the analysis was made from (inputs with their size and etag or mtime, options, version), which its
    report folder's commit records for ``--skip-if-unchanged``; None when it is not known."""

    def tables(self) -> dict[str, pd.DataFrame]:
        """Every table by name, as the report folder names its files."""
        return {name: getattr(self, name) for name in (*TABLES, *REDUCED)}


# ``summary.json``: what the reduce says of a whole job (``reduce.reduce_ranks``), which the CLI, the report and the
# diff read. It stays the dict that ``Analysis.summary`` hands to users (who index it and dump it as JSON): its
# shape is declared here, key by key, and ``tests/test_analysis.py`` holds real summaries to it.

class Counted(TypedDict):
    """How many of something, and why it matters (``gpu_events_left_out``, ``kernels_clipped``)."""

    count: int
    why: str


class BeginEnd(TypedDict):
    """B/E duration events: pairs matched, B events left open (and their ranks), E events that closed nothing."""

    pairs: int
    unclosed: int
    unclosed_ranks: list[int]
    unopened: int
    why: str


class Devices(TypedDict):
    """The device each rank ran on, as the device table names it, the ranks of devices it lacks, and a note."""

    ranks: dict[str, list[int]]
    unknown: dict[str, list[int]]
    note: str | None


class _SlowGpuSaid(TypedDict):
    rank: int | None
    text: str


class SlowGpu(_SlowGpuSaid, total=False):
    """A GPU slower than the others at equal shapes (``cross_rank.efficiency.gpu_speed``), told apart from the
    straggler; ``rank`` None and ``text`` alone when there is a straggler and no slow GPU."""

    category: str
    factor: float
    groups: int
    excess_us: float
    others: list[dict[str, Any]]


class Roofline(TypedDict):
    """Per kernel category, its kernel time, share and time-weighted % of roofline; and the line that says it."""

    categories: dict[str, dict[str, float | None]]
    text: str


class Launches(TypedDict):
    """HTA's launch statistics across the job (``cross_rank.counters.launch_summary``)."""

    cutoffs: dict[str, float]
    launches: int
    short_kernels: int
    runtime_outliers: int
    launch_delay_outliers: int
    median_launch_delay_us: float
    max_queue_length: int | None
    time_full_us: float
    memory_max_gbps: dict[str, float]
    outlier_ranks: dict[str, list[int]]
    text: str


class _Sequences(TypedDict):
    operator: str
    min_pattern_len: int
    distinct: int
    top: list[dict[str, Any]]


class KernelSequences(_Sequences, total=False):
    """The most frequent kernel sequences of ``--kernel-sequences OP`` across ranks (``note`` when there are
    none)."""

    note: str


class CollectiveCounts(TypedDict):
    calls: int
    matched: int
    problems: int
    problem_examples: list[str]


class ByOp(TypedDict):
    name: str
    kind: str
    gain_us: float


class NamedRank(TypedDict):
    """A rank the what-if names: late in most steps (chronic) or a few (transient), and what fixing it saves,
    by op."""

    rank: int
    pattern: str
    late_steps: list[int]
    gain_us: float
    by_op: list[ByOp]


class WhatIfStep(TypedDict):
    """A step measured and replayed: its start, its time as measured and as predicted, and each named rank's part
    of the gain."""

    step: int
    start_ns: int
    measured_us: float
    predicted_us: float
    gain_us: float
    by_rank: dict[str, float]


class Most(TypedDict):
    rank: int
    gain_us: float


class MostInAStep(TypedDict):
    rank: int
    step: int
    gain_us: float


class WhatIf(TypedDict):
    """The job replayed with the named ranks doing the median other rank's work (``cross_rank.what_if``)."""

    ranks: list[NamedRank]
    steps: list[WhatIfStep]
    step_us: float
    what_if_step_us: float
    gain_us: float
    bar_us: float
    spread_us: float
    most: Most
    most_in_a_step: MostInAStep
    transient_us: float
    assumes: str


class CauseItem(TypedDict):
    """An op of the late rank's extra time: its class of cause, its extra time per step and its share."""

    name: str
    kind: str
    cause: str
    extra_us: float
    share: float


class Cause(TypedDict):
    """Why the straggler is late (``cross_rank.critical_path.straggler_cause``)."""

    rank: int
    compared_with: int
    collectives_late: int
    extra_us: float
    kind: str
    op: str | None
    top: list[CauseItem]
    verdict: str


class _Verdict(TypedDict):
    rank: int | None
    confidence: float
    evidence: str
    pattern: str | None
    late_steps: list[int]
    ranks: list[NamedRank]
    what_if: WhatIf | None
    what_if_step_us: float | None
    what_if_text: str | None
    cause: Cause | None


class Straggler(_Verdict, total=False):
    """The straggler verdict (``cross_rank.what_if.verdict``): from the waiting alone (``rank``, ``confidence``,
    ``evidence`` and, with matched collectives, the waiting's numbers below), and from the what-if."""

    last_count: int
    collectives: int
    wait_caused_ms: float
    share_of_wait: float
    total_wait_ms: float


class PathItem(TypedDict):
    rank: int
    kind: str
    name: str
    us: float
    share: float


class PathStep(TypedDict):
    """One step's critical path (``cross_rank.critical_path.stitch``): its span, its time by rank, kind and
    category, the blocking calls on it and its biggest items."""

    step: int
    start_us: float
    duration_us: float
    host_us: float
    path_us: float
    gpu_us: float
    by_rank: dict[str, float]
    by_kind: dict[str, float]
    by_category: dict[str, float]
    syncs: list[str]
    top: list[PathItem]


class Bound(TypedDict):
    """What bounds the slowest step (``cross_rank.critical_path.bound``)."""

    bound: str
    step: int
    gpu_share: float
    text: str
    why: str | None


class CollectiveTrace(TypedDict):
    """collective_trace's logs: files and calls read, and the straggler hint from their durations alone."""

    files: int
    calls: int
    straggler_hint: dict[str, Any]


class Anomaly(TypedDict):
    count: int
    ranks: list[int]
    why: str


class Account(TypedDict):
    """Where every event the analysis read went: ``read = analysed + sum(left_out)`` (``LEFT_OUT``'s reasons), in
    total and per rank (``ranks``: the same keys, with each anomaly's count alone)."""

    read: int
    analysed: int
    left_out: dict[str, int]
    anomalies: dict[str, Anomaly]
    ranks: dict[str, dict[str, Any]]


class Skipped(TypedDict):
    rank: int | None
    path: str
    reason: str


class _Summary(TypedDict):
    tool: str
    version: str
    inputs: list[str]
    ranks: list[int]
    steps: list[int]
    step_range: list[int] | None  # --steps A-B
    gpu: bool
    why_no_gpu: str | None
    per_rank: dict[str, dict[str, float | None]]  # each rank's breakdown numbers
    gpu_events_left_out: Counted | None  # None with --keep-unlaunched-gpu
    kernels_clipped: Counted
    begin_end: BeginEnd
    devices: Devices
    slow_gpu: SlowGpu | None
    roofline: Roofline | None
    outliers: list[str]  # rank_stats's notes
    launches: Launches | None
    kernel_sequences: KernelSequences | None
    collectives: CollectiveCounts
    straggler: Straggler
    critical_path: list[PathStep]
    bound: Bound | None
    critical_path_origin_ns: int
    base_time_ns: dict[str, int]
    collective_trace: CollectiveTrace | None
    clock_offset_us: dict[str, float]
    clock_offset_spread_us: dict[str, float]
    warnings: list[str]
    ignored: list[str]
    skipped: list[Skipped]
    repaired: list[str]


class Summary(_Summary, total=False):
    """``summary.json``, key by key: those above always, these where they apply."""

    clock_offset_by_host: dict[str, dict[str, Any]]  # with matched GPU collectives
    clock_note: str  # without them
    seconds: float  # the analysis's wall time, when it ran (not in a report read back)
    critical_path_trace: dict[str, Any]  # with --critical-path-trace
    status: str  # "unchanged": a report that --skip-if-unchanged read back instead of analysing
    account: Account  # where every event read went (a report of an older version has none)


@dataclass(frozen=True)
class Cutoffs:
    """HTA's thresholds: a runtime call over ``runtime_us``, a launch delay over ``launch_delay_us``, a stream at
    ``max_queue_length`` (CUDA's limit of outstanding work) is full."""

    runtime_us: float = 50.0
    launch_delay_us: float = 100.0
    max_queue_length: int = 1024

    def __post_init__(self) -> None:
        for name, value in (("runtime cutoff", self.runtime_us), ("launch delay cutoff", self.launch_delay_us),
                            ("max queue length", self.max_queue_length)):
            if not value > 0:
                raise MergeError(f"the {name} is {value}; give a positive number (HTA's: 50 µs, 100 µs, 1024)")



@dataclass(frozen=True)
class AnalyzeRequest:
    """The options of an analysis that its tasks and its reduce read, checked by ``run.analyze`` before any IO (as
    ``MergeRequest`` is for a merge): what travels to every task."""

    storage_options: dict[str, Any] = field(default_factory=dict)
    steps: tuple[int, int] | None = None  # only ProfilerStep#A to #B
    subset: Any = None  # the ranks to analyse (``model.rank_subset``): None for all
    rank_regex: str = DEFAULT_RANK_REGEX
    keep_unlaunched_gpu: bool = False
    devices: tuple[Device, ...] = ()  # the device table, a --gpu-spec's first
    cutoffs: Cutoffs = field(default_factory=Cutoffs)
    sequences_of: str | None = None  # the operator whose kernel sequences to find
    repair: bool = False
    on_error: str = "raise"
    read_part: Callable[..., tuple[list[Any], dict[str, Any], int, list[str], dict[str, int]]] | None = None  # StoredInput's
    write_part: Callable[..., dict[str, Any]] | None = None  # ``StoreOutput.write_part``


@dataclass(frozen=True)
class StoredInput:
    """An event store as ``analyze``'s input (``store.source.stored_input``; the analysis does not import the
    store): its ranks as the files they were indexed from, each with its ``InputFile.part``; the function that
    reads a part as the rank's events, header, base time, notes and the trace's events the part does not hold (by
    ``LEFT_OUT``'s reasons); and the inputs the index left out, and why."""

    files: list[InputFile]
    read_part: Callable[..., tuple[list[Any], dict[str, Any], int, list[str], dict[str, int]]]
    ignored: list[str]


@dataclass(frozen=True)
class StoreOutput:
    """``analyze --store``: the function each map task calls with the trace it read, to write its rank's part of
    an event store (``store.index.part_of_analysis``, the store bound), and the list the parts' manifest entries
    go to when the map is done (``store.index.analysis_store`` commits them)."""

    write_part: Callable[..., dict[str, Any]]
    parts: list[dict[str, Any]]

# The critical path: the kinds of its segments, and the columns of the walks' pieces and of the path.
# "sync wait": a stream waiting for another stream's work; "sync overhead": the part of a blocking call (a sync, a
# blocking copy) after the device work it waited for ended, the call's own time
KINDS = ("cpu_op", "kernel", "memcpy", "launch gap", "sync wait", "collective transfer", "idle", "sync overhead")

GPU_KINDS = ("kernel", "memcpy", "sync wait", "collective transfer")  # with "GPU idle": the path's time on the GPU

CATEGORIES = ("", *KERNEL_CATEGORIES)  # a segment's kernel category: "" for time not of device work

# ``at_ns``: where the walk starts (a step's: its last work's end); ``host_ns``: a step's host end (its own event's)
ANCHOR_COLUMNS = ["anchor", "key", "at_ns", "floor_ns", "stop", "stop_call", "stop_ns", "walk", "host_ns"]

# Segments and work are codes, so that they cost the task, the transfer and the reduce little: ``kind`` into
# ``KINDS`` or ``WORK_KINDS``, ``name``, ``cat``, ``pid`` and ``tid`` into the rank's texts (``RankTables.texts``:
# the name, the category, the pid or tid as JSON text, "" for none); ``walk`` is the anchor's row in its rank's
# anchors; ``event_ns`` the start of the event a segment is time of, in the file's ns (``NO_EVENT``: none).
# ``category``: a code into ``CATEGORIES``.
NO_EVENT = -(2**62)  # a segment's source, or event_ns, when it has no event
SEGMENT_COLUMNS = ["walk", "kind", "name", "start_ns", "end_ns", "pid", "tid", "event_ns", "category"]

WORK_COLUMNS = ["call", "kind", "name", "cat", "count", "ns"]

WORK_KINDS = ("interval", "cpu_op", "kernel", "memcpy", "idle")

PATH_COLUMNS = ["step", "order", "rank", "kind", "name", "start_us", "dur_us", "pid", "tid", "event_ts", "category"]

# what a joined segment's name adds to its op's (``_Walker.labels``), in the order it picks them; the last: otherwise
LABELS = (" (launch gaps)", " (kernels)", " (memcpy)", " (host dispatch)", " (host, outside ops)", " (host)")

# op_perf, per rank (``per_rank.op_perf``) and across ranks
OP_PERF_COLUMNS = ["name", "category", "input_dims", "input_types", "concrete_inputs", "context", "calls", "kernel_us",
                   "kernel", "gflop", "data_mib", "flops_per_byte", "tflops_s", "tb_s", "precision", "roof",
                   "peak_tflops", "peak_tb_s", "roof_tflops", "roofline_pct", "over_roof", "bound"]

OVER_ROOF = ("above 100% of its roof: not capped. A memory-bound op passes the DRAM roof when its operands sit in the "
             "cache (L2), or when the byte model counts tensors that a fused kernel only slices")

# per rank and name: each figure's mean over the ranks that have it (rates) in the diff's items
MEANS = ("algbw_gbps", "busbw_gbps", "tflops_s", "roofline_pct")

EXTRAS = ("count", "mean_us", "wait_us", *MEANS, "kernel")

ITEM_COLUMNS = ["what", "name", "label", "rank", "base", "new", "delta_us", "delta_pct", "significant",
                "ranks_regressed", *(f"{side}_{x}" for x in EXTRAS for side in ("base", "new"))]


@dataclass
class Diff:
    """The comparison: ``tables`` (``items``, one row per figure compared, job-wide (rank -1) and per rank;
    ``steps``, the step times of both runs; ``step_stats``, their min, median and max per run and rank) and
    ``summary`` (``diff.json``)."""

    tables: dict[str, pd.DataFrame]
    summary: dict[str, Any]

    @property
    def failed(self) -> bool:
        """Whether a regression went above ``fail_above`` (``tracefuse diff`` exits 3)."""
        return bool(self.summary["failing"])


# kernel sequences and collective_trace's calls, per rank and across ranks
MIN_PATTERN_LEN = 3  # HTA's default: the kernel sequences' shortest

SEQUENCE_COLUMNS = ["pattern", "count", "gpu_us", "cpu_us"]

CT_COLUMNS = ["rank", "kind", "op", "group", "group_size", "async_op", "bytes", "shape", "dtype", "duration_us",
              "call_count", "timestamp", "path"]


def step_name(step: Mapping[str, Any]) -> str:
    """A step as sentences name it: ``ProfilerStep#N``, or the whole trace when it has no step."""
    return "the whole trace" if step["step"] < 0 else f"ProfilerStep#{step['step']}"
