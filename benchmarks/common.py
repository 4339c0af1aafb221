"""What every benchmark in this folder shares: timing and memory, the table, the datasets, the orjson floor.

Not a script: ``merge.py``, ``s3.py``, ``analyze.py``, ``scale.py`` and ``scaling.py`` import it from beside
them (``python benchmarks/<name>.py`` puts this folder on ``sys.path``, and the embedded cluster's workers get
that path too).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import gzip
import json
import math
import os
import platform
import re
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import orjson
import psutil

from tracefuse_dask.synth import make_rank_trace

MB = 1_000_000
HERE = os.path.dirname(os.path.abspath(__file__))
SHARED = os.path.join(os.path.dirname(os.path.dirname(HERE)), "shared")  # ../shared beside the repository
HTA_PYTHON = "/work/hta-venv/bin/python"
HTA_SETUP = ("python3 -m venv /work/hta-venv && /work/hta-venv/bin/pip install HolisticTraceAnalysis==0.5.0 "
             "pandas==2.2.3 numpy==2.2.6")


class TreeRSS:
    """Peak summed RSS of this process and all its descendants, while the ``with`` block runs.

    Processes in ``exclude`` (the storage server of the S3 case) and their children are not counted.
    The descendants are listed again every ``relist`` samples: listing them scans every process of the
    machine (2 ms of CPU), reading their RSS takes 0.05 ms each, and the sampler shares this process's GIL
    with the Dask scheduler and client.
    """

    exclude: set[int] = set()

    def __init__(self, interval: float = 0.025, relist: int = 20) -> None:
        self.interval, self.relist, self.proc = interval, relist, psutil.Process()
        self.baseline = self.peak = self.self_peak = 0
        self._stop = threading.Event()
        self._procs: list[psutil.Process] = []
        self._samples = 0

    def sample(self) -> int:
        if self._samples % self.relist == 0:
            self._procs = [self.proc, *self.proc.children(recursive=True)]
        self._samples += 1
        total = 0
        for p in self._procs:
            try:
                if self.exclude and (p.pid in self.exclude or p.ppid() in self.exclude):
                    continue
                rss = p.memory_info().rss
                total += rss
                if p is self.proc:
                    self.self_peak = max(self.self_peak, rss)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
        return total

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, self.sample())

    def __enter__(self) -> TreeRSS:
        gc.collect()
        self.baseline = self.peak = self.sample()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.sample())


# ---------------------------------------------------------------------------------------------------------
# Datasets

def kineto_rank(data: bytes) -> bytes:
    """``data`` with its first ``"rank":N`` written ``"rank": N``, as Kineto writes it (orjson writes no space).

    HTA 0.5.0 finds a file's rank with the regex ``"rank":\\s+(\\d+)``; without the space it loads every
    file as rank 0 and keeps one of them.
    """
    data, n = re.subn(rb'"rank":(\d)', rb'"rank": \1', data, count=1)
    if n != 1:
        raise RuntimeError("no rank to rewrite")
    return data


def _write_rank(args: tuple[int, int, int, str]) -> int:
    rank, ranks, rank_bytes, path = args
    data = kineto_rank(orjson.dumps(make_rank_trace(rank, ranks, target_bytes=rank_bytes, seed=0)))
    with open(path, "wb") as f:
        f.write(data)
    return len(data)


def make_synthetic(pool: Any, root: str, ranks: int, rank_mb: float) -> tuple[str, list[str], int]:
    """``ranks`` generated ranks (``tracefuse_dask.synth``) of ``rank_mb`` MB as plain ``.json`` files in a new
    folder under ``root``; (folder, paths, bytes)."""
    folder = os.path.join(root, f"in_{ranks}x{rank_mb:g}MB")
    os.makedirs(folder)
    paths = [os.path.join(folder, f"rank{r}.pt.trace.json") for r in range(ranks)]
    sizes = pool.map(_write_rank, [(r, ranks, int(rank_mb * MB), p) for r, p in enumerate(paths)], chunksize=1)
    return folder, paths, sum(sizes)


MAKE_DATASET = os.path.join(SHARED, "tools", "make_dataset.py")
# name -> (the one real trace its ranks are built from, under ../shared/traces/real, what it exercises)
REAL_SHAPES = {
    "a100": ("hta_trace_filter/sampled_rank-0.json.gz", "A100/NCCL, old format, no baseTimeNanoseconds"),
    "h100": ("tracelens_h100_qwen/Qwen_Qwen1.5-0.5B-Chat__1016005.json.gz",
             "H100, baseTimeNanoseconds after traceEvents, a quarter python_function"),
    "b200": ("tracelens_b200/eager_trace.json.gz", "B200, modern format, base before the events, "
             "python_function heavy"),
}


def real_source(shape: str) -> str:
    """The real trace that ``shape``'s ranks are built from."""
    return os.path.join(SHARED, "traces", "real", REAL_SHAPES[shape][0])


