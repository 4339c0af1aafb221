"""The sentences that the CLI and ``report.html`` both say of an analysis, written once from its ``summary.json``:
the notes on how its figures were made (``notes``) and its answers (``answers``). The CLI prints each on a line of
its own (``note: …``, ``what-if: …``); the report shows the notes under its title and the answers as its first
list, each linking to the section that holds its evidence."""
from __future__ import annotations

import statistics
from dataclasses import dataclass

from ...kineto.anomalies import LABELS
from ...model import ranges
from ..schema import Summary
from .marks import path_line

__all__ = ["Answer", "answers", "notes"]


@dataclass(frozen=True)
class Answer:
    """One answer: what it answers (its summary key, or ``step_time``, ``cause``, ``what_if``, ``bound_why``), its
    sentence, ``label: text`` (``text`` alone without a label), and the key of the report's section that holds its
    evidence (``analysis_page.TITLES``)."""

    what: str
    label: str
    text: str
    section: str


def notes(s: Summary) -> list[str]:
    """How the figures were made, where the reader should know it: GPU events left out, kernels clipped, B events
    without their E, where every event read went (``account``) and the anomalies the ranks show."""
    out = []
    left_out = s.get("gpu_events_left_out") or {}
    if left_out.get("count"):
        out.append(f"{left_out['count']:,} GPU events left out: {left_out.get('why', '')}")
    clipped = s.get("kernels_clipped") or {}
    if clipped.get("count"):
        out.append(f"{clipped['count']:,} kernels clipped: {clipped.get('why', '')}")
    begin_end = s.get("begin_end") or {}
    if begin_end.get("unclosed"):
        out.append(f"{begin_end['unclosed']:,} B events without their E in rank(s) "
                   f"{ranges(begin_end.get('unclosed_ranks') or [])}: {begin_end.get('why', '')}")
    account = s.get("account")
    if account:
        out.append(f"account: {account['read']:,} events read = {account['analysed']:,} analysed"
                   + "".join(f" + {n:,} {_SHORT[k]}" for k, n in account["left_out"].items()))
        out += [f"{_SHORT[k]}: {a['count']:,} in rank(s) {ranges(a['ranks'])}: {a['why']}"
                for k, a in account["anomalies"].items()]
    return out


_SHORT = {"metadata": "metadata", "python_function": "python_function", "not_slices": "instants, counters and flows",
          "unopened_end": "E events without their B", "steps": "outside --steps",
          "not_in_store": "not in the event store", "unlaunched_gpu": "unlaunched device work", **LABELS}


def answers(s: Summary) -> list[Answer]:
    """The answers, in the order a reader asks them: the step time, the straggler (the verdict, its cause, its
    what-if), the critical path and what bounds it, a slow GPU, the launches, the roofline, and a note on the
    devices the models assumed."""
    steps = s.get("critical_path") or []
    out = []
    if steps:
        times = [p.get("host_us", p["duration_us"]) for p in steps]  # the step's period, as the diff times it
        median, slowest = statistics.median(times) / 1e3, max(times) / 1e3
        out.append(Answer("step_time", "Step time", f"median {median:,.1f} ms over {len(times):,} step(s) (slowest "
                                                    f"{slowest:,.1f} ms)", "steps"))
    straggler = s.get("straggler") or {}
    if straggler.get("evidence"):
        out.append(Answer("straggler", "", str(straggler["evidence"]), "collectives"))
    if straggler.get("cause"):
        out.append(Answer("cause", "Why", straggler["cause"]["verdict"], "path"))
    if straggler.get("what_if_text"):
        out.append(Answer("what_if", "What-if", straggler["what_if_text"], "collectives"))
    if steps:
        out.append(Answer("critical_path", "", path_line(steps), "path"))
    if s.get("bound"):
        out.append(Answer("bound", "Bound", s["bound"]["text"], "path"))
        if s["bound"]["why"]:
            out.append(Answer("bound_why", "Why both", s["bound"]["why"], "path"))
    for key, label, section in (("slow_gpu", "GPU", "efficiency"), ("launches", "Launches", "launches"),
                                ("roofline", "Roofline", "efficiency")):
        if s.get(key):
            out.append(Answer(key, label, s[key]["text"], section))
    if (s.get("devices") or {}).get("note"):
        out.append(Answer("devices", "Note", s["devices"]["note"], "efficiency"))
    return out
