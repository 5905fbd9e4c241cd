"""What a ledger id looks like where a person types one (CLI arguments, dashboard queries).

One rule for every place that takes an id: ASCII digits only, and 0 < id < 2**31 (the
ledger's id columns are INTEGER, 4 bytes on PostgreSQL: a larger number would reach the
database and fail there instead of being refused here). ``str.isdigit`` is not that
rule: it accepts U+0661 (Arabic-Indic one, which ``int`` reads as 1) and U+00B2
(superscript two, which ``int`` refuses), so an id check built on it lets a name through
as a number, or raises a traceback.
"""

from __future__ import annotations

from laneway.controller.errors import UsageError

ID_LIMIT = 2**31
"""Ids are below this (signed 32-bit INTEGER id columns on PostgreSQL)."""

_ASCII_DIGITS = frozenset("0123456789")


def parse_id(text: str) -> int | None:
    """The id ``text`` is written as, or None when it is not written as a number (so the
    caller may read it as a name, e.g. ``ITEM.STAGE``). UsageError when it is a number
    that no id can be (0, or 2**31 and above)."""
    if not text or not _ASCII_DIGITS.issuperset(text):
        return None
    if len(text.lstrip("0")) > len(str(ID_LIMIT)) or not 0 < int(text) < ID_LIMIT:
        shown = text if len(text) <= 24 else text[:21] + "..."
        raise UsageError(f"{shown}: not an id (an id is a number from 1 to {ID_LIMIT - 1})")
    return int(text)