def check_real_shapes(shapes: list[str]) -> None:
    """Raise ``SystemExit`` with the fix when the dataset tool or a shape's source trace is missing."""
    missing = [p for p in [MAKE_DATASET, *(real_source(s) for s in shapes)] if not os.path.isfile(p)]
    if shapes and missing:
        raise SystemExit(f"error: {' and '.join(missing)} missing: the real shapes ({', '.join(shapes)}) are "
                         f"built from a trace in ../shared/traces/real by ../shared/tools/make_dataset.py, "
                         f"both beside the repository ({os.path.dirname(HERE)}); put them there, or pass "
                         f"--shapes synthetic")


def make_real(shape: str, root: str, ranks: int, rank_mb: float) -> tuple[str, list[str], int]:
    """``ranks`` ranks of about ``rank_mb`` MB as plain ``.json`` files built from a real trace by
    ``make_dataset.py`` (run as a program of its own) in a new folder under ``root``; (folder, paths, bytes)."""
    folder = os.path.join(root, f"{shape}_{ranks}x{rank_mb:g}MB")
    proc = subprocess.run([sys.executable, MAKE_DATASET, "--source", real_source(shape), "--ranks", str(ranks),
                           "--mb-per-rank", f"{rank_mb:g}", "--no-gzip", "--out", folder],
                          capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"make_dataset.py failed for {shape}:\n{proc.stderr[-3000:]}")
    paths = sorted(os.path.join(folder, n) for n in os.listdir(folder) if n.endswith(".json"))
    return folder, paths, sum(os.path.getsize(p) for p in paths)


def naive_merge(paths: list[str], out: str) -> int:
    """TraceLens TraceFuse, reduced to its cost: one process, json, one list, indent=4, gzip -9."""
    events: list[dict[str, Any]] = []
    mult = 0
    for rank, path in enumerate(paths):
        with (gzip.open if path.endswith(".gz") else open)(path, "rt") as f:
            doc = json.load(f)
        if not mult:  # from file #1 only, as TraceLens does
            top = max((e["pid"] for e in doc["traceEvents"] if type(e.get("pid")) is int), default=0)
            mult = 10 ** (math.ceil(math.log10(top + 1)) + 1)
        for e in doc["traceEvents"]:
            if type(e.get("pid")) is int:
                e["pid"] += rank * mult
            events.append(e)
    with gzip.open(out, "wt", compresslevel=9) as f:
        json.dump({"traceEvents": events}, f, indent=4)
    return os.path.getsize(out)


def chunks(f: Any, size: int = 1 << 22) -> Iterator[bytes]:
    while chunk := f.read(size):
        yield chunk


# ---------------------------------------------------------------------------------------------------------
# The floor, warm-up, child processes, HTA

