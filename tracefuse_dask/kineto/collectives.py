"""How a Kineto trace names collectives and their process groups: one spelling per collective op, a group's
ranks as a rank spec, the bytes of an element of each dtype."""
from __future__ import annotations

import functools
import re
from typing import Any

import orjson

from ..model import RankSet
from .vocabulary import COLLECTIVE_OP_PREFIXES

__all__ = ["ITEMSIZE", "canonical_op", "group_members", "group_spec"]

_OP_SUFFIX = re.compile(r"(base|single|intotensor|tensor|coalesced|out)$")
_SYMM_MEM_ALGORITHM = re.compile(r"^(multimem|oneshot|twoshot)+")  # symm_mem::multimem_all_reduce_: allreduce

# bytes per element of each dtype name, as the profiler (c10 names) and torch (``torch.float32``) write them
ITEMSIZE = {"float": 4, "float32": 4, "bfloat16": 2, "half": 2, "float16": 2, "double": 8, "float64": 8,
            "int": 4, "int32": 4, "long": 8, "int64": 8, "short": 2, "int16": 2, "char": 1, "byte": 1,
            "int8": 1, "uint8": 1, "uint16": 2, "uint32": 4, "uint64": 8, "bool": 1, "signed char": 1,
            "unsigned char": 1, "float8_e4m3fn": 1, "float8_e5m2": 1, "complexfloat": 8, "complexdouble": 16,
            "complex64": 8, "complex128": 16}

_OP_PREFIX = re.compile("^(" + "|".join(map(re.escape, COLLECTIVE_OP_PREFIXES)) + ")")


def canonical_op(name: str) -> str:
    """One spelling per collective: ``c10d::allreduce_``, ``nccl:all_reduce``, ``symm_mem::multimem_all_reduce_``
    and ``allreduce`` are ``allreduce``."""
    s = _SYMM_MEM_ALGORITHM.sub("", _OP_PREFIX.sub("", name).lower().replace("_", ""))
    while (t := _OP_SUFFIX.sub("", s)) != s and t:
        s = t
    return s


def group_spec(ranks: Any) -> str | None:
    """A group's global ranks as a rank spec (``0-63:8``, see ``RankSet.of``), from a list or its JSON text.

    ``Process Group Ranks`` lists every rank of a group, so its text grows with the world size
    (59 kB for 10,000 ranks, on every call of every rank); the spec stays a few bytes.
    None when ``ranks`` is not a list of ranks.
    """
    if isinstance(ranks, str):
        return _text_spec(ranks)
    try:
        return RankSet.of(ranks).spec
    except (TypeError, ValueError):  # not a list of ranks (TypeError: not a list at all)
        return None


@functools.lru_cache(maxsize=256)
def _text_spec(text: str) -> str | None:
    """``group_spec`` of a list's JSON text, once per text and process: every call of a group has the same."""
    try:
        ranks = orjson.loads(text)
    except orjson.JSONDecodeError:
        return None
    return None if isinstance(ranks, str) else group_spec(ranks)


@functools.lru_cache(maxsize=64)
def group_members(spec: str) -> frozenset[int]:
    """The ranks of a group's rank spec (``group_spec``), once per spec and process: every call and rank
    of a group has the same. Raises ``ValueError`` when ``spec`` is not a rank spec."""
    return frozenset(RankSet.parse(spec).ranks())


