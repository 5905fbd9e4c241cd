"""One exception root for everything laneway tells a user.

Each subclass carries a message meant to be printed as one line: what is wrong, where,
and what to do about it. The CLI prints ``str(error)`` and never a traceback.
"""


class LanewayError(Exception):
    """Root of every error laneway raises on purpose."""

    exit_code = 1


class ConfigError(LanewayError):
    """The pipeline config is invalid; ``problems`` holds one line per problem."""

    exit_code = 2

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("; ".join(problems))


class UsageError(LanewayError):
    """A command-line argument is invalid (unknown run id, bad path, ...)."""

    exit_code = 2


class NoLedgerYet(UsageError):
    """Nothing is there yet where the ledger should be: no SQLite file, or a database
    without any table (one `start-pipeline` or `run` is about to migrate). Not raised for
    another application's database (``LedgerRevisionError``). Commands that wait
    (``status --watch``, ``worker``) wait on it; the others refuse. ``where``: the
    ledger's path, or its URL without the password."""

    def __init__(self, message: str, *, where: str) -> None:
        self.where = where
        super().__init__(message)


class PreflightError(LanewayError):
    """``start-pipeline`` refused: nothing was created. ``reasons`` lists why."""

    def __init__(self, reasons: list[str]) -> None:
        self.reasons = reasons
        super().__init__("; ".join(reasons))


class UnfinishedRun(LanewayError):
    """A new run was asked for while the ledger holds an unfinished run of the same
    pipeline: continue that one, or ask for a new run deliberately. ``reasons`` says how."""

    def __init__(self, reasons: list[str]) -> None:
        self.reasons = reasons
        super().__init__("; ".join(reasons))


class LedgerRevisionError(LanewayError):
    """The ledger's schema revision is one this build of laneway does not know."""


class NotFound(LanewayError):
    """A run, job or attempt id that is not in the ledger."""

    exit_code = 2


class IllegalTransition(LanewayError):
    """A compare-and-set found the row in another state than the transition expects."""


class StaleLease(IllegalTransition):
    """A write carried a fence token that is no longer the job's current one."""


class PartialWrite(LanewayError):
    """A write was refused after it had already written part of itself inside the
    transaction (``ledger.refused_before_writing``): the whole transaction must roll back,
    so it is not a ``StaleLease`` any caller may catch and go on from."""


class LedgerUnavailable(LanewayError):
    """The ledger could not be reached (or refused writes, or stayed locked) for longer
    than a command retries; nothing was written."""

    exit_code = 4


class CommitOutcomeUnknown(LedgerUnavailable):
    """The connection failed while a transaction was committing: it may or may not have
    been recorded, so it is not retried blindly."""