def floor_task(args: tuple[str, str, bool]) -> int:
    """The floor of one rank: ``orjson.loads`` + ``orjson.dumps`` of file ``src`` into ``dst``, GC off or on."""
    src, dst, gc_off = args
    if gc_off:
        gc.disable()
    try:
        with open(src, "rb") as f:
            data = orjson.dumps(orjson.loads(f.read()))
        with open(dst, "wb") as f:
            f.write(data)
        return len(data)
    finally:
        gc.enable()


def warm(_: int = 0) -> None:
    import tracefuse_dask.merge  # noqa: F401

    time.sleep(0.2)  # holds the task so that every pool process must be up


def _child_entry(conn: Any, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    try:
        conn.send((True, fn(*args)))
    except BaseException as e:  # noqa: BLE001 - shipped to the parent
        conn.send((False, f"{type(e).__name__}: {e}"))


def in_child(ctx: Any, fn: Callable[..., Any], *args: Any) -> Any:
    """Run ``fn`` in a fresh (non-daemon) process, so its memory is freed and it may start its own pool."""
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child_entry, args=(send, fn, args))
    proc.start()
    ok, value = recv.recv()
    proc.join()
    if not ok:
        raise RuntimeError(value)
    return value


def hta_versions(python: str) -> str | None:
    """The versions of HTA and pandas in ``python``, or None when it cannot run or has no HTA."""
    code = "import importlib.metadata as m; print(m.version('HolisticTraceAnalysis'), m.version('pandas'))"
    try:
        proc = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60)
    except OSError:
        return None
    if proc.returncode:
        return None
    hta, pandas = proc.stdout.split()
    return f"HolisticTraceAnalysis {hta}, pandas {pandas}"


def run_hta(python: str, folder: str, ranks: int | None = None, files: dict[int, str] | None = None,
            run: Callable[..., subprocess.CompletedProcess] = subprocess.run) -> dict[str, Any]:
    """``hta_breakdown.py`` on ``folder`` in a fresh process of ``python``, started by ``run`` (``subprocess.run``'s
    arguments; ``TimedProcess`` times it whole); its JSON report.

    With ``ranks``, it is an error when HTA did not load that many ranks; with ``files`` (``{rank: file}``), HTA
    loads those files as those ranks.
    """
    extra = [json.dumps({str(r): p for r, p in files.items()})] if files else []
    proc = run([python, os.path.join(HERE, "hta_breakdown.py"), folder, *extra], capture_output=True,
               text=True, env={**os.environ, "HTA_DISABLE_NS_ROUNDING": "1"})
    if proc.returncode:
        last = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
        raise RuntimeError(f"hta_breakdown.py: {last}")
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    if ranks is not None and len(report["ranks"]) != ranks:
        raise RuntimeError(f"HTA loaded {len(report['ranks'])} of the {ranks} ranks of {folder}")
    return report


# ---------------------------------------------------------------------------------------------------------
# Measuring

class TimedProcess:
    """``subprocess.run`` timed as a user's command is, from its start to its exit: ``seconds`` (wall), ``cpu``
    (the CPU seconds of the process and of the children it waited for, such as worker programs and fork pools:
    ``RUSAGE_CHILDREN``) and ``mem`` (``TreeRSS`` of this process's tree while it ran; its ``peak - baseline`` is the
    command's)."""

    seconds = cpu = 0.0
    mem: TreeRSS

    def __call__(self, *args: Any, **kwargs: Any) -> subprocess.CompletedProcess:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        with TreeRSS() as self.mem:
            t = time.perf_counter()
            proc = subprocess.run(*args, **kwargs)
            self.seconds = time.perf_counter() - t
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        self.cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
        return proc


Measured = tuple[list[float], TreeRSS, Any]


