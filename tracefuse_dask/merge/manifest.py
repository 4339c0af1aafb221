"""``--skip-if-unchanged``: the manifest beside an output says what it was made from (inputs with their size
and etag or mtime, options, tool version; never credentials), so that a scheduled job can skip a merge
whose inputs have not changed."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import fsspec
import orjson

from .._version import __version__
from ..model import InputFile, MergeSummary
from ..storage.files import options_for, storage_errors
from ..storage.output import MANIFEST_SUFFIX
from .plan import MergeRequest

__all__ = ["manifest_of", "unchanged", "write_manifest"]


def manifest_of(files: list[InputFile], request: MergeRequest) -> dict[str, Any]:
    """What the output was made from: inputs (size and etag or mtime), options, tool version; no credentials."""
    ranks = request.ranks
    return {
        "tool": "tracefuse_dask",
        "version": __version__,
        "output": request.out,
        "inputs": [f.identity for f in files],
        "options": {**request.options.describe(), "ranks": ranks if ranks is None or isinstance(ranks, str)
                    else sorted(int(r) for r in request.subset), "rank_regex": request.rank_regex,
                    "gzip_members": request.gzip_members,
                    "on_error": request.on_error, "repair": request.repair, "align": request.align,
                    "format": request.format},
    }


def unchanged(out: str, manifest: dict[str, Any], so: Mapping[str, Any]) -> MergeSummary | None:
    """The summary of a run that has nothing to do, or None when the output must be (re)built."""
    with storage_errors(out, so):
        fs, out_path = fsspec.core.url_to_fs(out, **options_for(out, so))
        try:
            previous = orjson.loads(fs.cat(out_path + MANIFEST_SUFFIX))
            size = fs.size(out_path)
        except (FileNotFoundError, orjson.JSONDecodeError):
            return None
    # the output's size too: runs of other inputs that overlapped may have left one's output and another's manifest
    if not isinstance(previous, dict) or previous.pop("output_bytes", None) != size \
            or previous != orjson.loads(orjson.dumps(manifest)):
        return None
    return MergeSummary(ranks=len(manifest["inputs"]), skipped=[], events_in=0, events_out=0, bytes_in=0,
                        bytes_out=size, seconds=0.0, mb_per_s=0.0, output=out, status="unchanged",
                        warnings=[f"{out} is up to date: inputs, options and version as in "
                                  f"{out}{MANIFEST_SUFFIX}; nothing to do"])


def write_manifest(out: str, manifest: dict[str, Any], bytes_out: int, so: Mapping[str, Any]) -> None:
    """Write ``manifest`` beside the output ``out``, of ``bytes_out`` bytes."""
    with storage_errors(out + MANIFEST_SUFFIX, so):
        fs, out_path = fsspec.core.url_to_fs(out, **options_for(out, so))
        fs.pipe(out_path + MANIFEST_SUFFIX, orjson.dumps({**manifest, "output_bytes": bytes_out},
                                                         option=orjson.OPT_INDENT_2))
