"""What a rank's events show that its user should know (``ANOMALIES``), counted alike by the merge
(``merge.anomalies.rank_anomalies``, over the events it keeps) and the analysis (``analysis.per_rank.account``,
over the slices it analyses)."""
from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

__all__ = ["ANOMALIES", "LABELS", "WINDOW", "count_anomalies"]

ANOMALIES = {  # why each matters; in the accounts' order
    "negative_dur": "no viewer can draw them, so they are left out: the profiler's clock stepped back, or the file "
                    "was edited",
    "outside_window": "they start before the profiler's 'Iteration Start: PyTorch Profiler' mark or end after its "
                      "'Record Window End' mark",
    "gpu_before_launch": "each starts before the call that launched it: the host's and the device's clocks disagree",
    "steps_without_gpu": "a ProfilerStep#N that launched no kernel, memcpy or memset, in a rank that has some",
}

LABELS = {"negative_dur": "slices with a negative duration", "outside_window": "slices outside the profiler's window",
          "gpu_before_launch": "device slices before their launch", "steps_without_gpu": "steps without device work"}
"""Each anomaly in a few words, for one-line messages."""

WINDOW = ("Iteration Start: PyTorch Profiler", "Record Window End")
"""The instant events that mark where the profiler's window opens and closes."""


def count_anomalies(start: np.ndarray, end: np.ndarray, opens: Iterable[int], closes: Iterable[int],
                    launched_at: np.ndarray, device_start: np.ndarray, steps: Iterable[tuple[int, int]],
                    negative_dur: int = 0) -> dict[str, int]:
    """``ANOMALIES``' counts, those above 0 only.

    ``start``, ``end``: every slice, in ns; ``opens``, ``closes``: the times of the ``WINDOW`` marks; ``launched_at``
    and ``device_start``: for each piece of device work that a launch links to, the launch's start and its own;
    ``steps``: each ``ProfilerStep#N``'s ``[start, end)``; ``negative_dur``: the slices left out for their
    duration. A rank where no launch links device work says nothing of its steps.
    """
    import numpy as np  # here: the command line reads ``ANOMALIES`` before its head start, which needs no numpy

    opens, closes = list(opens), list(closes)
    outside = int(((start < min(opens)) | (end > max(closes))).sum()) if opens and closes else 0
    idle = 0
    if len(launched_at):
        at = np.sort(launched_at)
        idle = sum(1 for lo, hi in steps if np.searchsorted(at, lo) == np.searchsorted(at, hi))
    counts = {"negative_dur": negative_dur, "outside_window": outside,
              "gpu_before_launch": int((device_start < launched_at).sum()), "steps_without_gpu": idle}
    return {k: n for k, n in counts.items() if n}
