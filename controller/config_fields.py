"""The config's field types: the patterns names and keys follow, the strict-number
validators every integer and float of a config goes through, and the one base model
(``Strict``: unknown keys refused, instances frozen).

A number is never read from text or a boolean (``"60"`` and ``true`` are refused, not
read as 60 and 1), and every integer fits a ledger column (controller/limits.py). The
secret patterns (``SECRET_NAME``, ``SECRET_LITERAL``, ``ENV_REF``) are the vocabulary of
the secret rule, which the stage and notify models apply (controller/config_models.py
says the rule).
"""

from __future__ import annotations

import math
import re
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field

from laneway.controller import limits

KEY_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$"
"""Item keys become directory names: no slash, no leading dot, so never ``..``."""
NAME_PATTERN = r"^[a-z][a-z0-9_-]{0,62}$"
ENV_NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*$"
ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
SECRET_NAME = re.compile(
    r"(^|_)(API_?KEY|KEY|TOKEN|SECRET|PASS|PASSWORD|PASSWD|CREDENTIALS?|AUTH|AUTHORIZATION)(_|$)",
    re.IGNORECASE,
)
SECRET_LITERAL = re.compile(
    r"(?i:bearer\s+[A-Za-z0-9._~+/-]{8,})|\bsk-[A-Za-z0-9_-]{16,}|\bghp_[A-Za-z0-9]{20,}"
    r"|\bAKIA[0-9A-Z]{16}\b|\bxox[abp]-[A-Za-z0-9-]{10,}"
)
PATTERN_HELP = {
    KEY_PATTERN: "use letters, digits, '_', '.', '-' (at most 128), starting with a letter or "
    "digit; no slashes",
    NAME_PATTERN: "use lowercase letters, digits, '_', '-' (at most 63), starting with a letter",
    ENV_NAME_PATTERN: "use letters, digits and '_', not starting with a digit",
}


def _ledger_int(value: int) -> int:
    problem = limits.int_problem(value)
    if problem:
        raise ValueError(problem)
    return value


def _mebibytes(value: float) -> float:
    if value >= limits.MAX_MIB:
        raise ValueError(f"{value:g} MiB is too large: a size is below 2**43 MiB (2**63 bytes)")
    return value


def check_text(value: str) -> str:
    """``value`` unchanged if it can reach an argv, a path or an environment (no NUL, no
    lone surrogate: controller/limits.py); else the ValueError pydantic reports."""
    problem = limits.text_problem(value)
    if problem:
        raise ValueError(problem)
    return value


def _whole_number(value: Any) -> Any:
    """A number where an integer is meant, never text or a boolean (``"60"`` and
    ``true`` are refused, not read as 60 and 1); a float only when it is whole and fits
    the ledger (``1e308`` is named as the number it is)."""
    _no_text_or_boolean(value, "a whole number")
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{value} is not a finite number; give a whole number")
        if not value.is_integer():
            raise ValueError(f"{value:g} is not a whole number; give one without a fraction")
        if not limits.LEDGER_INT_MIN <= value <= limits.LEDGER_INT_MAX:
            raise ValueError(
                f"{value:g} does not fit the ledger, which stores integers from "
                f"{limits.LEDGER_INT_MIN} to {limits.LEDGER_INT_MAX}"
            )
        return int(value)
    return value


def _real_number(value: Any) -> Any:
    """A number where a number is meant, never text or a boolean (``cost_usd = true``
    is refused, not read as a budget of 1)."""
    _no_text_or_boolean(value, "a number")
    if isinstance(value, int) and not -(10**308) <= value <= 10**308:
        raise ValueError(f"a {value.bit_length()}-bit integer is not a usable number")
    return value


def _no_text_or_boolean(value: Any, wanted: str) -> None:
    if isinstance(value, bool):
        raise ValueError(f"{str(value).lower()} is a boolean, not {wanted}; give {wanted}")
    if isinstance(value, str):
        shown = value if len(value) <= 40 else value[:40] + "…"
        raise ValueError(f"{shown!r} is text, not {wanted}; write {wanted} without quotes")
    if not isinstance(value, int | float):
        raise ValueError(f"give {wanted}, not {_kind_of(value)}")


def _kind_of(value: Any) -> str:
    kinds: list[tuple[type, str]] = [(list, "a list"), (dict, "a table"), (type(None), "nothing")]
    return next((words for kind, words in kinds if isinstance(value, kind)), "that")


LedgerInt = Annotated[int, BeforeValidator(_whole_number), AfterValidator(_ledger_int)]
"""Every integer a config gives: a number (never text or a boolean) that every ledger
column stores (controller/limits.py). A validator, not ``Field(ge=..., le=...)``: a
field's own ``Field(ge=0)`` would replace a bound of the same kind given here."""
ExitCode = Annotated[int, AfterValidator(_ledger_int)]
"""An exit code, a key of ``exit_codes``: a key is text in TOML and JSON (``"3"``)."""
Finite = Annotated[float, BeforeValidator(_real_number), Field(allow_inf_nan=False)]
"""Every float a config gives: a number (never text or a boolean); nan and inf are
refused (they pass any range check)."""
Mebibytes = Annotated[
    float,
    BeforeValidator(_real_number),
    Field(allow_inf_nan=False),
    AfterValidator(_mebibytes),
]
"""A size in MiB whose byte count fits the ledger (``log_cap_mib``, ``capture.max_mib``)."""
Text = Annotated[str, AfterValidator(check_text)]
"""Free text that reaches an argv, a path or an environment: no NUL, no lone surrogate."""
Name = Annotated[str, Field(pattern=NAME_PATTERN)]
NAME_RE = re.compile(NAME_PATTERN)
Key = Annotated[str, Field(pattern=KEY_PATTERN)]


def _output_name(value: str) -> str:
    """A declared output: a file name or glob relative to the workspace, inside it."""
    if not value or "\0" in value or len(value) > 1024:
        raise ValueError("an output is a non-empty file name or glob of at most 1024 characters")
    if value.startswith("/") or ".." in value.split("/") or "\\" in value:
        raise ValueError(
            f"{value!r} must be relative to the attempt's workspace, without '..' or "
            "backslashes (e.g. answer.json or shards/*.jsonl)"
        )
    return value


OutputName = Annotated[str, AfterValidator(_output_name)]
USAGE_KEY_PATTERN = r"^[A-Za-z][A-Za-z0-9_.-]{0,63}$"
PATTERN_HELP[USAGE_KEY_PATTERN] = (
    "a usage key uses letters, digits, '_', '.', '-' (at most 64), starting with a letter"
)
UsageKey = Annotated[str, Field(pattern=USAGE_KEY_PATTERN)]
AMOUNT_MAX = 1e15
"""The largest budget or expected usage, so that sums over many attempts stay finite."""
Amount = Annotated[
    float, BeforeValidator(_real_number), Field(ge=0, le=AMOUNT_MAX, allow_inf_nan=False)
]
PRIORITY_MAX = 1_000_000_000
"""An item's priority is an integer in [-PRIORITY_MAX, PRIORITY_MAX]."""
Budget = dict[UsageKey, Amount]
"""Usage key -> most the run (or stage) may spend, e.g. ``budget = { cost_usd = 50 }``."""


class Strict(BaseModel):
    """The base of every config table but an item: unknown keys are refused (a misspelt
    field is an error, not ignored) and a validated config is frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True)
