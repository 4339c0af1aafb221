"""Reading trace files through fsspec: storage options per protocol, storage errors as clear messages with the
secrets redacted, and a file's bytes, start, header or document.

Compression is detected from the content (the gzip magic), never from the name
alone, because trace files are often misnamed.
"""
from __future__ import annotations

import contextlib
import copy
import errno
import functools
import os
import re
import time
import zlib
from collections.abc import Callable, Iterator, Mapping
from typing import IO, Any, TypeVar

import fsspec
from isal import igzip
from isal.isal_zlib import error as IsalError

from ..errors import (
    StorageAccessError,
    StorageConnectionError,
    StorageStallError,
    TraceFileNotFoundError,
    TraceFormatError,
    TraceFuseError,
)
from ..kineto.document import decode_json
from ..kineto.header import GZIP_MAGIC
from ..kineto.header import read_header as _read_header

__all__ = ["RETRY_WAITS", "STORAGE_TIMEOUT", "TIMEOUT_OPTION", "options_for", "parse_json", "path_info", "read_bytes",
           "read_header", "read_start", "redact", "retry_unreachable", "stall_wait", "storage_errors"]

T = TypeVar("T")


_CHUNK = 1 << 16  # what a damaged gzip stream is decompressed by
_SECRET_KEY = re.compile(r"key|secret|token|password|credential|session|signature", re.IGNORECASE)
_SECRET_ENV = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ACCESS_KEY_ID", "GOOGLE_APPLICATION_CREDENTIALS")


#: The default bound (seconds) on a storage that stops answering (``--storage-timeout``; ``storage_timeout`` in
#: the storage options): a connect, or a read that gets no byte, fails the run within about this long, retries
#: included. A slow but live server is not cut off: the bound is on each wait for a byte, not on a transfer.
STORAGE_TIMEOUT = 60.0
TIMEOUT_OPTION = "storage_timeout"  # tracefuse's own storage option, taken out before fsspec sees the rest
# What each client library tries a request that stalls, and waits between its tries, at most: botocore's standard
# mode twice (``"retries": {"max_attempts": 1}`` counts the retries; it also retries throttling and 5xx answers),
# up to 1 s apart, inside each of s3fs's five tries, 0.1-0.8 s apart (~1.9 s in all; not configurable); gcsfs six
# times, 1-2, 2-3, 4-5, 8-9 and 16-17 s apart (31-36 s in all; not configurable either). Measured against a server
# that accepts connections and never answers: 10 connections for S3, 6 for GCS.
_TRIES = {"s3": (2 * 5, 5 * 1.0 + 1.9), "gs": (6, 36.0)}
_MIN_WAIT = 1.0  # seconds: no wait for a byte is cut shorter than this, whatever the bound
# The tasks themselves retry a storage that refuses connections, at fixed times (``RETRY_WAITS``), so that a run
# whose storage is gone ends in seconds, and a storage that restarts within them is not noticed.
RETRY_WAITS = (1.0, 2.0)  # seconds before a task that found the storage unreachable runs again


def stall_wait(proto: str, bound: float) -> float:
    """How long one try waits for a connection or a byte, so that all of ``proto``'s tries (``"s3"`` or ``"gs"``)
    and the waits between them end within ``bound`` seconds; at least ``_MIN_WAIT`` (gcsfs's own waits alone
    take 31-36 s)."""
    tries, waits = _TRIES[proto]
    return max(_MIN_WAIT, (bound - waits) / tries)


def options_for(url: str, storage_options: Mapping[str, Any] | None) -> dict[str, Any]:
    """The fsspec options for ``url``: for S3 and GCS, with each try's wait for a connection or a byte
    (``stall_wait``) set from the bound on a stall (``storage_timeout`` in the options, default
    ``STORAGE_TIMEOUT``), unless the options set their own (botocore's ``config_kwargs``, each key on its own;
    gcsfs's ``requests_timeout``).

    ``storage_options`` is either one set for every protocol, or one per
    protocol, ``{"s3": {...}, "gs": {...}}``, for mixed inputs and outputs.
    """
    so = dict(storage_options or {})
    bound = float(so.pop(TIMEOUT_OPTION, None) or STORAGE_TIMEOUT)
    if "::" in url:
        return so  # fsspec hands each protocol of a chained URL its own dict
    proto = fsspec.core.split_protocol(url)[0] or "file"
    if so and all(isinstance(v, dict) for v in so.values()) and set(so) <= set(fsspec.available_protocols()):
        so = dict(so.get(proto) or so.get(_ALIASES.get(proto, ""), {}))
    if proto in ("s3", "s3a"):  # a copy: botocore rewrites the retries dict it is given
        wait = stall_wait("s3", bound)
        mine = {"connect_timeout": min(5.0, wait), "read_timeout": wait,
                "retries": {"max_attempts": 1, "mode": "standard"}}
        so["config_kwargs"] = copy.deepcopy({**mine, **(so.get("config_kwargs") or {})})
    elif proto in ("gs", "gcs"):
        import aiohttp

        wait = stall_wait("gs", bound)
        # gcsfs hands its requests_timeout to each request, where it replaces the session's timeouts
        so.setdefault("requests_timeout", aiohttp.ClientTimeout(sock_connect=wait, sock_read=wait))
    return so


