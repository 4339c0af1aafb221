"""Finding, opening and sniffing trace files through fsspec.

Compression is detected from the content (the gzip magic), never from the name
alone, because trace files are often misnamed.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import posixpath
import re
import zlib
from collections.abc import Container, Iterable, Iterator, Mapping
from typing import IO, Any

import fsspec
from isal import igzip
from isal.isal_zlib import error as IsalError

from .errors import (
    RankError,
    StorageAccessError,
    StorageConnectionError,
    TraceFileNotFoundError,
    TraceFormatError,
    TraceFuseError,
)
from .kineto.document import decode_json
from .kineto.header import GZIP_MAGIC
from .kineto.header import read_header as _read_header
from .model import DEFAULT_RANK_REGEX, InputFile

__all__ = [
    "GZIP_LEVEL",
    "TMP_SUFFIX",
    "TRACE_NAME",
    "WRITE_BLOCK",
    "expand_inputs",
    "resolve_rank",
    "gzip_member",
    "gzip_writer",
    "open_write",
    "is_own_artifact",
    "options_for",
    "redact",
    "storage_errors",
    "parse_json",
    "read_bytes",
    "read_start",
    "rank_from_name",
    "read_header",
    "relative_sources",
]

TMP_SUFFIX = ".tracefuse-tmp"
MANIFEST_SUFFIX = ".manifest.json"
GZIP_LEVEL = 1  # isal level: fast, and fixed so the bytes are deterministic
# What a task writing an object buffers before it uploads a part: s3fs's default, 50 MiB, held ~100 MiB of
# RSS per task while a 34 MB partition was written (7-22 MiB with this, S3's smallest part).
WRITE_BLOCK = 5 * 2**20
TRACE_NAME = re.compile(r"\.json(\.gz)?$|(?<!\.tar)\.gz$", re.IGNORECASE)  # not a perfetto archive
_GLOB_CHARS = re.compile(r"[*?\[]")
_CHUNK = 1 << 16  # what a damaged gzip stream is decompressed by


def gzip_member(data: bytes) -> bytes:
    """Compress ``data`` as one deterministic gzip member (fixed level, mtime 0)."""
    return igzip.compress(data, compresslevel=GZIP_LEVEL, mtime=0)


def open_write(path: str, storage_options: Mapping[str, Any] | None) -> IO[bytes]:
    """``path`` opened for writing, uploaded (on object storage) in blocks of ``WRITE_BLOCK`` as they fill."""
    fs, fs_path = fsspec.core.url_to_fs(path, **options_for(path, storage_options))
    with contextlib.suppress(PermissionError):  # as fsspec.open does for writing
        fs.makedirs(fs._parent(fs_path), exist_ok=True)
    return fs.open(fs_path, "wb", block_size=WRITE_BLOCK)


def gzip_writer(fileobj: IO[bytes]) -> igzip.IGzipFile:
    """A stream that writes one deterministic gzip member into ``fileobj`` (as ``gzip_member``); closing
    it writes the trailer and leaves ``fileobj`` open."""
    return igzip.IGzipFile(filename="", fileobj=fileobj, mode="wb", compresslevel=GZIP_LEVEL, mtime=0)


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


_ALIASES = {"gcs": "gs", "gs": "gcs", "s3a": "s3", "s3": "s3a"}
_SECRET_KEY = re.compile(r"key|secret|token|password|credential|session|signature", re.IGNORECASE)
_SECRET_ENV = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ACCESS_KEY_ID", "GOOGLE_APPLICATION_CREDENTIALS")


def resolve_rank(f: InputFile, header: Mapping[str, Any],
                 rank_regex: str = DEFAULT_RANK_REGEX) -> tuple[int, int | None, str | None]:
    """A file's ``(rank, world_size, note)``: the dict key, else ``distributedInfo.rank``, else its name or place.

    ``note`` says when the name and ``distributedInfo`` disagree.

    Raises
    ------
    RankError
        When nothing gives the rank.
    """
    info = header.get("distributedInfo")
    info = info if isinstance(info, dict) else {}
    info_rank = info.get("rank")
    if f.hint_source == "key":
        rank = f.rank_hint
    elif type(info_rank) is int and info_rank >= 0:
        rank = info_rank
    elif f.rank_hint is not None:
        rank = f.rank_hint
    else:
        raise RankError(f"{f.path}: no rank found: no distributedInfo.rank in the file and no rank in its "
                        f"name (regex {rank_regex!r}); pass --rank-regex with a (?P<rank>...) group, "
                        "or give the files as a {rank: path} dict")
    note = None
    if f.hint_source == "name" and type(info_rank) is int and info_rank != f.rank_hint:
        note = (f"{f.path}: the name says rank {f.rank_hint} but distributedInfo.rank is {info_rank}; "
                f"using {info_rank}")
    ws = info.get("world_size")
    return rank, ws if type(ws) is int else None, note


def options_for(url: str, storage_options: Mapping[str, Any] | None) -> dict[str, Any]:
    """The fsspec options for ``url``.

    ``storage_options`` is either one set for every protocol, or one per
    protocol, ``{"s3": {...}, "gs": {...}}``, for mixed inputs and outputs.
    """
    so = dict(storage_options or {})
    if not so or not all(isinstance(v, dict) for v in so.values()):
        return so
    if not set(so) <= set(fsspec.available_protocols()):
        return so
    if "::" in url:
        return so  # fsspec hands each protocol of a chained URL its own dict
    proto = fsspec.core.split_protocol(url)[0] or "file"
    return dict(so.get(proto) or so.get(_ALIASES.get(proto, ""), {}))


def _secrets(value: Any, key: str = "") -> Iterator[str]:
    if isinstance(value, Mapping):
        for k, v in value.items():
            yield from _secrets(v, str(k))
    elif isinstance(value, str) and len(value) >= 4 and _SECRET_KEY.search(key):
        yield value


def redact(text: str, storage_options: Mapping[str, Any] | None = None) -> str:
    """``text`` with every credential of ``storage_options`` and the environment replaced by ``***``."""

    for secret in list(_secrets(storage_options or {})) + [os.environ.get(k, "") for k in _SECRET_ENV]:
        if len(secret) >= 4:
            text = text.replace(secret, "***")
    return text


def _is_connection_error(e: BaseException) -> bool:
    if isinstance(e, (ConnectionError, TimeoutError)):
        return True
    name, module = type(e).__name__, type(e).__module__
    return ("Connect" in name or "Timeout" in name) and module.split(".")[0] in ("botocore", "aiohttp", "urllib3")


@contextlib.contextmanager
def storage_errors(url: str, storage_options: Mapping[str, Any] | None = None) -> Iterator[None]:
    """Turn storage failures into typed errors that name ``url`` and say what to do, without secrets."""
    try:
        yield
    except TraceFuseError:
        raise
    except ImportError as e:
        extra = " (pip install 'tracefuse_dask[gcs]')" if url.startswith(("gs://", "gcs://")) else ""
        raise TraceFuseError(f"{url}: {e}{extra}") from None
    except FileNotFoundError:
        raise TraceFileNotFoundError(f"{url}: no such file or object; check the path (bucket and key)") from None
    except PermissionError as e:
        raise StorageAccessError(
            f"{url}: access denied ({redact(str(e), storage_options)}); check the credentials (environment, "
            "config files or --storage-options), whether they expired, and the bucket's policy") from None
    except Exception as e:
        if not _is_connection_error(e):
            raise
        raise StorageConnectionError(
            f"{url}: cannot reach the storage ({redact(str(e), storage_options)}); check the endpoint "
            "(endpoint_url in --storage-options) and the network") from None


def _fs_for(urlpath: str, storage_options: Mapping[str, Any] | None) -> tuple[Any, str]:
    return fsspec.core.url_to_fs(urlpath, **options_for(urlpath, storage_options))


def _unstrip(fs: Any, path: str) -> str:
    return path if fs.protocol in ("file", ("file", "local")) else fs.unstrip_protocol(path)


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
                info = _info(fs, p, path, storage_options)
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
            if _GLOB_CHARS.search(p):
                found = fs.glob(p, detail=True)
            elif fs.isdir(p):
                found = {info["name"]: info for info in fs.ls(p, detail=True)}
            else:
                found = None
        if found is None:
            hint = rank_from_name(p, rank_regex)
            info = _info(fs, p, item, storage_options)
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


def _info(fs: Any, path: str, shown: str, storage_options: Mapping[str, Any] | None) -> dict[str, Any]:
    with storage_errors(shown, storage_options):
        return fs.info(path)


def _stamp(info: Mapping[str, Any]) -> str | None:
    """What changes when the file does: the etag (S3, GCS), else the modification time."""
    for key in ("ETag", "etag", "md5Hash", "generation", "mtime", "LastModified", "updated", "created"):
        if info.get(key) is not None:
            return f"{key}={info[key]}"
    return None


def _open_raw(path: str, storage_options: Mapping[str, Any] | None) -> IO[bytes]:
    with storage_errors(path, storage_options):
        return fsspec.open(path, "rb", **options_for(path, storage_options)).open()


def read_start(path: str, storage_options: Mapping[str, Any] | None = None, size: int = 8192) -> bytes:
    """At most ``size`` bytes of the start of a file's content, decompressed from its first ``size``
    bytes when they are gzip (those bytes as they are when they do not decompress)."""
    with _open_raw(path, storage_options) as f, storage_errors(path, storage_options):
        head = f.read(size)
    if head[:2] == GZIP_MAGIC:
        with contextlib.suppress(zlib.error):
            head = zlib.decompressobj(31).decompress(head, size)
    return head


def read_header(path: str, storage_options: Mapping[str, Any] | None = None) -> tuple[dict[str, Any], bool, int]:
    """A trace file's top-level keys but ``traceEvents``, without its events (``kineto.header.read_header``)."""
    with _open_raw(path, storage_options) as raw:
        return _read_header(raw)


