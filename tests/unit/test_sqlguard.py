"""controller/sqlguard.py's refusals by name, for every role: the advisory-lock
functions and the functions that run SQL given as text are refused before anything is
sent to the server, however the name is spelled (case, quotes, a schema); words that
only look like them are not."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from laneway.controller import sqlguard
from laneway.controller.errors import UsageError

pytestmark = pytest.mark.no_ledger

LOCKS = [
    "pg_advisory_lock",
    "pg_advisory_xact_lock",
    "pg_advisory_xact_lock_shared",
    "pg_try_advisory_lock",
    "pg_try_advisory_xact_lock_shared",
    "pg_advisory_unlock_all",
]
SQL_TEXT = [
    "query_to_xml",
    "query_to_xmlschema",
    "query_to_xml_and_xmlschema",
    "cursor_to_xml",
    "cursor_to_xmlschema",
    "ts_stat",
    "ts_rewrite",
    "dblink",
    "dblink_exec",
]


class Sent(Exception):
    """The guard reached the connection: the name check let the query through."""


class Unreachable:
    """A connection that must not be used."""

    def cursor(self) -> Any:
        raise Sent


def run(query: str) -> None:
    sqlguard.run_query(Unreachable(), query, timeout_s=1.0, allow_privileged=False)


def spelled(draw: st.DrawFn, name: str) -> str:
    """``name`` as PostgreSQL takes it: any case, maybe quoted, maybe schema-qualified."""
    cased = "".join(c.upper() if draw(st.booleans()) else c for c in name)
    quoted = f'"{cased}"' if draw(st.booleans()) else cased
    return ("pg_catalog." if draw(st.booleans()) else "") + quoted


@st.composite
def refused(draw: st.DrawFn, names: list[str]) -> tuple[str, str]:
    name = draw(st.sampled_from(names))
    before = draw(
        st.sampled_from(["SELECT ", "SELECT 1, ", "SELECT * FROM ", "WITH a AS (SELECT "])
    )
    between = draw(st.sampled_from(["(", " (", "/**/(", "\n("]))
    return name, f"{before}{spelled(draw, name)}{between}'x', true, false, '') AS x"


@given(refused(LOCKS))
def test_an_advisory_lock_is_refused_unsent_however_spelled(case):
    _name, query = case
    with pytest.raises(UsageError) as caught:
        run(query)
    message = str(caught.value)
    assert "\n" not in message and "advisory" in message.lower()
    assert "nothing was run" in message


@given(refused(SQL_TEXT))
def test_a_function_that_runs_sql_text_is_refused_unsent_however_spelled(case):
    name, query = case
    with pytest.raises(UsageError) as caught:
        run(query)
    message = str(caught.value)
    assert "\n" not in message and "runs SQL given as text" in message
    assert name.split("_")[0] in message.lower() and "nothing was run" in message


WORDS = ["SELECT", "query", "xml", "to", "ts", "stat", "cursor", "advisory", "lock", "db"]
WORDS += ["link", "pg", "rewrite", "jobs", "FROM", "(", ")", ",", "'x'", "1"]


@given(st.lists(st.sampled_from(WORDS), max_size=12))
def test_words_that_only_look_like_them_reach_the_server(words):
    """Not one name: the pieces apart, or inside a longer name."""
    query = " ".join(["SELECT", *words])
    with pytest.raises(Sent):
        run(query)


@given(st.sampled_from(LOCKS + SQL_TEXT))
def test_a_name_inside_a_longer_one_is_not_refused(name):
    with pytest.raises(Sent):
        run(f"SELECT my_{name} FROM jobs")
