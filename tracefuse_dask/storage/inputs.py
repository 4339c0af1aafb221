"""The inputs of a job: files, folders, globs and URLs expanded to trace files, and each file's rank (the dict
key, ``distributedInfo.rank``, Composer's ``global_rank``, or its name)."""
from __future__ import annotations

import dataclasses
import posixpath
import re
from collections.abc import Container, Iterable, Mapping
from typing import Any

import fsspec

from ..errors import RankError, TraceFileNotFoundError, TraceFormatError
from ..model import DEFAULT_RANK_REGEX, InputFile
from .files import options_for, path_info, storage_errors
from .output import MANIFEST_SUFFIX, TMP_SUFFIX

__all__ = ["TRACE_NAME", "expand_inputs", "is_own_artifact", "rank_from_name", "relative_sources", "resolve_rank"]


TRACE_NAME = re.compile(r"\.json(\.gz)?$|(?<!\.tar)\.gz$", re.IGNORECASE)  # not a perfetto archive
_GLOB_CHARS = re.compile(r"[*?\[]")


def is_own_artifact(path: str) -> bool:
    """True for files tracefuse writes beside its output: manifests and temporary parts."""
    return TMP_SUFFIX in path or path.endswith(MANIFEST_SUFFIX)


def rank_from_name(path: str, rank_regex: str = DEFAULT_RANK_REGEX) -> int | None:
    """The rank written in the file's basename, or None."""
    m = re.search(rank_regex, posixpath.basename(path), re.IGNORECASE)
    if m is None:
        return None
    try:
        return int(m.group("rank"))
    except (IndexError, ValueError):
        return None


def resolve_rank(f: InputFile, header: Mapping[str, Any],
                 rank_regex: str = DEFAULT_RANK_REGEX) -> tuple[int, int | None, str | None]:
    """A file's ``(rank, world_size, note)``: the dict key, else ``distributedInfo.rank``, else Composer's
    ``global_rank``, else its name or place.

    ``note`` says when the name and the file's own rank disagree.

    Raises
    ------
    RankError
        When nothing gives the rank.
    """
    info = header.get("distributedInfo")
    info = info if isinstance(info, dict) else {}
    own, source = info.get("rank"), "distributedInfo.rank"
    if not (type(own) is int and own >= 0):
        own, source = header.get("global_rank"), "global_rank"
    own = own if type(own) is int and own >= 0 else None
    if f.hint_source == "key":
        rank = f.rank_hint
    elif own is not None:
        rank = own
    elif f.rank_hint is not None:
        rank = f.rank_hint
    else:
        raise RankError(f"{f.path}: no rank found: no distributedInfo.rank or global_rank in the file and no rank "
                        f"in its name (regex {rank_regex!r}); pass --rank-regex with a (?P<rank>...) group, "
                        "or give the files as a {rank: path} dict")
    note = None
    if f.hint_source == "name" and own is not None and own != f.rank_hint:
        note = f"{f.path}: the name says rank {f.rank_hint} but {source} is {own}; using {own}"
    ws = info.get("world_size")
    return rank, ws if type(ws) is int else None, note


