"""The dashboard's addresses (controller/web_links.py): every name part URL-quoted, so an
odd item key survives a paste and reads back as itself; ``route`` is the inverse the
server serves the page by; ``LANEWAY_WEB_URL`` is read, checked (one line naming it) and
joined without a doubled slash."""

from __future__ import annotations

import pytest

from laneway.controller import web_links
from laneway.controller.errors import UsageError
from laneway.controller.web_links import Route


def test_the_scheme():
    assert web_links.run_path(3) == "/runs/3"
    assert web_links.job_path(3, "i07", "solve") == "/runs/3/jobs/i07.solve"
    assert web_links.explain_path(3, "i07", "solve") == "/runs/3/explain/i07.solve"
    assert web_links.attempt_path(42) == "/attempts/42"


@pytest.mark.parametrize(
    ("item", "quoted"),
    [
        ("a/b", "a%2Fb"),
        ("x y?#&", "x%20y%3F%23%26"),
        ("v1.2.3", "v1.2.3"),  # dots stay: the stage is after the last one
        ("..", ".."),
        ("100%", "100%25"),
        ("é", "%C3%A9"),
        ("it's(1)*!", "it%27s%281%29%2A%21"),
    ],
)
def test_odd_item_names_are_quoted_and_read_back(item: str, quoted: str):
    path = web_links.job_path(7, item, "solve")
    assert path == f"/runs/7/jobs/{quoted}.solve"
    assert web_links.route(path) == Route("job", run_id=7, job=f"{item}.solve")
    explain = web_links.explain_path(7, item, "solve")
    assert web_links.route(explain) == Route("explain", run_id=7, job=f"{item}.solve")


def test_route_reads_the_scheme_and_nothing_else():
    assert web_links.route("/runs/3") == Route("run", run_id=3)
    assert web_links.route("/attempts/42") == Route("attempt", attempt_id=42)
    assert web_links.route("/runs/3/jobs/12") == Route("job", run_id=3, job="12")
    for path in (
        "/",
        "/runs",
        "/runs/",
        "/runs/0",
        "/runs/x",
        "/runs/3/",
        "/runs/3/jobs",
        "/runs/3/jobs/",
        "/runs/3/jobs/nodot",
        "/runs/3/jobs/.solve",
        "/runs/3/jobs/i07.",
        "/runs/3/jobs/%FF.solve",  # not UTF-8
        "/runs/3/jobs/a.b/c",
        "/runs/3/other/a.b",
        "/attempts/",
        "/attempts/-1",
        "/attempts/1/2",
        "/api/state",
        "//runs/3",
        "runs/3",
    ):
        assert web_links.route(path) is None, path


def test_the_base_url_comes_from_the_environment():
    env = web_links.ENV
    assert web_links.base_url({}) is None
    assert web_links.base_url({env: "  "}) is None
    assert web_links.link("/runs/3", {}) is None
    assert web_links.base_url({env: "http://host:8080"}) == "http://host:8080"
    assert web_links.base_url({env: "https://host/"}) == "https://host"
    assert web_links.link("/runs/3", {env: "http://host:8080/"}) == "http://host:8080/runs/3"
    assert (
        web_links.link(web_links.attempt_path(42), {env: "http://[::1]:8470"})
        == "http://[::1]:8470/attempts/42"
    )


@pytest.mark.parametrize(
    "value",
    ["host:8080", "ftp://host", "http://", "http://host:port", "http://host/sub", "http://h/?a=1"],
)
def test_a_bad_base_url_is_one_line_naming_the_variable(value: str):
    with pytest.raises(UsageError) as raised:
        web_links.base_url({web_links.ENV: value})
    message = str(raised.value)
    assert message.startswith(f"{web_links.ENV}=") and "\n" not in message
    assert "http://host:8470" in message