def retry_unreachable(task: Callable[..., T]) -> Callable[..., T]:
    """``task``, run again after each of ``RETRY_WAITS`` when it fails because the storage could not be reached
    (``StorageConnectionError``); the error of the last try is raised. A storage that stalled
    (``StorageStallError``) is not tried again: the client libraries' tries took the bound already.

    For task functions: each writes only its own files, so running it again is safe.
    """

    @functools.wraps(task)
    def retried(*args: Any, **kwargs: Any) -> T:
        for wait in RETRY_WAITS:
            try:
                return task(*args, **kwargs)
            except StorageStallError:
                raise  # the client libraries' tries took the bound already
            except StorageConnectionError:
                time.sleep(wait)
        return task(*args, **kwargs)

    return retried


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


def _chain(e: BaseException | None) -> Iterator[BaseException]:
    """``e`` and the exceptions it was raised while handling, innermost last."""
    while e is not None:
        yield e
        e = e.__context__


def _is_stall(e: BaseException) -> bool:
    """A connect or a read that timed out (botocore's, aiohttp's, asyncio's, fsspec's), not one refused."""
    return isinstance(e, TimeoutError) or "Timeout" in type(e).__name__


def _endpoint(url: str, storage_options: Mapping[str, Any] | None) -> str:
    so = options_for(url, storage_options)
    found = so.get("endpoint_url") or (so.get("client_kwargs") or {}).get("endpoint_url")
    if found:
        return str(found)
    if url.startswith(("gs://", "gcs://")):
        return os.environ.get("STORAGE_EMULATOR_HOST") or "https://storage.googleapis.com"
    return "its default endpoint"


def _is_connection_error(e: BaseException) -> bool:
    if isinstance(e, (ConnectionError, TimeoutError)):
        return True
    if isinstance(e, OSError) and e.errno == errno.EREMOTEIO:
        return True  # s3fs's 5xx answer ("We encountered an internal error"): a storage that is restarting
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
        where = " (bucket and key)" if "://" in url and not url.startswith("file://") else ""
        raise TraceFileNotFoundError(f"{url}: no such file or object; check the path{where}") from None
    except PermissionError as e:
        raise StorageAccessError(
            f"{url}: access denied ({redact(str(e), storage_options)}); check the credentials (environment, "
            "config files or --storage-options), whether they expired, and the bucket's policy") from None
    except Exception as raised:
        # s3fs's handler of a read that timed out mid-body fails itself (IndexError on the timeout's empty args,
        # s3fs 2026.x _fetch_range): the timeout is then what it was handling
        e = next((c for c in _chain(raised) if _is_connection_error(c)), None)
        if e is None:
            raise
        if _is_stall(e):
            bound = float((storage_options or {}).get(TIMEOUT_OPTION) or STORAGE_TIMEOUT)
            why = redact(str(e) or type(e).__name__, storage_options)
            raise StorageStallError(
                f"{url}: the storage at {_endpoint(url, storage_options)} stopped answering (no connection or no "
                f"byte within the {bound:g} s bound, retries included: {why}); check the endpoint and the "
                "network, or raise --storage-timeout for a storage that is slow to answer") from None
        raise StorageConnectionError(
            f"{url}: cannot reach the storage ({redact(str(e), storage_options)}); check the endpoint "
            "(endpoint_url in --storage-options) and the network") from None


def path_info(fs: Any, path: str) -> dict[str, Any]:
    """``fs.info(path)``, its ``type`` ``"directory"`` wherever fsspec's ``isdir`` says so; a missing path raises
    ``FileNotFoundError``. Unlike ``isdir``, which takes a timeout for "not a folder" (and the next request would
    wait the bound again), an object store that does not answer fails here."""
    if fs.protocol in ("http", "https", ("http", "https")):  # info calls every URL a file, and any failure missing
        return {"name": path, "type": "directory"} if fs.isdir(path) else fs.info(path)
    try:
        return fs.info(path)
    except PermissionError:  # s3fs heads the key first: a policy may list the prefix and not read that key
        if not fs.isdir(path):
            raise
        return {"name": path, "type": "directory"}


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
    with _open_raw(path, storage_options) as raw, storage_errors(path, storage_options):
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


def arrow_file(data: bytes) -> Any:
    """``data`` copied into memory that Arrow owns, as a file for pyarrow (or pandas) to read a table from.

    pyarrow reads a table on its own threads, which can drop their hold on the file after the read returned. Given
    Python's bytes (or a BytesIO), that needs the interpreter; one doing so as the interpreter exits aborts it
    ("terminate called without an active exception", apache/arrow#34314). Memory Arrow owns needs nothing.
    """
    import pyarrow as pa

    buf = pa.allocate_buffer(len(data))
    pa.FixedSizeBufferWriter(buf).write(data)
    return pa.BufferReader(buf)


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


_ALIASES = {"gcs": "gs", "gs": "gcs", "s3a": "s3", "s3": "s3a"}
