"""Quantities in words for people (light: the CLI's text and the report's HTML use it)."""

from __future__ import annotations

_UNITS = ("KiB", "MiB", "GiB", "TiB", "PiB")


def byte_size(count: int | float) -> str:
    """``count`` bytes in binary units: ``512 B``, ``1.5 KiB``, ``12.3 GiB``."""
    if count < 1024:
        return f"{int(count)} B"
    value = float(count)
    for unit in _UNITS:
        value /= 1024
        if value < 1024 or unit == _UNITS[-1]:
            return f"{value:.1f} {unit}"
    raise AssertionError("unreachable")
