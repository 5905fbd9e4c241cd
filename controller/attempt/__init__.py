"""An attempt's files, judged once: what it left on disk (its exit record, result and
declared outputs) and what of that reaches the ledger (``judge_attempt``).

The floor under the services (docs/architecture.md, "Floors"): the worker, the
controller daemon, the evidence for unknown attempts and the operator's reconcile all
call ``judge_attempt``; nothing here touches the ledger. ``artifacts`` finds, stores
and fetches stage outputs.
"""

from laneway.controller.attempt.verdict import (
    Amend,
    Delivery,
    ExitRules,
    Judged,
    classify,
    judge_attempt,
)

__all__ = ["Amend", "Delivery", "ExitRules", "Judged", "classify", "judge_attempt"]
