"""controller/ids.py: an id is ASCII digits, 0 < id < 2**31, at every place that takes
one (issue 18, item 14: U+0661 was read as id 1, U+00B2 raised a traceback)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from laneway.controller import logs, web
from laneway.controller.errors import LanewayError, UsageError
from laneway.controller.ids import ID_LIMIT, parse_id

ARABIC_ONE, SUPERSCRIPT_TWO = "\u0661", "\u00b2"
NOT_WRITTEN_AS_IDS = [
    *(ARABIC_ONE, SUPERSCRIPT_TWO, "\u0661\u0662", "\u06f3", "1\u0661", "\U0001d7cf"),
    *("", "1.0", "-1", "+1", " 1", "1\n", "0x1", "a"),
]


@pytest.mark.parametrize("text", NOT_WRITTEN_AS_IDS)
def test_anything_but_ascii_digits_is_not_an_id(text: str):
    assert parse_id(text) is None


@pytest.mark.parametrize("text", ["0", "000", str(ID_LIMIT), "9" * 20, "1" * 5000])
def test_digits_no_id_can_be_are_refused_in_words(text: str):
    with pytest.raises(UsageError, match="not an id") as caught:
        parse_id(text)
    assert len(str(caught.value)) < 120  # a 5000-digit argument is not echoed whole


@pytest.mark.parametrize(
    ("text", "number"), [("1", 1), ("007", 7), (str(ID_LIMIT - 1), ID_LIMIT - 1)]
)
def test_ids(text: str, number: int):
    assert parse_id(text) == number


@given(st.text())
def test_parse_id_never_raises_anything_but_a_usage_error(text: str):
    try:
        number = parse_id(text)
    except UsageError:
        assert text.isascii() and text.isdigit()
        return
    if number is not None:
        assert text.isascii() and text.isdigit() and 0 < number < ID_LIMIT


class NoRows:
    """A ``Rows`` that fails the test if anything is looked up: the text is refused first."""

    def rows(self, sql: str, params: dict[str, Any] | None = None) -> list[Any]:
        raise AssertionError(f"looked up {sql}")


@pytest.mark.parametrize("text", [ARABIC_ONE, SUPERSCRIPT_TWO])
def test_logs_and_web_and_cli_take_no_unicode_digit_for_an_id(text: str):
    from laneway.cli.common import job_id as _job_id

    # Before: U+0661 was attempt/job 1; U+00B2 raised ValueError out of int().
    with pytest.raises(UsageError):
        logs.resolve(NoRows(), text)  # type: ignore[arg-type]
    with pytest.raises(UsageError):
        logs.resolve(NoRows(), text, job=True)  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="give an id"):
        web._id({"attempt": text}, "attempt")
    with pytest.raises(UsageError):
        _job_id(None, text, None)


def test_run_continue_reads_a_unicode_digit_as_a_config_path(engine: Any, tmp_path: Any):
    from laneway.controller.foreground import run_to_continue as _run_to_continue

    # Before: U+0661 was run 1 (here: no such run); now it names a file, which is missing.
    with pytest.raises(LanewayError) as caught:
        _run_to_continue(engine, ARABIC_ONE)
    assert "run 1" not in str(caught.value)
