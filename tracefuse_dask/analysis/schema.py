"""What crosses a boundary between the phases of ``tracefuse analyze``: the per-rank map, the cross-rank reduce,
the diff and the report. Types and the names of tables, columns, kinds and labels; no code of a phase.

- ``RankTables``: what one rank's map task gives (``per_rank``), which ``tasks`` and ``transport`` carry to the
  reduce; its tables are named in ``TABLES`` (reduced by joining their rows) and ``PIECES`` (for the critical path).
- ``Analysis``: the reduced tables (``TABLES`` and ``REDUCED``) and the summary (``cross_rank``, ``reduce``), which
  ``report``, ``diff`` and the report folder (``folder``) read.
- The critical path's segment kinds and columns, which the walker writes and ``stitch`` reads; op_perf's columns;
  the diff's ``Diff`` and its item columns, which the report draws.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pandas as pd

from ..errors import MergeError
from ..kineto.vocabulary import KERNEL_CATEGORIES
from ..model import DEFAULT_RANK_REGEX

if TYPE_CHECKING:
    from ..perf.devices import Device

__all__ = ["ANCHOR_COLUMNS", "Analysis", "CATEGORIES", "CT_COLUMNS", "Cutoffs", "Diff", "EXTRAS", "GPU_KINDS",
           "ITEM_COLUMNS", "KINDS", "LABELS", "MEANS", "MIN_PATTERN_LEN", "NO_EVENT", "OP_PERF_COLUMNS", "OVER_ROOF",
           "PATH_COLUMNS", "PIECES", "REDUCED", "RankTables", "SEGMENT_COLUMNS", "SEQUENCE_COLUMNS", "TABLES",
           "WORK_COLUMNS", "WORK_KINDS", "step_name"]

TABLES = ("breakdown", "breakdown_by_step", "kernels", "kernel_categories", "ops", "kernel_launchers", "op_perf",
          "idle", "collectives", "launch_stats", "launch_worst", "queue_length", "memory_bw", "kernel_sequences")

PIECES = ("path_anchors", "path_segments", "path_work")
"""The tables a rank's task gives only for the cross-rank critical path (``per_rank.walker.rank_pieces``)."""

REDUCED = ("rank_stats", "collective_instances", "collective_waits", "collective_summary", "straggler_ranks",
           "critical_path", "collective_trace_calls", "collective_trace_summary", "collective_trace_hints",
           "op_perf_by_category", "gpu_speed")


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


@dataclass
class Analysis:
    """The reduced cross-rank tables (pandas DataFrames, each with a ``rank`` column) and the summary."""

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
    summary: dict[str, Any] = field(default_factory=dict)
    made_from: dict[str, Any] | None = field(default=None, repr=False)
    """What the analysis was made from (inputs with their size and etag or mtime, options, version), which its
    report folder's commit records for ``--skip-if-unchanged``; None when it is not known."""

    def tables(self) -> dict[str, pd.DataFrame]:
        """Every table by name, as the report folder names its files."""
        return {name: getattr(self, name) for name in (*TABLES, *REDUCED)}


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
