"""Human-readable numbers in the flops profiler's printed units (K, M, G, T; m, u below one).

The profile text is read by people and parsed by tools written against DeepSpeed's output, so
the unit letters, the rounding (two decimals, trailing zeros dropped with `:g`) and the suffixes
(`MACs`, `FLOPS`, `s`, `B` for billions of parameters) are kept as DeepSpeed prints them."""
from __future__ import annotations

from typing import Optional

DEFAULT_PRECISION = 2

_SCALE = {"T": 1e12, "G": 1e9, "M": 1e6, "K": 1e3, "m": 1e-3, "u": 1e-6}


def _auto_unit(num: float) -> str:
    for unit in ("T", "G", "M", "K"):
        if num >= _SCALE[unit]:
            return unit
    if num >= 1 or num == 0:
        return ""
    return "m" if num >= 1e-3 else "u"


def number_to_string(num: float, units: Optional[str] = None, precision: int = DEFAULT_PRECISION) -> str:
    unit = _auto_unit(num) if units is None else units
    magnitude = _SCALE.get(unit, 1)
    return f"{round(num / magnitude, precision):g} {unit}"


def macs_to_string(macs: float, units: Optional[str] = None, precision: int = DEFAULT_PRECISION) -> str:
    return number_to_string(macs, units=units, precision=precision) + "MACs"


def flops_to_string(flops: float, units: Optional[str] = None, precision: int = DEFAULT_PRECISION) -> str:
    return number_to_string(flops, units=units, precision=precision) + "FLOPS"


def bytes_to_string(b: float, units: Optional[str] = None, precision: int = DEFAULT_PRECISION) -> str:
    return number_to_string(b, units=units, precision=precision) + "B"


def params_to_string(params_num: float, units: Optional[str] = None, precision: int = DEFAULT_PRECISION) -> str:
    # parameters are counted in billions ("B"), not giga
    unit = units.replace("B", "G") if units else units
    return number_to_string(params_num, units=unit, precision=precision).replace("G", "B").strip()


def duration_to_string(duration: float, units: Optional[str] = None, precision: int = DEFAULT_PRECISION) -> str:
    return number_to_string(duration, units=units, precision=precision) + "s"
