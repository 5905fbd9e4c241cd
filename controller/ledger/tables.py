"""The ledger's tables as Core ``Table`` objects, for statements that need no ORM.

Hot-path statements (``controller.ledger.statements``) are built on these: a Core
statement with bind parameters compiles once and runs without building entities.
"""

from __future__ import annotations

from sqlalchemy import Table

from laneway.controller.models import (
    Artifact,
    Attempt,
    AttemptInput,
    AttemptUsage,
    Control,
    ControllerRow,
    Decision,
    Event,
    GroupStats,
    Item,
    Job,
    Lane,
    Lease,
    Node,
    NodeLowWater,
    Notification,
    NotificationDelivery,
    Reservation,
    Run,
    StageStats,
    UsageTotal,
    Worker,
)


def _table(model: type) -> Table:
    table = model.__table__  # type: ignore[attr-defined]
    assert isinstance(table, Table)
    return table


artifacts = _table(Artifact)
attempts = _table(Attempt)
attempt_inputs = _table(AttemptInput)
attempt_usage = _table(AttemptUsage)
controls = _table(Control)
decisions = _table(Decision)
events = _table(Event)
items = _table(Item)
jobs = _table(Job)
lanes = _table(Lane)
leases = _table(Lease)
nodes = _table(Node)
node_low_water = _table(NodeLowWater)
reservations = _table(Reservation)
runs = _table(Run)
stage_stats = _table(StageStats)
group_stats = _table(GroupStats)
usage_totals = _table(UsageTotal)
workers = _table(Worker)
controllers = _table(ControllerRow)
notifications = _table(Notification)
notification_deliveries = _table(NotificationDelivery)
