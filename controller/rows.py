"""The ``Rows`` source the read side's plain SQL runs over, and the readers of its values.

The status report and the other read-only looks are plain, dialect-neutral SQL over a
``Rows`` source (anything with ``rows(sql, params)``): ``laneway status`` reads a SQLite
ledger through the stdlib ``sqlite3`` (``readonly.ReadOnlyLedger``), without importing
SQLAlchemy, the models or the config's pydantic models; the controller and ``laneway run``
pass their ORM session (``SessionRows``). Timestamps come back as text on SQLite and as
datetimes elsewhere, JSON columns as text or as objects: ``_moment`` and ``_json`` take
either.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from collections.abc import Mapping

    from sqlalchemy.orm import Session


class Rows(Protocol):
    def rows(self, sql: str, params: Mapping[str, Any] | None = None) -> list[tuple[Any, ...]]: ...


class SessionRows:
    """``Rows`` over an ORM session (the controller's and ``laneway run``'s)."""

    def __init__(self, session: Session) -> None:
        self.session = session

    def rows(self, sql: str, params: Mapping[str, Any] | None = None) -> list[tuple[Any, ...]]:
        from sqlalchemy import text

        return [tuple(row) for row in self.session.execute(text(sql), dict(params or {}))]


def _moment(value: Any) -> datetime | None:
    if value is None or isinstance(value, datetime):
        return value
    return datetime.fromisoformat(str(value))


def _json(value: Any) -> Any:
    return json.loads(value) if isinstance(value, str | bytes) else value
