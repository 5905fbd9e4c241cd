"""Nothing a job writes in its result JSON makes reading or settling its attempt raise
(issue 18, item 2 and item 14a).

Property-based (hypothesis) over hostile result.json files: huge and negative numbers,
integers of hundreds of digits, deep nesting (10000 levels of ``[``: Python's JSON reader
raises RecursionError), long strings, lone surrogates and NUL (JSON allows ``\\ud800``
and ``\\u0000``; PostgreSQL's text and jsonb hold neither), bytes that are not UTF-8, and
wrong types for every key laneway reads. Reading and classifying never raise; settling
commits on both backends, with the outcome and a diagnostic recorded.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from sqlalchemy import select

from laneway.controller import db, ledger, usage
from laneway.controller.attempt import classify
from laneway.controller.models import Attempt, AttemptUsage, Job
from laneway.controller.outcome import RESULT_MAX_BYTES, read_outcome
from laneway.controller.states import Outcome
from tests.support import claim_on_n1, make_config, mark_unknown_one, settle_one

JOB_ID = 42
CODES = {0: Outcome.SUCCEEDED, 75: Outcome.INFRA_FAILURE, 3: Outcome.FATAL}
SECRET = "sk-hostile-0b1e"
HUGE = 10**400  # 401 digits: float() and math.isfinite() raise OverflowError
NASTY_CHARS = ["\x00", "\ud800", "\udfff", "\udcff", "\n", "\u2028", "\ufffd"]

# -- strategies --------------------------------------------------------------------

characters = st.one_of(st.characters(), st.sampled_from(NASTY_CHARS))
strings = st.one_of(
    st.text(characters, max_size=20),
    st.sampled_from(["x" * 100_000, "cost_usd\n", "cost_usd\x00", "\ud800" * 3, "", SECRET]),
)
numbers = st.one_of(
    st.integers(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([HUGE, -HUGE, 10**4000, 2**63, -(2**63) - 1, 1e15, 1e15 + 1, 0, -0.0]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([1e308, -1e308, 5e-324, math.inf, -math.inf, math.nan]),
)
scalars = st.one_of(st.none(), st.booleans(), numbers, strings)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(strings, inner, max_size=4)
    ),
    max_leaves=12,
)
usage_objects = st.one_of(
    st.dictionaries(st.one_of(strings, st.sampled_from(["cost_usd", "calls"])), values),
    values,
)
job_ids = st.one_of(st.just(JOB_ID), st.just(str(JOB_ID)), values)
KNOWN_KEYS = {
    "job_id": job_ids,
    "usage": usage_objects,
    "infrastructure_failure": st.one_of(st.booleans(), values),
    "fatal_failure": st.one_of(st.booleans(), values),
    "outputs": values,
    "rate_limited": values,
}
results = st.one_of(
    st.fixed_dictionaries({}, optional=KNOWN_KEYS).flatmap(
        lambda known: st.dictionaries(strings, values, max_size=3).map(
            lambda extra: {**extra, **known}
        )
    ),
    values,  # not even an object
)


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


RAW_TEXTS = [
    nested(10_000),  # RecursionError in json.load before the fix
    "[" * 10_000,  # unclosed as well
    '{"a":' * 5_000 + "1" + "}" * 5_000,
    nested(usage.RESULT_MAX_DEPTH),
    nested(usage.RESULT_MAX_DEPTH + 1),
    nested(900),  # parses, but deeper than laneway keeps
    f'{{"job_id": {JOB_ID}, "usage": {{"cost_usd": {HUGE}}}}}',
    f'{{"job_id": {JOB_ID}, "usage": {{"cost_usd": -{HUGE}}}}}',
    f'{{"job_id": {JOB_ID}, "usage": {{"cost_usd": 1{"0" * 5000}}}}}',  # > 4300 digits
    f'{{"job_id": {JOB_ID}, "usage": {{"cost_usd": 1e400}}}}',  # inf once parsed
    f'{{"job_id": {JOB_ID}, "note": "\\u0000 and \\ud800", "k\\u0000": "\\udfff"}}',
    f'{{"job_id": {JOB_ID}, "usage": {{"cost_usd\\n": 5, "calls\\u0000": 1}}}}',
    f'{{"job_id": {JOB_ID}, "job_id": [1]}}',  # duplicate key: the last wins
    f'{{"job_id": {JOB_ID}, "x": NaN, "y": -Infinity}}',
    '{"job_id": 42',
    "",
    "null",
    "\x00",
]
texts = st.one_of(
    results.map(lambda value: json.dumps(value)),  # ensure_ascii: "\ud800", "\u0000" escapes
    st.sampled_from(RAW_TEXTS),
)
contents = st.one_of(
    texts.map(lambda text: text.encode("utf-8", "surrogatepass")),
    st.binary(max_size=64),  # not UTF-8, or not JSON
    st.sampled_from([b"\xff\xfe{}", b'{"job_id": 42, "s": "\xed\xa0\x80"}']),
)
exit_codes = st.sampled_from([0, 1, 3, 75])
EXAMPLES = itertools.count()

# -- reading and classifying -------------------------------------------------------


def write_attempt(directory: Path, content: bytes | None, exit_code: int = 0) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    record = {"exit_code": exit_code, "signal": None, "spawn_error": None, "log_errors": []}
    (directory / "exit.json").write_text(json.dumps(record))
    if content is not None:
        (directory / "result.json").write_bytes(content)


def no_unstorable(value: Any) -> bool:
    """True when no string or key anywhere in ``value`` holds NUL or a lone surrogate."""
    text = json.dumps(value, ensure_ascii=False, allow_nan=False)
    return "\x00" not in text and not any("\ud800" <= c <= "\udfff" for c in text)


def classify_dir(directory: Path, job_id: int, *, required: bool = False) -> Any:
    return classify(
        str(directory),
        job_id=job_id,
        exit_codes=CODES,
        result_requirement="required" if required else "optional",
        secrets=[SECRET],
        missing_exit="no exit.json",
    )


@settings(max_examples=300, deadline=None)
@given(content=contents, exit_code=exit_codes, required=st.booleans())
@example(content=nested(10_000).encode(), exit_code=0, required=False)
@example(content=RAW_TEXTS[6].encode(), exit_code=0, required=False)
def test_reading_and_classifying_a_hostile_result_never_raises(
    content: bytes, exit_code: int, required: bool
):
    with tempfile.TemporaryDirectory() as name:
        directory = Path(name)
        write_attempt(directory, content, exit_code)
        verdict, exit_record, result = classify_dir(directory, JOB_ID, required=required)
        stored, _ = usage.stored_result(result)
        kept, warnings = usage.read_usage(result)
    assert verdict.outcome is not None  # the exit record is whole: never unknown
    assert exit_record is not None and exit_record["exit_code"] == exit_code
    if verdict.outcome is Outcome.SUCCEEDED:
        assert result is not None and verdict.diagnostics == []
    if result is None:
        # Not an object of JSON laneway takes: a diagnostic says why, never success.
        assert verdict.outcome is not Outcome.SUCCEEDED
        assert verdict.diagnostics
    # Whatever was read is storable once stored_result has seen it, and says so once.
    assert no_unstorable(stored)
    assert usage.stored_result(stored) == (stored, [])
    for key, value in kept.items():
        assert usage.USAGE_KEY.fullmatch(key) and "\n" not in key
        assert math.isfinite(value) and 0 <= value <= usage.USAGE_MAX
    assert no_unstorable(warnings) and no_unstorable([*verdict.diagnostics, verdict.reason])


def test_a_401_digit_cost_is_a_warning_not_an_overflow():
    kept, warnings = usage.read_usage({"usage": {"cost_usd": HUGE, "calls": -HUGE, "ok": 2}})
    assert kept == {"ok": 2.0}
    assert "usage.cost_usd ignored: (an integer of about 401 digits) is more than 1e+15" in (
        warnings
    )
    assert "usage.calls ignored: (an integer of about 401 digits) is negative" in warnings
    # Past the cap but finite: still left out, so the ledger's sums cannot overflow.
    assert usage.read_usage({"usage": {"x": 1e300}})[0] == {}


def test_a_usage_key_with_a_trailing_newline_is_not_a_key():
    # `$` matched before a final newline: "cost_usd\n" was a key no budget names.
    kept, warnings = usage.read_usage({"usage": {"cost_usd\n": 5.0, "cost_usd": 1.0}})
    assert kept == {"cost_usd": 1.0}
    assert warnings == [
        "usage.'cost_usd\\n' ignored: a key is a name of letters, digits, '_', '.', '-' "
        "(at most 64)"
    ]


def test_usage_keeps_at_most_its_cap_of_keys_and_counts_the_warnings():
    raw = {f"k{i}": 1 for i in range(usage.USAGE_MAX_KEYS + 5)}
    raw.update({f"bad{i}": -1 for i in range(50)})
    kept, warnings = usage.read_usage({"usage": raw})
    assert len(kept) == usage.USAGE_MAX_KEYS
    assert len(warnings) == usage.USAGE_MAX_WARNINGS + 1
    assert warnings[-1] == f"usage: {55 - usage.USAGE_MAX_WARNINGS} more values ignored"


def test_a_result_nested_deeper_than_the_limit_is_invalid_with_a_diagnostic(tmp_path: Path):
    write_attempt(tmp_path, nested(10_000).encode())
    verdict, _, result = read_outcome(
        tmp_path, job_id=JOB_ID, exit_codes=CODES, missing_exit="no exit.json"
    )
    assert result is None and verdict.outcome is Outcome.FAILED
    assert verdict.diagnostics == [
        f"result.json is nested deeper than {usage.RESULT_MAX_DEPTH} levels"
    ]


def test_a_result_larger_than_the_cap_is_not_read(tmp_path: Path):
    write_attempt(tmp_path, b" " * (RESULT_MAX_BYTES + 1))
    verdict, _, result = read_outcome(
        tmp_path, job_id=JOB_ID, exit_codes=CODES, missing_exit="no exit.json"
    )
    assert result is None and verdict.outcome is Outcome.FAILED
    assert f"more than the {RESULT_MAX_BYTES} laneway reads" in verdict.diagnostics[0]


@pytest.mark.timeout(30)
def test_a_fifo_as_result_is_refused_without_blocking(tmp_path: Path):
    write_attempt(tmp_path, None)
    os.mkfifo(tmp_path / "result.json")  # open() for reading would wait for a writer
    verdict, _, result = read_outcome(
        tmp_path, job_id=JOB_ID, exit_codes=CODES, missing_exit="no exit.json"
    )
    assert result is None and verdict.outcome is Outcome.FAILED
    assert verdict.diagnostics == ["result.json is not a regular file (a FIFO)"]


@pytest.mark.parametrize(
    "record",
    [
        {"exit_code": HUGE},
        {"exit_code": 2**40},
        {"exit_code": "0"},
        {"exit_code": True},
        {"exit_code": None, "signal": 2**31},
        {"exit_code": 0, "spawn_error": ["x"]},
        {"exit_code": 0, "log_errors": "disk full"},
        {"exit_code": 0, "log_errors": [1]},
    ],
)
def test_an_exit_record_no_supervisor_writes_is_not_trusted(tmp_path: Path, record: Any):
    # The job can write its attempt directory: a value the ledger's integer columns
    # cannot hold (SQLite: OverflowError; PostgreSQL: out of range) is not settled.
    (tmp_path / "exit.json").write_text(json.dumps(record))
    verdict, exit_record, _ = read_outcome(
        tmp_path, job_id=JOB_ID, exit_codes=CODES, missing_exit="no exit.json"
    )
    assert exit_record is None and verdict.outcome is None
    assert verdict.reason.startswith("exit.json ")


def test_stored_result_replaces_what_no_backend_stores_and_says_so():
    value = {
        "a\x00": "x\ud800y",
        "a\ufffd": 1,
        "deep": json.loads(nested(usage.RESULT_MAX_DEPTH + 5)),
        "huge": 10**5000,
        "nan": math.nan,
        "set": {1},
    }
    stored, notes = usage.stored_result(value)
    assert stored["a\ufffd"] == "x\ufffdy" and stored["a\ufffd #2"] == 1
    assert stored["nan"] == "nan" and stored["set"] == "(a set)"
    assert stored["huge"] == "(an integer of about 5001 digits)"
    assert json.dumps(stored, allow_nan=False)
    assert [note.split(" ")[2] for note in notes] == [
        "strings",
        "keys",
        "integers",
        "values",
        "values",
    ]


# -- settling on the ledger (SQLite and PostgreSQL) -----------------------------------


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(content=contents, exit_code=exit_codes)
@example(content=RAW_TEXTS[6].encode(), exit_code=0)  # the 401-digit cost_usd
@example(content=RAW_TEXTS[10].encode(), exit_code=0)  # NUL and lone surrogates
@example(content=RAW_TEXTS[0].encode(), exit_code=0)  # 10000 levels of [
@example(content=b'{"job_id": 1, "usage": {"cost_usd\\n": 5, "calls": 1e300}}', exit_code=0)
def test_a_hostile_result_settles_with_its_outcome_and_diagnostics_recorded(
    factory: Any, make_run: Any, register_worker: Any, clock: Any, content: bytes, exit_code: int
):
    # An item of its own each time: a job succeeded in an earlier run would be reused.
    make_run(make_config(items=[{"key": f"item{next(EXAMPLES)}", "lane": "a"}]))
    (claimed,) = claim_on_n1(factory, register_worker(), clock)
    directory = Path(claimed.attempt_dir)
    # The job writes its own id when it writes one (the examples say 42 or 1).
    text = content.replace(b'"job_id": 42', f'"job_id": {claimed.job_id}'.encode())
    text = text.replace(b'"job_id": 1,', f'"job_id": {claimed.job_id},'.encode())
    write_attempt(directory, text, exit_code)
    verdict, exit_record, result = classify_dir(directory, claimed.job_id)
    assert verdict.outcome is not None
    with db.transaction(factory) as session:
        state = ledger.settle_from_verdict(
            session,
            claimed.attempt_id,
            fence=claimed.fence,
            verdict=verdict,
            exit_record=exit_record,
            result=result,
            actor="test",
            now=clock.now(),
        )
    stored, notes = usage.stored_result(result)
    kept, warnings = usage.read_usage(result)
    with factory() as session:
        attempt = session.get(Attempt, claimed.attempt_id)
        job = session.get(Job, claimed.job_id)
        rows = session.execute(
            select(AttemptUsage.key, AttemptUsage.value).where(
                AttemptUsage.attempt_id == claimed.attempt_id
            )
        ).all()
    assert attempt.state == "settled" and attempt.outcome == verdict.outcome.value
    assert job.state == state.value
    assert attempt.diagnostics == [*verdict.diagnostics, *notes, *warnings]
    assert attempt.result == json.loads(json.dumps(stored))
    assert dict(rows) == pytest.approx(kept)
    if result is None and content.strip():
        assert attempt.outcome != "succeeded" and attempt.diagnostics


def test_a_nul_and_a_lone_surrogate_settle_replaced_with_a_diagnostic(
    factory: Any, make_run: Any, register_worker: Any, clock: Any
):
    make_run()
    (claimed,) = claim_on_n1(factory, register_worker(), clock)
    result = {"job_id": claimed.job_id, "note": "a\x00b\ud800", "k\x00": 1}
    settle_one(
        factory,
        claimed,
        "test",
        clock,
        Outcome.SUCCEEDED,
        reason="quoted \x00 \udcff",
        result=result,
        diagnostics=["a diagnostic quoting \ud800"],
    )
    with factory() as session:
        attempt = session.get(Attempt, claimed.attempt_id)
    assert attempt.result == {"job_id": claimed.job_id, "note": "a\ufffdb\ufffd", "k\ufffd": 1}
    assert attempt.state_reason == "quoted \ufffd \ufffd"
    assert attempt.diagnostics == [
        "a diagnostic quoting \ufffd",
        "result: 2 strings held a NUL or an unpaired surrogate (each replaced by U+FFFD) "
        "to be storable",
    ]


def test_a_hostile_usage_counted_by_an_unknown_mark_never_raises(
    factory: Any, make_run: Any, register_worker: Any, clock: Any
):
    make_run()
    (claimed,) = claim_on_n1(factory, register_worker(), clock)
    usage = {"job_id": claimed.job_id, "usage": {"cost_usd": HUGE, "calls": 2}}
    mark_unknown_one(factory, claimed, clock, "lost \x00", fence=claimed.fence, result=usage)
    with factory() as session:
        attempt = session.get(Attempt, claimed.attempt_id)
        rows = session.execute(select(AttemptUsage.key, AttemptUsage.value)).all()
    assert attempt.state == "unknown" and attempt.state_reason == "lost \ufffd"
    assert dict(rows) == {"calls": 2.0}
