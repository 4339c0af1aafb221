"""Assembling the merged file from its pieces, on whatever storage the output lives.

The merged file is the concatenation of a header, the per-rank partitions in
rank order, and a footer; every partition begins with its own separator, so
pieces join as plain bytes (or gzip members). How they are joined depends on
the output's storage:

- S3: workers group small pieces into parts of at least 5 MiB, then one
  multipart upload copies the parts server side (``UploadPartCopy``), in
  levels of at most 10,000 parts. The object appears only when complete.
- GCS: ``compose``, at most 32 sources per call, as a tree.
- Anything else (local disk, memory): one task copies the pieces into a
  temporary file that is then renamed into place; between local files the
  kernel does the copy (``copy_file_range``).
"""
from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Union

from .output import WRITE_BLOCK, gzip_writer

__all__ = ["MIN_PART", "MAX_PARTS", "COMPOSE_MAX", "Piece", "plan_groups", "protocol_of", "write_group", "join"]

MIN_PART = 5 * 2**20  # S3's smallest part, but for the last one
MAX_PARTS = 10_000  # S3's most parts in one multipart upload
MAX_PART = 5 * 2**30  # S3's largest part
COMPOSE_MAX = 32  # GCS's most sources in one compose
_COPY_BUFFER = 1 << 23
_NO_KERNEL_COPY = {errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EPERM}

#: a piece is either inline bytes (header, footer) or the path of a partition with its size
Piece = Union[bytes, tuple[str, int]]


def protocol_of(fs: Any) -> str:
    """``"s3"``, ``"gcs"`` or ``"other"``: the assembly strategy for a filesystem."""
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
    if "s3" in protocols or "s3a" in protocols:
        return "s3"
    if "gs" in protocols or "gcs" in protocols:
        return "gcs"
    return "other"


def _size(piece: Piece) -> int:
    return len(piece) if isinstance(piece, bytes) else piece[1]


def plan_groups(pieces: Sequence[Piece], min_part: int = MIN_PART) -> list[list[int]]:
    """Group consecutive pieces so that every group but the last holds at least ``min_part`` bytes.

    A partition that is big enough on its own stays alone, so it is copied
    server side without being read again.
    """
    groups: list[list[int]] = []
    current: list[int] = []
    total = 0
    for i, piece in enumerate(pieces):
        current.append(i)
        total += _size(piece)
        if total >= min_part:
            groups.append(current)
            current, total = [], 0
    if current:
        groups.append(current)
    return groups


def write_group(fs: Any, pieces: Sequence[Piece], dest: str, recompress: bool = False) -> int:
    """Write the concatenation of ``pieces`` to ``dest``; with ``recompress`` as one gzip member.

    Returns the bytes written.
    """
    with fs.open(dest, "wb", block_size=WRITE_BLOCK) as raw:
        dst = gzip_writer(raw) if recompress else raw
        for piece in pieces:
            if isinstance(piece, bytes):
                dst.write(piece)
            else:
                with fs.open(piece[0], "rb") as src:
                    _append(src, dst, piece[1]) if dst is raw else shutil.copyfileobj(src, dst, _COPY_BUFFER)
        if dst is not raw:
            dst.close()
    return fs.size(dest)


def _append(src: Any, dst: Any, size: int) -> None:
    """Copy file ``src`` (of ``size`` bytes) to the end of ``dst``: in the kernel when both are OS files.

    ``os.copy_file_range`` copies page-cache pages without a trip through Python
    (4-5x faster than a buffered copy for local partitions); object storage,
    memory files and kernels or filesystems without it take the buffered copy.
    """
    try:
        fds = src.fileno(), dst.fileno()
    except (AttributeError, OSError):  # io.UnsupportedOperation, or no fileno at all: not an OS file
        fds = None
    if fds is not None and hasattr(os, "copy_file_range"):
        dst.flush()
        try:
            while size > 0:
                copied = os.copy_file_range(*fds, size)
                if not copied:
                    break
                size -= copied
        except OSError as e:
            if e.errno not in _NO_KERNEL_COPY:
                raise
    shutil.copyfileobj(src, dst, _COPY_BUFFER)  # what is left: all of it without a kernel copy


def join(fs: Any, dest: str, sources: Sequence[str], sizes: Sequence[int], tmp: str) -> None:
    """Concatenate whole objects server side into ``dest`` (S3 multipart copy or a GCS compose tree)."""
    if protocol_of(fs) == "s3":
        _s3_join(fs, dest, list(sources), list(sizes), tmp, 0)
    else:
        _gcs_join(fs, dest, list(sources), tmp)


def _s3_join(fs: Any, dest: str, sources: list[str], sizes: list[int], tmp: str, level: int) -> None:
    if len(sources) > MAX_PARTS:
        merged, merged_sizes = [], []
        for k in range(0, len(sources), MAX_PARTS):
            name = f"{tmp}/level{level}-{k // MAX_PARTS:06d}"
            _s3_join(fs, name, sources[k : k + MAX_PARTS], sizes[k : k + MAX_PARTS], tmp, level + 1)
            merged.append(name)
            merged_sizes.append(sum(sizes[k : k + MAX_PARTS]))
        sources, sizes = merged, merged_sizes
    bucket, key, _ = fs.split_path(dest)
    ranges = []  # (source, CopySourceRange or None), each at most 5 GiB
    for src, size in zip(sources, sizes):
        if size <= MAX_PART:
            ranges.append((src, None))
        else:
            ranges.extend((src, f"bytes={a}-{min(a + MAX_PART, size) - 1}") for a in range(0, size, MAX_PART))
    upload = fs.call_s3("create_multipart_upload", Bucket=bucket, Key=key)["UploadId"]

    def copy(args: tuple[int, tuple[str, str | None]]) -> dict[str, Any]:
        number, (src, byte_range) = args
        extra = {"CopySourceRange": byte_range} if byte_range else {}
        out = fs.call_s3("upload_part_copy", Bucket=bucket, Key=key, UploadId=upload, PartNumber=number,
                         CopySource=src, **extra)
        return {"PartNumber": number, "ETag": out["CopyPartResult"]["ETag"]}

    try:
        with ThreadPoolExecutor(16) as pool:
            parts = list(pool.map(copy, enumerate(ranges, 1)))
        fs.call_s3("complete_multipart_upload", Bucket=bucket, Key=key, UploadId=upload,
                   MultipartUpload={"Parts": parts})
    except BaseException:
        fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload)
        raise
    fs.invalidate_cache(dest)


def _gcs_join(fs: Any, dest: str, sources: list[str], tmp: str) -> None:
    level = 0
    while len(sources) > COMPOSE_MAX:
        merged = []
        for k in range(0, len(sources), COMPOSE_MAX):
            name = f"{tmp}/compose{level}-{k // COMPOSE_MAX:06d}"
            fs.merge(name, sources[k : k + COMPOSE_MAX])
            merged.append(name)
        sources, level = merged, level + 1
    fs.merge(dest, sources)
    fs.invalidate_cache(dest)
