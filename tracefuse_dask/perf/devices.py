"""The devices' peaks (``devices.json``: data, with the vendors' sources) and which device a trace ran on.

A ``--gpu-spec FILE.json`` of the same form adds devices or overrides them: its devices are tried first.
"""
from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from importlib import resources
from typing import Any

from ..errors import MergeError

__all__ = ["Device", "detect", "load_devices"]

_NARROW = frozenset({"fp16", "bf16", "fp8", "fp4"})


@dataclass(frozen=True)
class Device:
    """One device's peaks: TFLOP/s per unit (``matrix``, ``vector``) and precision, TB/s of memory, GB/s of links."""

    name: str
    matrix: dict[str, float]
    vector: dict[str, float]
    memory_tb_s: float
    link_gb_s: float | None
    source: str
    match: tuple[dict[str, Any], ...]

    def roof(self, unit: str, precision: str | None) -> tuple[str, float] | None:
        """The roof an op of ``unit`` at ``precision`` runs under: its name (``"matrix bf16"``, ``"vector fp32"``)
        and peak TFLOP/s. An fp32 matrix op on a device whose matrix units take TF32 and not fp32 (NVIDIA's) may
        run on them (PyTorch's allow_tf32, cuDNN's default for convolutions): its roof is the TF32 peak, the
        highest it can reach. Another matrix op at a precision the matrix units lack runs on the vector units; a
        vector op at a precision narrower than fp32 that the table does not list (the datasheets give few) gets
        the fp32 rate, which packed narrower types at least reach. None without a precision or a peak."""
        if precision is None:
            return None
        if unit == "matrix" and precision in self.matrix:
            return f"matrix {precision}", self.matrix[precision]
        if unit == "matrix" and precision == "fp32" and "tf32" in self.matrix:
            return "matrix tf32", self.matrix["tf32"]
        if precision in self.vector:
            return f"vector {precision}", self.vector[precision]
        if precision in _NARROW and "fp32" in self.vector:
            return "vector fp32", self.vector["fp32"]
        return None

    def fits(self, props: dict[str, Any]) -> bool:
        name = props.get("name") if isinstance(props.get("name"), str) else ""
        gib = props.get("totalGlobalMem") / 2**30 if isinstance(props.get("totalGlobalMem"), (int, float)) else None
        for m in self.match:
            if "name" in m and not re.search(m["name"], name, re.IGNORECASE):
                continue
            if "memory_gib" in m and (gib is None or not m["memory_gib"][0] <= gib <= m["memory_gib"][1]):
                continue
            if "sms" in m and props.get("numSms") != m["sms"]:
                continue
            return True
        return False


_TABLE = ('give {"devices": [{"name": ..., "match": [{"name": REGEX}], "matrix": {"bf16": TFLOPS}, "vector": '
          '{"fp32": TFLOPS}, "memory_tb_s": TB_S}]} as the package\'s perf/devices.json does')


def _devices(doc: Any, where: str) -> list[Device]:
    if not isinstance(doc, dict) or not isinstance(doc.get("devices"), list):
        raise MergeError(f'{where}: not a device table: it has no "devices" list at its top; {_TABLE}')
    out = []
    for i, d in enumerate(doc["devices"]):
        what = f'{where}: not a device table: device {i + 1} of {len(doc["devices"])}'
        if not isinstance(d, dict):
            raise MergeError(f"{what} is not an object; {_TABLE}")
        lacks = [k for k in ("name", "memory_tb_s") if k not in d]
        if lacks:
            raise MergeError(f'{what} ({d.get("name", "unnamed")}) has no "{lacks[0]}"; {_TABLE}')
        try:
            out.append(Device(d["name"], dict(d.get("matrix") or {}), dict(d.get("vector") or {}),
                              float(d["memory_tb_s"]), d.get("link_gb_s"), d.get("source", where),
                              tuple(d.get("match") or [{"name": re.escape(d["name"])}])))
        except (TypeError, ValueError):
            raise MergeError(f'{what} ({d["name"]}): "matrix" and "vector" map precisions to TFLOPS and '
                             f'"memory_tb_s" is a number; {_TABLE}') from None
    return out


@functools.lru_cache(maxsize=8)
def load_devices(gpu_spec: str | None = None) -> tuple[Device, ...]:
    """The package's devices, after those of the JSON file ``gpu_spec`` (which win)."""
    own = _devices(json.loads(resources.files(__package__).joinpath("devices.json").read_text()), "devices.json")
    if gpu_spec is None:
        return tuple(own)
    try:
        with open(gpu_spec, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise MergeError(f"--gpu-spec {gpu_spec}: cannot read the file ({e.strerror or e}); give the path of a "
                         "JSON device table") from None
    try:
        extra = json.loads(text)
    except ValueError as e:
        raise MergeError(f"--gpu-spec {gpu_spec}: not JSON (line {e.lineno}, column {e.colno}: {e.msg}); "
                         f"{_TABLE}") from None
    return tuple(_devices(extra, gpu_spec) + own)


def detect(properties: Any, devices: tuple[Device, ...]) -> tuple[Device | None, str]:
    """The device of a trace's ``deviceProperties`` (its first GPU), and what it is called in the trace."""
    props = properties[0] if isinstance(properties, list) and properties and isinstance(properties[0], dict) else {}
    called = props.get("name") if isinstance(props.get("name"), str) else ""
    return next((d for d in devices if d.fits(props)), None), called
