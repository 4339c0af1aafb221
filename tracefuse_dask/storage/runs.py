"""Runs that write the same output at the same time: each run's own temporary folder, its lease, and the clean-up
of what dead runs left behind.

A scheduled job can start while its previous run still writes (a CronJob, a retried Slurm job, two people merging
one bucket). Every run therefore writes under a folder of its own, ``<out>.tracefuse-tmp/<run id>/``, and keeps a
lease beside it, ``<out>.tracefuse-tmp/<run id>.lease``: a small JSON (host, boot and pid namespace, pid, start
time, stale age) that it rewrites every stale age / 4 while it runs. A run removes what dead runs left behind, and
only that, when it starts and again when it ends:

- a run is **alive** while its lease was written less than the stale age ago: the larger of the reader's and the
  one in the lease (default 60 s, at least 2 s; Dask config ``tracefuse.lease.stale-after``, environment
  ``DASK_TRACEFUSE__LEASE__STALE_AFTER``), on the storage's clock (the reader's own lease's modification time is
  "now"). A lease of this machine and pid namespace whose process is gone is dead at once, and so is one of this
  very process whose run has ended;
- the folder and lease of a dead run, and anything else under ``<out>.tracefuse-tmp/`` that no live run owns, are
  removed; so are the unfinished S3 multipart uploads under them;
- unfinished multipart uploads of the output itself (and of its ``--split`` parts) are aborted only when no other
  run is alive (a live run may be completing one).

A run that ends, well or not, removes its own folder, lease and uploads. Each run's output appears by one atomic
step (a rename, a completed multipart upload, a compose), so overlapping runs of the same inputs leave the same
bytes, and of different inputs the last one to finish.
"""
from __future__ import annotations

import contextlib
import datetime as dt
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from typing import Any

import fsspec
import orjson

from ..errors import StorageConnectionError
from .files import options_for, redact, storage_errors
from .joins import protocol_of
from .output import TMP_SUFFIX, is_output_part

__all__ = ["alone", "run_folder"]

log = logging.getLogger("tracefuse_dask")

LEASE_SUFFIX = ".lease"
_STALE_AFTER = 60.0
_MIN_STALE_AFTER = 2.0
_LIVE: set[str] = set()  # the runs of this process that have not ended


def _stale_after() -> float:
    """Seconds after which a lease that was not renewed is dead: Dask config ``tracefuse.lease.stale-after``
    (at least ``_MIN_STALE_AFTER``)."""
    import dask.config

    return max(_MIN_STALE_AFTER, float(dask.config.get("tracefuse.lease.stale-after", _STALE_AFTER)))


def _process_space() -> str | None:
    """What tells this machine's processes from another's that shares its host name (a container with the host's
    network, a pod with ``hostNetwork``): the boot id and the process-id namespace; None where they are unknown."""
    with contextlib.suppress(OSError):
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f"{f.read().strip()}/{os.stat('/proc/self/ns/pid').st_ino}"
    return None


def _mtime(info: Mapping[str, Any]) -> float | None:
    """A listing entry's modification time as a Unix time: ``mtime`` (local, GCS), ``LastModified`` (S3),
    ``updated`` (GCS as text) or ``created`` (memory)."""
    for key in ("mtime", "LastModified", "updated", "created"):
        value = info.get(key)
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            with contextlib.suppress(ValueError):
                value = dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
        if isinstance(value, dt.datetime):
            return (value if value.tzinfo else value.replace(tzinfo=dt.timezone.utc)).timestamp()
    return None


def _pid_gone(pid: Any) -> bool:
    if type(pid) is not int or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def _alive(fs: Any, info: Mapping[str, Any], run_id: str, now: float, limit: float) -> bool:
    """Whether the lease ``info`` (a listing entry) of the run ``run_id`` belongs to a live run, at the storage's
    time ``now``. Its age counts against the larger of ``limit`` and the limit its run wrote in it; a lease of
    this machine and process-id namespace is also judged by its process, and one of this process by its run."""
    try:
        lease = orjson.loads(fs.cat(info["name"]))
    except FileNotFoundError:
        return False
    except (orjson.JSONDecodeError, OSError):
        return True  # caught while its run rewrites it: that run is alive
    if not isinstance(lease, dict):
        lease = {}
    space = _process_space()
    here = lease.get("host") == socket.gethostname() and space is not None and lease.get("space") == space
    if here and lease.get("pid") == os.getpid():  # a run of this process (a notebook's) lives while it runs
        return run_id in _LIVE
    if here and _pid_gone(lease.get("pid")):
        return False
    mtime = _mtime(info)
    if mtime is None:
        with contextlib.suppress(Exception):  # a filesystem that lists no time may still tell it
            mtime = _mtime({"mtime": fs.modified(info["name"])})
    written = lease.get("stale_after")
    return mtime is None or now - mtime <= max(limit, written if isinstance(written, (int, float)) else 0)


