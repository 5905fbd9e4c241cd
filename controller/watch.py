"""A cheap "did the ledger change?" probe for polling loops.

On SQLite every commit writes the WAL file (or, after a checkpoint, the database file),
so a ``stat`` of both tells whether anything was committed since the last look: a few
microseconds and no database connection, which lets an idle daemon poll often and still
cost nothing. Elsewhere (PostgreSQL) it reads the newest event id.
"""

from __future__ import annotations

import os

from sqlalchemy import Engine

from controller import db


class ChangeWatch:
    """``changed()`` is True when something may have been committed since the last call
    (and on the first call). It may say True when nothing changed (a heartbeat, a
    checkpoint); it never says False after a commit."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        database = engine.url.database if db.is_sqlite(engine) else None
        self.paths = [database, database + "-wal"] if database else []
        self._seen: object = None

    def _signature(self) -> object:
        if not self.paths:
            from controller import ledger  # only for non-file ledgers

            with db.reader(self.engine)() as session:
                return ledger.latest_event_id(session)
        signature: list[tuple[int, int, int] | None] = []
        for path in self.paths:
            try:
                stat = os.stat(path)
            except FileNotFoundError:
                signature.append(None)
                continue
            signature.append((stat.st_ino, stat.st_size, stat.st_mtime_ns))
        return tuple(signature)

    def changed(self) -> bool:
        signature = self._signature()
        if signature == self._seen:
            return False
        self._seen = signature
        return True