def measure(fns: list[Callable[[], Any]], repeat: int = 1,
            before: Callable[[], None] = lambda: None) -> list[Measured | Exception]:
    """Each function's times, one per round of ``repeat``, and the memory of its run with the highest peak;
    or the exception of its first failure (it is not run again).

    The rounds run every function once in turn, so that a machine that speeds up or
    slows down during the run does not favour one row over another, and two rows' times
    of one round can be compared (``paired``). Before each run,
    untimed, ``before`` runs (it removes earlier outputs, so that every run writes new
    files) and the page cache is written back (``os.sync``), so that no run pays for an
    earlier one's writes.
    """
    times: list[list[float]] = [[] for _ in fns]
    mems: list[TreeRSS | None] = [None] * len(fns)
    results: list[Any] = [None] * len(fns)
    errors: list[Exception | None] = [None] * len(fns)
    for _ in range(repeat):
        for i, fn in enumerate(fns):
            if errors[i] is not None:
                continue
            before()
            os.sync()
            try:
                with TreeRSS() as mem:
                    t = time.perf_counter()
                    results[i] = fn()
                    times[i].append(time.perf_counter() - t)
            except Exception as e:
                errors[i] = e
                continue
            worst = mems[i]
            if worst is None or mem.peak - mem.baseline > worst.peak - worst.baseline:
                mems[i] = mem
    return [e if e is not None else (t, m, r) for t, m, r, e in zip(times, mems, results, errors)]


def measure_one(fn: Callable[[], Any], repeat: int = 1) -> tuple[float, TreeRSS, Any]:
    """``measure`` of one function, with its best time; its failure is raised."""
    got = measure([fn], repeat)[0]
    if isinstance(got, Exception):
        raise got
    return min(got[0]), got[1], got[2]


def round_ratios(base: list[float], other: list[float]) -> list[float]:
    """How many times faster ``other`` ran than ``base`` in each round; best against best (one ratio) when
    ``other`` is ``base``, ran once, or ran a different number of rounds."""
    if other is base or len(other) != len(base) or len(other) < 2:
        return [min(base) / min(other)]
    return [b / o for b, o in zip(base, other)]


def paired(base: list[float], other: list[float]) -> str:
    """How many times faster ``other`` ran than ``base``: the median of the rounds' ratios and their range.

    Times of one round ran one after the other, so a slow or fast spell of the machine
    that spans the round cancels out in its ratio. A single run (``other`` of one round)
    is compared with ``base``'s best.
    """
    ratios = round_ratios(base, other)
    if len(ratios) == 1:
        return f"{ratios[0]:.2f}×"
    return f"{statistics.median(ratios):.2f}× ({min(ratios):.2f}-{max(ratios):.2f})"


def fmt_row(name: str, dataset: str, bytes_in: int, times: list[float] | None, mem: TreeRSS | None,
            floors: dict[str, list[float]], out_bytes: int | None, note: str = "") -> str:
    if times is None or mem is None:
        return f"| {name} | {dataset} | – | – | – | – | – | – | – | {note} |"
    seconds = min(times)
    ratio = [paired(floors[k], times) if k in floors else "–" for k in ("gc_on", "gc_off")]
    return (f"| {name} | {dataset} | {seconds:.2f} | {bytes_in / MB / seconds:.1f} | {ratio[0]} | {ratio[1]} | "
            f"{(mem.peak - mem.baseline) / 2**20:,.0f} | {mem.peak / 2**20:,.0f} | "
            f"{'–' if out_bytes is None else f'{out_bytes / MB:.1f}'} | {note} |")


@dataclasses.dataclass
class Row:
    """One row of ``Table.rows``: what to run, and how to read its output size and note from its result."""

    label: str
    fn: Callable[[], Any]
    out_bytes: Callable[[Any], int | None] = lambda r: None  # None: the row writes no output
    note: Callable[[Any], str] = lambda r: ""
    floor: str | None = None  # the key its time is kept under, to compare the other rows with