def _entries(fs: Any, root: str) -> dict[str, Any]:
    """What is under ``root`` (the runs' folders and leases), by name, listed afresh: other runs and the workers
    wrote here, and a cached listing would miss them."""
    fs.invalidate_cache()
    try:
        entries = fs.ls(root, detail=True)
    except FileNotFoundError:
        entries = []
    # a listing may hold the folder itself, as a key "<root>/" that a tool wrote (s3fs lists it): never removed
    return {e["name"].rstrip("/").rsplit("/", 1)[-1]: e for e in entries
            if fs._strip_protocol(e["name"]).rstrip("/") != root.rstrip("/")}


def _live(fs: Any, names: dict[str, Any], me: str, limit: float) -> set[str]:
    """The runs whose leases are among ``names`` and alive, ``me`` among them, judged by the storage's clock (the
    time of ``me``'s own lease), not this machine's."""
    mine = names.get(me + LEASE_SUFFIX)
    now = _mtime(mine) if mine is not None else None
    now = time.time() if now is None else now
    return {run for name, e in names.items() if name.endswith(LEASE_SUFFIX)
            and ((run := name[: -len(LEASE_SUFFIX)]) == me or _alive(fs, e, run, now, limit))}


def _clean_dead(fs: Any, out_path: str, root: str, me: str, limit: float, *, ending: bool = False) -> None:
    """Remove what dead runs left under ``root``; abort the output's own unfinished uploads (or its ``--split``
    parts') if no other run lives. The run ``me`` counts as dead too when it is ``ending``; its lease still gives
    the storage's clock."""
    names = _entries(fs, root)
    live = _live(fs, names, me, limit)
    if ending:
        live.discard(me)
    for name, e in names.items():
        if name.removesuffix(LEASE_SUFFIX) not in live:
            _quietly(_remove, fs, e["name"])
    if protocol_of(fs) != "s3":
        return
    bucket, key, _ = fs.split_path(out_path)
    _, root_key, _ = fs.split_path(root)
    folder = key.rpartition("/")[0]
    listing = fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=f"{folder}/" if folder else "")
    for up in listing.get("Uploads") or []:
        if is_output_part(key, up["Key"]):
            dead = not (live - {me})
        else:
            dead = up["Key"].startswith(root_key + "/") and up["Key"][len(root_key) + 1:].split("/")[0] not in live
        if dead:
            _quietly(fs.call_s3, "abort_multipart_upload", Bucket=bucket, Key=up["Key"], UploadId=up["UploadId"])


def alone(tmp_dir: str, storage_options: Mapping[str, Any] | None) -> bool:
    """Whether the run whose folder is ``tmp_dir`` (as ``run_folder`` yielded it) is the only live run of its
    output: what may remove what no run needs any more, such as a store's parts that its manifest no longer lists."""
    fs, path = fsspec.core.url_to_fs(tmp_dir, **options_for(tmp_dir, storage_options))
    root, _, me = path.rstrip("/").rpartition("/")
    return _live(fs, _entries(fs, root), me, _stale_after()) <= {me}


def _quietly(step: Any, *args: Any, **kwargs: Any) -> None:
    """One step of removing a dead run's leftovers: another run may be removing the same ones (the second abort
    of an upload fails), and what is left is removed by the next run; it never fails this one."""
    try:
        step(*args, **kwargs)
    except Exception as e:  # noqa: BLE001
        log.debug("left for the next run: %s", e)


def _on_storage_of(message: str, out: str) -> bool:
    """Whether the storage an error names (``<url>: cannot reach the storage ...``) is the one ``out`` lives on:
    its protocol, and its bucket on object storage."""
    url = message.split(": ", 1)[0]

    def where(u: str) -> tuple[str, str]:
        protocol, path = fsspec.core.split_protocol(u.rpartition("::")[2])
        protocol = protocol or "file"
        return protocol, "" if protocol in ("file", "local") else path.split("/", 1)[0]

    return where(url) == where(out)


def _put(fs: Any, path: str, data: bytes) -> None:
    """Write ``data`` to ``path``, making its folder first where folders exist (another run that ended may have
    just removed it)."""
    for attempt in range(3):
        with contextlib.suppress(PermissionError):  # as fsspec.open does for writing
            fs.makedirs(fs._parent(path), exist_ok=True)
        try:
            fs.pipe(path, data)
            return
        except FileNotFoundError:  # the folder went between the two calls
            if attempt == 2:
                raise


