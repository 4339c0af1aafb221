"""Writing outputs: the temporary names a job writes under before the rename into place, and gzip members
written with fixed settings so that the bytes are deterministic."""
from __future__ import annotations

import contextlib
import os
import re
import uuid
from collections.abc import Iterator, Mapping
from typing import IO, Any

import fsspec
from isal import igzip

from ..errors import OutputWriteError, TraceFuseError
from .files import options_for, storage_errors

__all__ = ["GZIP_LEVEL", "MANIFEST_SUFFIX", "TMP_SUFFIX", "WRITE_BLOCK", "gzip_member", "gzip_writer",
           "is_output_part", "open_write", "put_whole", "split_name", "writing"]


TMP_SUFFIX = ".tracefuse-tmp"
MANIFEST_SUFFIX = ".manifest.json"
GZIP_LEVEL = 1  # isal level: fast, and fixed so the bytes are deterministic
# What a task writing an object buffers before it uploads a part: s3fs's default, 50 MiB, held ~100 MiB of
# RSS per task while a 34 MB partition was written (7-22 MiB with this, S3's smallest part).
WRITE_BLOCK = 5 * 2**20


def split_name(out: str, first: int, last: int, width: int) -> str:
    """The ``--split`` part of ``out`` with ranks ``first`` to ``last``: ``m.json.gz`` gives
    ``m.ranks-000-127.json.gz``."""
    stem, ext = _stem(out)
    return f"{stem}.ranks-{first:0{width}d}-{last:0{width}d}{ext}"


def is_output_part(out: str, name: str) -> bool:
    """Whether ``name`` is ``out`` or one of its ``--split`` parts (``split_name``)."""
    stem, ext = _stem(out)
    return name == out or re.fullmatch(rf"{re.escape(stem)}\.ranks-\d+-\d+{re.escape(ext)}", name) is not None


def _stem(out: str) -> tuple[str, str]:
    for ext in (".json.gz", ".json", ".gz"):
        if out.endswith(ext):
            return out[: -len(ext)], ext
    return out, ""


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


@contextlib.contextmanager
def writing(path: str) -> Iterator[None]:
    """Turn an OSError while ``path`` is written into an ``OutputWriteError`` that says what to do."""
    try:
        yield
    except OSError as e:
        if isinstance(e, TraceFuseError):
            raise
        raise OutputWriteError(f"{path}: could not write it ({e.strerror or e}); free some space or write "
                               "the output somewhere else, then rerun") from e


def put_whole(fs: Any, path: str, data: bytes, storage_options: Mapping[str, Any] | None) -> None:
    """Write the file ``path`` of ``fs`` whole or not at all: a local file under a temporary name in its folder,
    then renamed into place; an object in one request."""
    url = fs.unstrip_protocol(path)
    with writing(url), storage_errors(url, storage_options):
        if isinstance(fs, fsspec.implementations.local.LocalFileSystem):
            fs.makedirs(fs._parent(path), exist_ok=True)
            tmp = f"{path}.{uuid.uuid4().hex}{TMP_SUFFIX}"
            try:
                with open(tmp, "wb") as fo:
                    fo.write(data)
                os.replace(tmp, path)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(tmp)
        else:
            fs.pipe(path, data)