def expand_inputs(
    urlpath: str | Iterable[str] | Mapping[int, str],
    *,
    storage_options: Mapping[str, Any] | None = None,
    rank_regex: str = DEFAULT_RANK_REGEX,
    names: re.Pattern[str] = TRACE_NAME,
    subset: Container[int] | None = None,
) -> tuple[list[InputFile], list[str]]:
    """Expand folders and globs into input files, with their rank hints.

    Parameters
    ----------
    urlpath
        A folder, a glob, a file, a list of those, or a ``{rank: path}`` dict.
    storage_options
        Passed to fsspec.
    rank_regex
        Regex with a named group ``rank``, applied to each basename.
    names
        The file names a folder or glob lists (default: ``*.json``, ``*.json.gz``, ``*.gz``).
    subset
        Ranks to keep: files whose dict key or name gives a rank outside it are dropped here,
        before anything is read (the others are filtered once their header is read).

    Returns
    -------
    (files, skipped)
        The input files, and the paths skipped because tracefuse wrote them or
        they are not JSON traces by name.

    Raises
    ------
    TraceFileNotFoundError
        When an item matches nothing.
    """
    if isinstance(urlpath, Mapping):
        files = []
        for rank, path in sorted(urlpath.items()):
            if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
                raise TraceFormatError(f"rank key {rank!r} for {path}: ranks must be ints >= 0")
            with storage_errors(path, storage_options):
                fs, p = _fs_for(path, storage_options)
                info = fs.info(p)
                files.append(InputFile(path, info.get("size"), rank, "key", False, _stamp(info)))
        return _in_subset(files, subset), []
    items = [urlpath] if isinstance(urlpath, str) else list(urlpath)
    if not items:
        raise TraceFileNotFoundError("no input given; pass a folder, a glob or trace files")
    files: list[InputFile] = []
    skipped: list[str] = []
    order = 0
    for item in items:
        item = str(item)
        with storage_errors(item, storage_options):
            chain, _, last = item.rpartition("::")  # list through the innermost filesystem
            fs, p = _fs_for(last, options_for(last, storage_options))
            fs.invalidate_cache()  # fsspec keeps its instances: a listing cached by an earlier run would be stale
            if _GLOB_CHARS.search(p):
                found = fs.glob(p, detail=True)
            elif (info := path_info(fs, p))["type"] == "directory":
                found = {i["name"]: i for i in fs.ls(p, detail=True)}
            else:
                found = None
        if found is None:
            hint = rank_from_name(p, rank_regex)
            files.append(InputFile(item, info.get("size"), hint if hint is not None else order,
                                   "name" if hint is not None else "order", False, _stamp(info)))
            order += 1
            continue
        matched = 0
        for name, info in sorted(found.items()):
            if info.get("type") == "directory":
                continue
            full = (chain + "::" if chain else "") + _unstrip(fs, name)
            if is_own_artifact(name) or not names.search(name):
                skipped.append(full)
                continue
            hint = rank_from_name(name, rank_regex)
            files.append(InputFile(full, info.get("size"), hint, "name" if hint is not None else None, True,
                                   _stamp(info)))
            matched += 1
        if not matched:
            raise TraceFileNotFoundError(
                f"{item}: no trace files found (looked for "
                f"{'*.json and *.json.gz' if names is TRACE_NAME else 'names matching ' + names.pattern}); "
                "check the path or glob"
            )
    if len(files) == 1 and files[0].rank_hint is None:  # a folder of one trace: a single-GPU job is rank 0
        files[0] = dataclasses.replace(files[0], rank_hint=0, hint_source="order")
    return _in_subset(files, subset), skipped


def _in_subset(files: list[InputFile], subset: Container[int] | None) -> list[InputFile]:
    if subset is None:
        return files
    return [f for f in files if f.hint_source not in ("key", "name") or f.rank_hint in subset]


def _stamp(info: Mapping[str, Any]) -> str | None:
    """What changes when the file does: the etag (S3, GCS), else the modification time."""
    for key in ("ETag", "etag", "md5Hash", "generation", "mtime", "LastModified", "updated", "created"):
        if info.get(key) is not None:
            return f"{key}={info[key]}"
    return None


def relative_sources(paths: list[str]) -> dict[str, str]:
    """Each path relative to the common prefix of all of them, for location-free metadata."""
    stripped = {p: p.split("://", 1)[-1] for p in paths}
    try:
        prefix = posixpath.commonpath([posixpath.dirname(s) for s in stripped.values()])
    except ValueError:  # a mix of absolute and relative paths
        prefix = ""
    return {p: posixpath.relpath(s, prefix) if prefix else s for p, s in stripped.items()}


def _fs_for(urlpath: str, storage_options: Mapping[str, Any] | None) -> tuple[Any, str]:
    return fsspec.core.url_to_fs(urlpath, **options_for(urlpath, storage_options))


def _unstrip(fs: Any, path: str) -> str:
    return path if fs.protocol in ("file", ("file", "local")) else fs.unstrip_protocol(path)