def _remove(fs: Any, path: str) -> None:
    """Remove a file, or a folder and all it holds, if it is there; on S3 also the folder's own entry, which some
    servers keep when it is empty (SeaweedFS lists it until a key ``<folder>/`` is deleted)."""
    with contextlib.suppress(FileNotFoundError):
        fs.rm(path, recursive=True)
    if protocol_of(fs) == "s3" and not path.endswith(LEASE_SUFFIX):
        fs.invalidate_cache(path)
        for folder in [*_folders(fs, path), path]:  # the deepest first: a folder with a folder in it stays
            bucket, key, _ = fs.split_path(folder)
            fs.call_s3("delete_object", Bucket=bucket, Key=key.rstrip("/") + "/")


def _folders(fs: Any, path: str) -> list[str]:
    """The (empty) folders under ``path``, the deepest first."""
    try:
        entries = fs.ls(path, detail=True)
    except FileNotFoundError:
        return []
    return [f for e in entries if e["type"] == "directory" for f in (*_folders(fs, e["name"]), e["name"])]


def _remove_if_empty(fs: Any, folder: str) -> None:
    """Remove ``folder`` if nothing is in it: never what another run has just put there."""
    if protocol_of(fs) == "s3":
        bucket, key, _ = fs.split_path(folder)
        fs.call_s3("delete_object", Bucket=bucket, Key=key.rstrip("/") + "/")  # servers keep a folder with keys
    elif protocol_of(fs) == "other":
        with contextlib.suppress(OSError):  # another run's lease or folder is in it
            fs.rmdir(folder)


@contextlib.contextmanager
def run_folder(out: str, storage_options: Mapping[str, Any] | None) -> Iterator[str]:
    """This run's own temporary folder beside ``out`` (a URL), leased while the block runs.

    On entry: write the lease, remove what dead runs left (see the module's docstring), start renewing the lease.
    On exit: stop renewing, remove the folder and the lease, and again what dead runs left (the tasks of a run that
    failed may go on writing for a while), unless the storage stopped answering (then the next run does).

    Parameters
    ----------
    out
        The output (file or folder) whose temporaries these are.
    storage_options
        fsspec options, as ``options_for`` takes them.

    Yields
    ------
    str
        The folder's URL, ``<out>.tracefuse-tmp/<run id>``; it is not created (object stores have no folders).
    """
    so = dict(storage_options or {})
    run_id = uuid.uuid4().hex
    root_url = out.rstrip("/") + TMP_SUFFIX
    limit = _stale_after()
    body = orjson.dumps({"host": socket.gethostname(), "space": _process_space(), "pid": os.getpid(),
                         "started": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                         "stale_after": limit, "output": out})
    with storage_errors(out, so):
        fs, out_path = fsspec.core.url_to_fs(out, **options_for(out, so))
    root = out_path.rstrip("/") + TMP_SUFFIX
    lease = f"{root}/{run_id}{LEASE_SUFFIX}"
    stop = threading.Event()

    def renew() -> None:
        while not stop.wait(limit / 4):
            with contextlib.suppress(Exception):  # a storage that stopped answering fails the run itself
                _put(fs, lease, body)
                if stop.is_set():  # the run ended while this was written: what it removed must stay removed
                    _remove(fs, lease)

    renewer = threading.Thread(target=renew, name="tracefuse-lease", daemon=True)
    _LIVE.add(run_id)
    unreachable = False
    try:
        with storage_errors(out, so):
            _put(fs, lease, body)
            _clean_dead(fs, out_path, root, run_id, limit)
        renewer.start()
        yield f"{root_url}/{run_id}"
    except StorageConnectionError as e:
        unreachable = _on_storage_of(str(e), out)
        raise
    finally:
        stop.set()
        _LIVE.discard(run_id)
        if not unreachable:
            if renewer.is_alive():
                renewer.join(30)  # a lease it writes after this run removed it would outlive the run
            # this run's folder, lease and unfinished uploads go as a dead run's, and again what dead runs left (the
            # tasks of a run that failed may have written after this one began)
            try:
                _clean_dead(fs, out_path, root, run_id, limit, ending=True)
            except Exception as e:  # noqa: BLE001 - the run's own outcome stands; the next run cleans up
                log.warning("%s: could not remove this run's temporaries (%s); the next run will",
                            root_url, redact(str(e), so))
            _quietly(_remove_if_empty, fs, root)
            fs.invalidate_cache()  # what was listed here is gone