def read_bytes(path: str, storage_options: Mapping[str, Any] | None = None, *,
               repair: bool = False) -> tuple[bytes, bool]:
    """Read one file whole, decompressing it if its content is gzip.

    Returns the bytes and whether a truncated gzip stream was cut short (only
    with ``repair``; otherwise that raises).
    """
    with _open_raw(path, storage_options) as f, storage_errors(path, storage_options):
        raw = f.read()
    if raw[:2] != GZIP_MAGIC:
        return raw, False
    try:
        return igzip.decompress(raw), False
    except (OSError, EOFError, ValueError, zlib.error, IsalError) as e:
        if repair:
            data = _gunzip_prefix(raw)
            if data:
                return data, True
        hint = "" if repair else ", or pass --repair to recover the complete events of a truncated file"
        raise TraceFormatError(f"{path}: corrupt or truncated gzip ({e}); re-export the trace, drop this "
                               f"file{hint}") from None


def _gunzip_prefix(raw: bytes) -> bytes:
    """Everything a damaged gzip stream yields before the damage."""
    out: list[bytes] = []
    while raw:
        d = zlib.decompressobj(31)
        for k in range(0, len(raw), _CHUNK):
            try:
                out.append(d.decompress(raw[k : k + _CHUNK]))
            except zlib.error:
                return b"".join(out)
            if d.eof:
                break
        if not d.eof:
            break
        raw = d.unused_data
    return b"".join(out)


def parse_json(path: str, storage_options: Mapping[str, Any] | None = None, *, rank: int | None = None,
               repair: bool = False) -> tuple[Any, int, str | None]:
    """Parse one file whole with orjson.

    Returns the document, its uncompressed size and, when ``repair`` recovered
    a truncated file, a note that says what was recovered.
    """
    data, cut_gzip = read_bytes(path, storage_options, repair=repair)
    return decode_json(data, path, rank=rank, cut_gzip=cut_gzip, repair=repair)


def relative_sources(paths: list[str]) -> dict[str, str]:
    """Each path relative to the common prefix of all of them, for location-free metadata."""
    stripped = {p: p.split("://", 1)[-1] for p in paths}
    try:
        prefix = posixpath.commonpath([posixpath.dirname(s) for s in stripped.values()])
    except ValueError:  # a mix of absolute and relative paths
        prefix = ""
    return {p: posixpath.relpath(s, prefix) if prefix else s for p, s in stripped.items()}
