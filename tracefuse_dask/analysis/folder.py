"""Report folders (``analyze``'s and ``diff``'s): checked before a run, written and committed whole
(``storage.folders``), and read back only through their commit."""
from __future__ import annotations

import io
import json
from collections.abc import Mapping
from typing import Any

import fsspec
import orjson
import pandas as pd

from .._version import __version__
from ..errors import MergeError, OutputExistsError
from ..storage.files import arrow_file, options_for, path_info, storage_errors
from ..storage.folders import COMMIT, Committed, commit_folder, read_committed
from ..storage.output import open_write
from ..storage.runs import run_folder
from .schema import REDUCED, TABLES, Analysis, Diff

__all__ = ["check_new", "is_report", "read_report", "unchanged_report", "write_diff", "write_folder", "write_report"]


def check_new(out_dir: str, so: Mapping[str, Any], force: bool) -> None:
    """Raise ``OutputExistsError`` when ``out_dir`` (a folder or a file) exists and ``force`` is not set."""
    with storage_errors(out_dir, so):
        fs, path = fsspec.core.url_to_fs(out_dir, **options_for(out_dir, so))
        if fs.exists(path) and not force:
            raise OutputExistsError(f"{out_dir} exists; pass {{force}} to replace it, or choose "
                                    "another name")


def write_report(analysis: Analysis, out_dir: str, storage_options: Mapping[str, Any] | None = None, *,
                 format: str = "parquet") -> None:
    """Write the report folder: a file per table, ``report.html``, ``summary.json`` and its commit (last; see
    ``storage.folders``), which records ``analysis.made_from`` for ``--skip-if-unchanged``."""
    from .report.analysis_page import render_report

    files: dict[str, bytes | pd.DataFrame] = dict(
        (f"{name}.{format}", df) for name, df in analysis.tables().items())
    files["report.html"] = render_report(analysis.tables(), analysis.summary).encode()
    files["summary.json"] = json.dumps(analysis.summary, indent=1).encode()
    write_folder(files, out_dir, storage_options, format=format, made_from=analysis.made_from)


def write_diff(diff: Diff, out_dir: str, storage_options: Mapping[str, Any] | None = None, *,
               format: str = "parquet") -> None:
    """Write ``tracefuse diff``'s folder: its tables, ``diff.html``, ``diff.json`` and its commit (last)."""
    from .report.diff_page import render_diff

    files: dict[str, bytes | pd.DataFrame] = {f"{name}.{format}": df for name, df in diff.tables.items()}
    files["diff.html"] = render_diff(diff).encode()
    files["diff.json"] = json.dumps(diff.summary, indent=1).encode()
    write_folder(files, out_dir, storage_options, format=format)


def write_folder(files: Mapping[str, bytes | pd.DataFrame], out_dir: str,
                 storage_options: Mapping[str, Any] | None = None, *, format: str = "parquet",
                 made_from: Mapping[str, Any] | None = None) -> None:
    """Write ``files`` (bytes, or tables in ``format``) into the folder ``out_dir``, in the place of whatever is
    there: the caller checked before any work that it may (``check_new``), and a run that ended meanwhile is
    replaced; of runs that commit at once, one run's whole folder stays.

    The files are written in this run's own temporary folder first (``storage.runs.run_folder``), then committed in
    the place of ``out_dir`` with ``commit.json`` last (``storage.folders.commit_folder``): a failed run leaves
    nothing behind, runs that write the same folder at once leave one run's whole folder, and readers trust only a
    committed folder.
    """
    so = dict(storage_options or {})
    data = {name: content if isinstance(content, bytes) else _table_bytes(content, format)
            for name, content in files.items()}
    with run_folder(out_dir, so) as tmp, storage_errors(out_dir, so):
        fs, path = fsspec.core.url_to_fs(out_dir, **options_for(out_dir, so))
        staged = f"{tmp}/folder"
        for name, content in data.items():
            with open_write(f"{staged}/{name}", so) as fh:
                fh.write(content)
        commit_folder(fs, fsspec.core.url_to_fs(staged, **options_for(out_dir, so))[1], path, data, made_from)


def _table_bytes(df: pd.DataFrame, format: str) -> bytes:
    if format == "csv":
        return df.to_csv(index=False).encode()
    buf = io.BytesIO()
    df.to_parquet(buf, index=False)
    return buf.getvalue()


def unchanged_report(out_dir: str, made_from: Mapping[str, Any], so: Mapping[str, Any]) -> Analysis | None:
    """The report folder ``out_dir`` read back, with ``summary["status"]`` ``"unchanged"``, when its commit shows
    it was made from ``made_from`` by this version; None when the folder must be (re)written."""
    try:
        committed = read_committed(out_dir, so)
        if committed.record.get("version") != __version__ \
                or committed.made_from != orjson.loads(orjson.dumps(made_from)):
            return None
        report = _report_in(committed)
    except MergeError:  # none, half-written, being replaced, or another tool's: written again
        return None
    report.summary["status"] = "unchanged"
    return report


def is_report(url: str, storage_options: Mapping[str, Any] | None = None) -> bool:
    """Whether ``url`` is a folder that ``analyze`` wrote, or is writing (it holds ``commit.json`` or
    ``summary.json``): ``read_report`` reads it, or says why it cannot."""
    so = dict(storage_options or {})
    with storage_errors(url, so):
        fs, path = fsspec.core.url_to_fs(url, **options_for(url, so))
        path = path.rstrip("/")
        try:
            folder = path_info(fs, path)["type"] == "directory"
        except FileNotFoundError:
            return False
        return folder and (fs.exists(f"{path}/{COMMIT}") or fs.exists(f"{path}/summary.json"))


def read_report(url: str, storage_options: Mapping[str, Any] | None = None) -> Analysis:
    """An ``analyze`` report folder read back into an ``Analysis``: its tables and ``summary.json``, each checked
    against the folder's commit.

    Raises
    ------
    MergeError
        When the folder has no commit (a run is writing it, or stopped before it finished), a file is not the one
        the commit lists (another run is replacing the folder), or it was not written by ``tracefuse analyze``, or
        by a version without the summary keys this one reads. A table it lacks reads as empty.
    """
    return _report_in(read_committed(url, storage_options))


def _report_in(folder: Committed) -> Analysis:
    """``read_report`` of a folder whose commit is read."""
    url = folder.url
    try:
        summary = json.loads(folder.read("summary.json")) if "summary.json" in folder.names else None
    except ValueError:
        summary = None
    if not isinstance(summary, dict) or summary.get("tool") != "tracefuse_dask":
        raise MergeError(f"{url}: not a report folder of tracefuse analyze (its summary.json is missing or was not "
                         "written by tracefuse analyze)")
    missing = [k for k in ("critical_path", "straggler", "steps", "ranks", "inputs") if k not in summary]
    if missing:
        raise MergeError(f"{url}: an analyze report without {', '.join(missing)} in its summary.json (tracefuse "
                         f"{summary.get('version')}); run tracefuse analyze on the traces again")
    fmt = "parquet" if "breakdown.parquet" in folder.names else "csv"
    tables = {}
    for n in (*TABLES, *REDUCED):
        name = f"{n}.{fmt}"
        if name not in folder.names:  # a table an older version did not write
            tables[n] = pd.DataFrame()
            continue
        data = folder.read(name)
        tables[n] = pd.read_parquet(arrow_file(data)) if fmt == "parquet" else pd.read_csv(io.BytesIO(data))
    return Analysis(**tables, summary=summary, made_from=folder.made_from)