class Table:
    """The Markdown rows of one run; each row is printed as soon as it is measured."""

    COLUMNS = ["row", "dataset", "s", "MB/s", "speed vs floor GC on", "speed vs floor GC off", "Δ peak RSS MiB",
               "peak RSS MiB", "out MB", "note"]

    def __init__(self, columns: list[str] | None = None) -> None:
        columns = columns or self.COLUMNS
        self.lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]

    def emit(self, line: str) -> None:
        self.lines.append(line)
        print(line, flush=True)

    def row(self, label: str, dataset: str, size: int, floors: dict[str, list[float]], fn: Callable[[], Any],
            repeat: int = 1, out_bytes: Callable[[Any], int | None] = lambda r: None,
            note: Callable[[Any], str] = lambda r: "", floor: str | None = None) -> None:
        """Measure ``fn`` and add its row (as ``floors[floor]`` too); a failure becomes a FAILED row."""
        self.rows(dataset, size, floors, [Row(label, fn, out_bytes, note, floor)], repeat)

    def rows(self, dataset: str, size: int, floors: dict[str, list[float]], rows: list[Row], repeat: int = 1,
             before: Callable[[], None] = lambda: None) -> list[Measured | Exception]:
        """Measure ``rows`` side by side (``measure``) and add them; a failed row becomes a FAILED row.
        Returns what ``measure`` did."""
        measured = measure([r.fn for r in rows], repeat, before)
        for r, got in zip(rows, measured):
            if r.floor and not isinstance(got, Exception):
                floors[r.floor] = got[0]
        for r, got in zip(rows, measured):
            if isinstance(got, Exception):
                traceback.print_exception(got)
                self.emit(fmt_row(r.label, dataset, size, None, None, floors, None,
                                  f"FAILED: {type(got).__name__}: {got}"))
            else:
                times, mem, result = got
                self.emit(fmt_row(r.label, dataset, size, times, mem, floors, r.out_bytes(result), r.note(result)))
        return measured


# ---------------------------------------------------------------------------------------------------------
# Command line, report and clean-up

def at_least_one(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text} is not at least 1")
    return n


