"""The streaming redactor, for the supervisor and the worker: it lives in
``controller/redact.py`` (closeout steps in the controller use it too; the controller
does not import ``workers``). Stdlib only, like the supervisor."""

from laneway.controller.redact import (
    MASK,
    MAX_LINE,
    MIN_SECRET_LEN,
    Redactor,
    encoded_forms,
    redact_json,
)

__all__ = ["MASK", "MAX_LINE", "MIN_SECRET_LEN", "Redactor", "encoded_forms", "redact_json"]
