"""The usage part of ``laneway report``'s text (``controller.spend`` builds it)."""

from __future__ import annotations

from typing import Any


def _pairs(values: dict[str, Any]) -> str:
    shown = [f"{key} {value:g}" for key, value in values.items() if value is not None]
    return ", ".join(shown) or "-"


def usage_lines(usage: dict[str, Any] | None) -> list[str]:
    """Per lane and stage: totals, per succeeded item, yield per hour, missing usage."""
    if not usage:
        return []
    out = [f"usage: {_pairs(usage['totals'])}"]
    for scope in ("lanes", "stages"):
        for name, part in usage[scope].items():
            line = (
                f"  {scope[:-1]} {name}: {_pairs(part['totals'])}; per succeeded "
                f"({part['succeeded']}): {_pairs(part['per_succeeded'])}; per hour: "
                f"{_pairs(part['yield_per_hour'])}"
            )
            if part["missing_usage"]:
                line += f"; {part['missing_usage']} attempt(s) without usage"
            out.append(line)
    missing = usage["missing_usage"]
    if missing["count"]:
        listed = ", ".join(
            f"{a['attempt_id']} ({a['item']}.{a['stage']}, {a['outcome']})"
            for a in missing["attempts"]
        )
        out.append(f"attempts without usage ({missing['count']}): {listed}")
    return out
