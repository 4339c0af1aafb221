"""Folders that are whole or not trusted: a report folder (``analyze``'s, ``diff``'s) is committed by one last
file, ``commit.json``, which lists every file of the folder with its size and SHA-256, and what the folder was made
from (inputs with their size and etag or mtime, options, tool version; never credentials).

Readers (``read_report``, hence ``diff``, and ``analyze --skip-if-unchanged``) trust a folder only through its
commit: a folder without one is being written, or a run stopped before it finished, or an older tracefuse wrote it;
a file whose bytes are not the ones its commit lists is another run's, caught while it replaces the folder.

The files are first written in the run's own temporary folder (``runs.run_folder``). On a local disk that folder,
its commit already in it, is then renamed into place: the place holds at every moment nothing or a whole folder.
Object stores have no folders to rename, and runs that write one folder at once take turns there without a lock.
A round of a run copies its files into place, removes the files that are not its own, and writes its commit last.
The run then reads the folder back. A commit whose files are all there as it lists them, and nothing else, is a
whole folder (this run's, or a run's that committed after it): the run has ended. Otherwise another run is in its
round (or died in it): the run waits a while, longer each time and random (two runs in step fall out of step), and
after ``_WAITS`` whiles without a whole folder takes its turn again, up to ``ROUNDS`` rounds.

Every round ends with a commit, so after the last commit is written only a run that dies writes; the run that wrote
it checks the folder after all other writes and goes round until it is whole. When every run has ended, the folder
is the whole folder of one run, never a mix, and each run ended only once it saw a whole folder (S3 and GCS are
strongly consistent, for listings too). A run that dies halfway leaves a folder that readers refuse, until the next
run replaces it; a reader that reads while runs take turns is refused, or reads one run's whole folder.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import itertools
import os
import random
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import fsspec
import fsspec.implementations.local
import orjson

from .._version import __version__
from ..errors import MergeError, OutputWriteError
from .files import options_for, storage_errors

__all__ = ["COMMIT", "Committed", "commit_folder", "read_committed"]

COMMIT = "commit.json"
ROUNDS = 10  # rounds a run takes on an object store before it gives up on a folder that others keep writing
_WAITS = 3  # whiles a run waits for a whole folder before it takes its turn again


def _record(files: Mapping[str, bytes], made_from: Mapping[str, Any] | None) -> bytes:
    """The commit of ``files`` (in their order), made from ``made_from``."""
    return orjson.dumps({"tool": "tracefuse_dask", "version": __version__,
                         "files": {name: {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
                                   for name, data in files.items()},
                         "made_from": made_from}, option=orjson.OPT_INDENT_2)


def commit_folder(fs: Any, staged: str, path: str, files: Mapping[str, bytes],
                  made_from: Mapping[str, Any] | None = None) -> None:
    """Put the folder ``staged`` (this run's, holding ``files``) with its commit in the place of the folder ``path``
    (both paths of ``fs``), as the module's docstring says.

    Raises
    ------
    OutputWriteError
        When other runs kept writing into the folder for ``ROUNDS`` rounds of this one.
    """
    record = _record(files, made_from)
    if isinstance(fs, fsspec.implementations.local.LocalFileSystem):
        fs.pipe(f"{staged}/{COMMIT}", record)
        fs.makedirs(fs._parent(path), exist_ok=True)
        for k in itertools.count():
            try:
                os.rename(staged, path)
                return
            except OSError as e:
                if e.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
                    raise
            with contextlib.suppress(FileNotFoundError):  # another run moved it away first
                os.rename(path, f"{fs._parent(staged)}/replaced-{k}")
    rounds = waits = 0
    while True:
        if rounds == 0 or waits == _WAITS:  # this run's round
            if rounds == ROUNDS:
                raise OutputWriteError(f"{fs.unstrip_protocol(path)}: other runs kept writing into this folder while "
                                       f"this one committed it ({ROUNDS} rounds); run again once they have ended")
            started = time.monotonic()
            for name in files:
                fs.copy(f"{staged}/{name}", f"{path}/{name}")
            for extra in _names(fs, path) - {*files, COMMIT}:
                with contextlib.suppress(FileNotFoundError):
                    fs.rm(f"{path}/{extra}", recursive=True)
            fs.pipe(f"{path}/{COMMIT}", record)
            took, rounds, waits = time.monotonic() - started, rounds + 1, 0
            if _whole(fs, path):
                return
        # another run is in its round, or died in it: a while for it, longer each time (up to 64 of this run's
        # rounds), random so that two runs in step fall out of step
        time.sleep(random.uniform(0.5, 1.5) * took * 2 ** min(rounds + waits, 6))
        if _whole(fs, path):
            return
        waits += 1


def _whole(fs: Any, path: str) -> bool:
    """Whether the folder ``path`` is whole: a commit, with its files as it lists them and nothing else (this run's
    commit or another's)."""
    try:
        listed = orjson.loads(fs.cat_file(f"{path}/{COMMIT}"))["files"]
    except (FileNotFoundError, orjson.JSONDecodeError, KeyError, TypeError):
        return False
    if not isinstance(listed, dict) or _names(fs, path) != {*listed, COMMIT}:
        return False
    try:
        return all(_matches(fs.cat_file(f"{path}/{name}"), want) for name, want in listed.items())
    except FileNotFoundError:  # another run removed it since the listing
        return False


def _matches(data: bytes, want: Any) -> bool:
    """Whether ``data`` is the file a commit lists as ``want``."""
    return isinstance(want, dict) and len(data) == want.get("bytes") \
        and hashlib.sha256(data).hexdigest() == want.get("sha256")


def _names(fs: Any, path: str) -> set[str]:
    """The names in the folder ``path``, as the storage lists them now; not the folder's own entry (a key
    ``<folder>/``, which some tools write)."""
    fs.invalidate_cache(path)
    try:
        listed = fs.ls(path, detail=False)
    except FileNotFoundError:
        return set()
    here = fs._strip_protocol(path).rstrip("/")
    return {p.rstrip("/").rsplit("/", 1)[-1] for p in listed if fs._strip_protocol(p).rstrip("/") != here}


@dataclass
class Committed:
    """A committed folder, to read files from: each is checked against the commit as it is read."""

    url: str
    fs: Any
    path: str
    record: dict[str, Any]
    storage_options: Mapping[str, Any]

    @property
    def names(self) -> list[str]:
        """The folder's files, in the order they were written; the commit is not one of them."""
        return list(self.record["files"])

    @property
    def made_from(self) -> Any:
        """What the folder was made from, as its writer gave it (None when it did not)."""
        return self.record.get("made_from")

    def read(self, name: str) -> bytes:
        """The bytes of the file ``name``, which the commit lists.

        Raises
        ------
        MergeError
            When the file is missing or is not the one the commit lists.
        """
        with storage_errors(self.url, self.storage_options):
            try:
                data = self.fs.cat_file(f"{self.path}/{name}")
            except FileNotFoundError:
                data = None
        if data is None or not _matches(data, self.record["files"][name]):
            raise MergeError(f"{self.url}: {name} is not the file its {COMMIT} lists: another run is replacing this "
                             "folder now, or one stopped halfway; read it again once that run has ended, or write "
                             "the folder again")
        return data


def read_committed(url: str, storage_options: Mapping[str, Any] | None = None) -> Committed:
    """The folder ``url``, through its commit.

    Raises
    ------
    MergeError
        When the folder has no commit (or one that tracefuse did not write).
    """
    so = dict(storage_options or {})
    with storage_errors(url, so):
        fs, path = fsspec.core.url_to_fs(url, **options_for(url, so))
        path = path.rstrip("/")
        try:
            record = orjson.loads(fs.cat_file(f"{path}/{COMMIT}"))
        except (FileNotFoundError, NotADirectoryError):  # no folder, or a file in its place
            record = None
        except orjson.JSONDecodeError:
            record = {}
    if record is None:
        raise MergeError(f"{url}: no {COMMIT}, so not a finished tracefuse folder: a run is writing it now, one "
                         "stopped before it finished, or an older tracefuse wrote it; wait for that run to end, or "
                         "write the folder again")
    if not isinstance(record, dict) or record.get("tool") != "tracefuse_dask" \
            or not isinstance(record.get("files"), dict):
        raise MergeError(f"{url}: its {COMMIT} was not written by tracefuse; write the folder again")
    return Committed(url, fs, path, record, so)
