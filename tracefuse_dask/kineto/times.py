"""Kineto's times: µs numbers as exact integer nanoseconds, and back to Kineto's text.

Kineto writes ``ts`` and ``dur`` in µs with three decimals (``%d.%03d``). The merge and the
analysis both compute in exact integer ns, so that shifting a rank never moves an event by a
rounding error.
"""
from __future__ import annotations

from decimal import ROUND_HALF_EVEN, Decimal
from typing import Annotated, Any

import numpy as np
import orjson
from msgspec import Meta

__all__ = ["EXACT_FLOAT", "EXACT_NS", "MAX_US", "Duration", "Micros", "fmt_us", "to_ns", "to_ns_array", "us_text"]

EXACT_FLOAT = float(1 << 43)  # below this a float's µs fraction still resolves 1 ns
EXACT_NS = (1 << 43) * 1000
MAX_US = 2**63 // 1000  # ns must fit Perfetto's int64


def to_ns(value: Any) -> int:
    """Exact integer nanoseconds of a µs value as Kineto writes it (``%d.%03d``).

    ``round(v * 1000)`` is off by 1 ns for about 1% of real values; this is not.
    Below 2**43 µs (101 days) the float's fractional part is exact and within
    0.49 ns of the decimal text, so rounding the fraction alone is exact; above
    it, the shortest repr of the float is used.
    """
    t = type(value)
    if t is int:
        return value * 1000
    if t is float:
        if -EXACT_FLOAT < value < EXACT_FLOAT:
            i = int(value)
            return i * 1000 + round((value - i) * 1000)
        if value != value or value in (float("inf"), float("-inf")):
            raise ValueError("not a finite number")
        return int((Decimal(repr(value)) * 1000).to_integral_value(ROUND_HALF_EVEN))
    raise TypeError(f"expected a number, got {t.__name__}")


def to_ns_array(us: np.ndarray) -> np.ndarray:
    """``to_ns`` of every value of a float64 array, as int64.

    Below 2**43 µs ``to_ns``'s float rule runs as array operations, which round as
    Python's do. Above it, a whole number of µs below 2**53 (the integer ``ts`` of Kineto
    before 2023, absolute µs, read as floats) is that integer, as its shortest repr says:
    the same operations are exact for it. The rare other larger values go through ``to_ns``.
    """
    whole = np.trunc(us)
    ns = whole.astype(np.int64) * 1000 + np.rint((us - whole) * 1000).astype(np.int64)
    big = np.flatnonzero((np.abs(us) >= EXACT_FLOAT) & ((us != whole) | (np.abs(us) >= 2.0**53)))
    if len(big):
        ns[big] = [to_ns(v) for v in us[big].tolist()]
    return ns


def us_text(ns: int) -> bytes:
    """Nanoseconds as µs text with exactly three decimals, Kineto's ``fmtTs``."""
    return b"%d.%03d" % divmod(ns, 1000)


def fmt_us(ns: int) -> orjson.Fragment:
    """``us_text`` as a value orjson writes as it is."""
    return orjson.Fragment(us_text(ns))


# The times the general path accepts: µs within ±2**63 ns, durations not negative.
Micros = Annotated[int, Meta(gt=-MAX_US, lt=MAX_US)] | Annotated[float, Meta(gt=-MAX_US, lt=MAX_US)]
Duration = Annotated[int, Meta(ge=0, lt=MAX_US)] | Annotated[float, Meta(ge=0, lt=MAX_US)]
