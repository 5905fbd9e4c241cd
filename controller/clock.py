"""Where laneway reads the time. Ledger functions take ``now`` from a Clock; nothing
deep inside calls ``datetime.now()``.

All ledger timestamps are naive UTC. On SQLite the single host's clock is the
database's clock (every writer runs on that host); on PostgreSQL the lease clock will
be the server's ``now()``, read through this same seam.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Protocol


class Clock(Protocol):
    def now(self) -> datetime: ...


class SystemClock:
    """The host's wall clock, as naive UTC."""

    def now(self) -> datetime:
        return datetime.now(UTC).replace(tzinfo=None)


def iso(moment: datetime | None) -> str | None:
    return None if moment is None else moment.isoformat(timespec="milliseconds") + "Z"