def parser(doc: str | None) -> argparse.ArgumentParser:
    """A benchmark's argument parser, with ``doc`` as its help and the options every benchmark has."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="also write the Markdown report to this file")
    ap.add_argument("--tmp-dir", help="where to put the datasets and outputs (default: the system temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the datasets and outputs")
    return ap


def make_root(prefix: str, tmp_dir: str | None) -> str:
    """A new folder for the datasets and outputs of one run, in ``tmp_dir`` (made if missing)."""
    if tmp_dir:
        os.makedirs(tmp_dir, exist_ok=True)
    return tempfile.mkdtemp(prefix=prefix, dir=tmp_dir)


def write_report(path: str | None, lines: list[str]) -> None:
    if path:
        with open(path, "w") as f:
            f.write("\n".join(lines) + "\n")


def empty(folder: str) -> None:
    """Remove everything in ``folder``."""
    for entry in os.scandir(folder):
        shutil.rmtree(entry.path) if entry.is_dir() else os.remove(entry.path)


def baseline_main(doc: str | None, script: str, prefix: str, columns: list[str], defaults: dict[str, Any],
                  child_args: Callable[[str, list[str], str], list[str]],
                  extra: Callable[[dict[str, Any]], list[str]] | None = None) -> None:
    """The ``main`` of a benchmark of this checkout against a commit before a change: per shape, ``--ranks`` ranks
    of ``--rank-mb`` MB (``make_real``), ``script --child`` run on them (``child_args(folder, paths, root)``) at
    both checkouts, alternating (``against_baseline``), and a row per checkout: the shape, the checkout, the files
    and their MB, the best run's seconds, the speed against the baseline (``paired``), and ``extra``'s cells of
    the best run. ``defaults``: ``shapes``, ``ranks``, ``repeat``, ``baseline`` and its ``why``."""
    ap = parser(doc)
    ap.add_argument("--shapes", default=defaults["shapes"])
    ap.add_argument("--ranks", type=int, default=defaults["ranks"])
    ap.add_argument("--rank-mb", type=float, default=50)
    ap.add_argument("--repeat", type=int, default=defaults["repeat"])
    ap.add_argument("--baseline", default=defaults["baseline"],
                    help=f"the commit before the change (default: {defaults['why']})")
    args = ap.parse_args()
    shapes = [s for s in args.shapes.split(",") if s]
    check_real_shapes(shapes)
    root = make_root(prefix, args.tmp_dir)
    lines = [environment(), "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    print("\n".join(lines), flush=True)
    try:
        for shape in shapes:
            folder, paths, size = make_real(shape, root, args.ranks, args.rank_mb)
            runs = against_baseline(script, root, args.baseline, args.repeat, child_args(folder, paths, root))
            base = [r["seconds"] for r in runs[f"baseline {args.baseline}"]]
            for name, got in runs.items():
                best = min(got, key=lambda r: r["seconds"])
                cells = [shape, name, str(len(paths)), f"{size / 1e6:.0f}", f"{best['seconds']:.2f}",
                         paired(base, [r["seconds"] for r in got]), *(extra(best) if extra else [])]
                lines.append("| " + " | ".join(cells) + " |")
                print(lines[-1], flush=True)
    finally:
        cleanup(root, args.keep)
    write_report(args.out, lines)


def against_baseline(script: str, root: str, baseline: str, repeat: int,
                     args: list[str]) -> dict[str, list[dict[str, Any]]]:
    """Run ``script --child ARGS`` ``repeat`` times at the commit ``baseline`` (a temporary ``git worktree`` under
    ``root``) and at this checkout, alternating, each run a process of its own with ``PYTHONPATH`` on its checkout;
    each run's last line of output, as JSON, by side (``"baseline <commit>"``, then ``"this checkout"``)."""
    repo = os.path.dirname(HERE)
    base_dir = os.path.join(root, "baseline")
    subprocess.run(["git", "-C", repo, "worktree", "add", "--detach", base_dir, baseline], check=True,
                   capture_output=True)
    try:
        for checkout in (base_dir, repo):  # bytecode on both sides, as scripts/test.sh leaves it in this one
            subprocess.run([sys.executable, "-m", "compileall", "-q", os.path.join(checkout, "tracefuse_dask")],
                           check=True, capture_output=True)
        sides = {f"baseline {baseline}": base_dir, "this checkout": repo}
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in sides}
        for _ in range(repeat):
            for name, checkout in sides.items():
                done = subprocess.run([sys.executable, os.path.abspath(script), "--child", *args],
                                      env={**os.environ, "PYTHONPATH": checkout}, capture_output=True, text=True,
                                      check=False)
                if done.returncode:
                    raise RuntimeError(f"{checkout}: {done.stderr[-2000:]}")
                runs[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
        return runs
    finally:
        subprocess.run(["git", "-C", repo, "worktree", "remove", "--force", base_dir], check=False,
                       capture_output=True)


def cleanup(root: str, keep: bool) -> None:
    """Keep the datasets and outputs (and say where) or remove them."""
    if keep:
        print(f"kept {root}", file=sys.stderr)
    else:
        shutil.rmtree(root, ignore_errors=True)


def environment() -> str:
    """The report's first lines: date, machine, versions and the command."""
    import dask
    import distributed

    from tracefuse_dask import __version__

    return (f"Benchmark {datetime.datetime.now().isoformat(timespec='seconds')} · {platform.platform()} · "
            f"{os.cpu_count()} CPUs · {psutil.virtual_memory().total / 2**30:.0f} GiB · Python "
            f"{platform.python_version()} · tracefuse_dask {__version__}, dask {dask.__version__}, "
            f"distributed {distributed.__version__}, orjson {orjson.__version__}\n\n"
            f"Command: `{shlex.join([sys.executable, *sys.argv])}`\n\n")
