"""Byte sizes as users write them (``"16GiB"``) and as messages print them: a leaf that the options (``config``) and
the planning both read."""

from __future__ import annotations

import re

from .errors import ConfigError

_UNITS = {"": 1, "b": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def parse_bytes(text: str) -> int:
    """``"16GiB"``, ``"512MiB"``, ``"1.5T"``, ``"1000B"`` -> bytes. KiB..TiB and bare K..T are powers of 1024, KB..TB
    of 1000. A unit is required (``"16"`` is refused), except for zero."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?)(b?)\s*", text.lower())
    if not m or (m.group(2, 3, 4) == ("", "", "") and float(m.group(1)) != 0):
        raise ConfigError(f"cannot read a byte size from {text!r}: "
                          "give a number and a unit, e.g. 16GiB, 512M, 80GB or 1000B")
    value, unit, binary, b = m.groups()
    scale = _UNITS[unit] if (binary or not b or not unit) else 1000 ** "bkmgt".index(unit)
    return int(float(value) * scale)


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"
