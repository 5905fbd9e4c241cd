"""Item values substituted into a shell's -c script are quoted for where they land, so
they reach the command verbatim and never run as code; {name:raw} opts out."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from laneway.controller.config import (
    TemplateError,
    config_from_frozen,
    preview_argv,
    render_argv,
    render_command,
    shell_script_index,
)
from laneway.controller.errors import ConfigError
from tests.support import make_config

NASTY = [
    "$(touch {marker})",
    "`touch {marker}`",
    "a; touch {marker}",
    "a && touch {marker} #",
    'it\'s "q" $HOME \\ done',
    "line1\ntouch {marker}",
    "'; touch {marker}; '",
    '"; touch {marker}; "',
    "",
    "*",
]

SCRIPTS = [
    "printf '%s\\n' {who}",
    'printf "%s\\n" "{who}"',
    "printf '%s\\n' '{who}'",
    "printf '%s\\n' \"$(printf '%s' {who})\"",
    'printf "%s\\n" "$(printf "%s" "{who}")"',
    "printf '%s\\n' x{who}y",
    "true # {who}\nprintf '%s\\n' {who}",
]


def run_stage(tmp_path: Path, argv: list[str], who: str) -> subprocess.CompletedProcess[str]:
    config = make_config(
        stages=[{"name": "s", "argv": argv}], items=[{"key": "k", "lane": "a", "who": who}]
    )
    rendered = render_argv(config.stage("s"), config.items[0])
    return subprocess.run(rendered, cwd=tmp_path, capture_output=True, text=True, check=False)


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("nasty", NASTY)
def test_values_reach_a_shell_script_verbatim_and_never_run(tmp_path, script, nasty):
    marker = tmp_path / "pwned"
    who = nasty.replace("{marker}", str(marker))
    done = run_stage(tmp_path, ["sh", "-c", script], who)
    assert not marker.exists(), (script, who)
    assert done.returncode == 0, done.stderr
    expected = f"x{who}y" if "x{who}y" in script else who
    assert done.stdout == expected + "\n"


@pytest.mark.parametrize("shell", ["sh", "bash", "dash", "zsh", "ksh"])
def test_every_named_shell_is_quoted_also_behind_env(tmp_path, shell):
    marker = tmp_path / "pwned"
    who = f"$(touch {marker})"
    for argv in (
        [shell, "-c", "echo {who}"],
        ["env", "A=1", shell, "-c", "echo {who}"],
        ["/usr/bin/env", "-u", "X", f"/bin/{shell}", "-ec", "echo {who}"],
    ):
        rendered = render_command(argv, {"who": who})
        assert rendered[-1] == f"echo '{who}'"
        if shutil.which(shell) and os.path.exists(f"/bin/{shell}"):
            done = subprocess.run(rendered, capture_output=True, text=True, check=False)
            assert done.stdout == who + "\n" and not marker.exists()


def test_echo_prints_the_value_verbatim_and_command_substitution_creates_nothing(tmp_path):
    marker = tmp_path / "x"
    done = run_stage(tmp_path, ["sh", "-c", "echo {who}"], "$(touch x)")
    assert done.stdout == "$(touch x)\n" and not marker.exists()
    done = run_stage(tmp_path, ["sh", "-c", "echo {who}"], "ada lovelace")
    assert done.stdout == "ada lovelace\n"


def test_raw_inserts_the_value_as_shell_code(tmp_path):
    done = run_stage(tmp_path, ["sh", "-c", "{who:raw}"], "echo one; echo two")
    assert done.stdout == "one\ntwo\n"
    config = make_config(
        stages=[{"name": "s", "argv": ["tool", "{who:raw}"], "env": {"W": "{who:raw}"}}],
        items=[{"key": "k", "lane": "a", "who": "a b"}],
    )
    assert render_argv(config.stage("s"), config.items[0]) == ["tool", "a b"]


@pytest.mark.parametrize(
    ("argv", "index"),
    [
        (["sh", "-c", "x"], 2),
        (["/bin/bash", "-e", "-o", "pipefail", "-c", "x", "name", "arg"], 5),
        (["bash", "--norc", "-lc", "x"], 3),
        (["env", "-i", "A=1", "--unset", "B", "zsh", "-c", "--", "x"], 8),
        (["/usr/bin/env", "busybox", "sh", "-c", "x"], 4),
        (["sh", "script.sh", "{who}"], None),
        (["python3", "-c", "x"], None),
        (["env", "-S", "sh -c x"], None),
        (["sh", "-c"], None),
    ],
)
def test_shell_script_index(argv, index):
    assert shell_script_index(argv) == index


def test_other_programs_get_values_unquoted():
    assert render_command(["python3", "-c", "print({who!r})", "{who}"], {"who": "a b"}) == [
        "python3",
        "-c",
        "print('a b')",
        "a b",
    ]


def test_a_shell_named_by_a_placeholder_is_still_quoted():
    rendered = render_command(["{shell}", "-c", "echo {who}"], {"shell": "sh", "who": "a;b"})
    assert rendered == ["sh", "-c", "echo 'a;b'"]


@pytest.mark.parametrize(
    ("script", "plain", "refused"),
    [
        ("cat <<EOF\n{who}\nEOF", "v-1.2", "$(id)"),
        ("echo `echo {who}`", "v", "a b"),
        ("echo $(( {who} + 1 ))", "41", "x"),
        ("echo ${{X:-{who}}}", "v", "a;b"),
        ("echo \\{who}", "v", "a b"),
        ("echo $'{who}'", "v", "a'b"),
        ("echo $(case a in a) echo {who};; esac)", "v", "a b"),
    ],
)
def test_where_a_value_cannot_be_quoted_only_plain_values_go(script, plain, refused):
    assert plain in render_command(["sh", "-c", script], {"who": plain})[2]
    with pytest.raises(TemplateError, match=r"\{who\} sits .*positional parameter"):
        render_command(["sh", "-c", script], {"who": refused})


def test_config_load_refuses_a_value_that_cannot_be_quoted_naming_stage_argv_and_item():
    with pytest.raises(ConfigError) as caught:
        make_config(
            stages=[{"name": "s", "argv": ["sh", "-c", "echo `echo {who}`"]}],
            items=[
                {"key": "ok", "lane": "a", "who": "plain"},
                {"key": "bad", "lane": "a", "who": "a b"},
            ],
        )
    (line,) = caught.value.problems
    assert line.startswith("stages.0.argv.2: for item(s) bad: {who} sits inside `...`")


def test_config_load_refuses_a_bad_conversion_or_format_spec_per_item():
    with pytest.raises(ConfigError) as caught:
        make_config(
            stages=[{"name": "s", "argv": ["tool", "{who!x}", "{n:03d}"]}],
            items=[{"key": "k", "lane": "a", "who": "w", "n": "not a number"}],
        )
    problems = caught.value.problems
    assert any(p.startswith("stages.0.argv.1: for item(s) k: unknown conversion") for p in problems)
    assert any(p.startswith("stages.0.argv.2: for item(s) k: ") for p in problems)


def test_a_frozen_config_loads_even_when_a_value_could_not_be_quoted_now():
    config = make_config(
        stages=[{"name": "s", "argv": ["sh", "-c", "echo `echo {who}`"]}],
        items=[{"key": "k", "lane": "a", "who": "plain"}],
    )
    frozen = config.canonical_json().replace('"plain"', '"a b"')
    again = config_from_frozen(frozen)
    with pytest.raises(TemplateError):
        render_argv(again.stage("s"), again.items[0])


def test_preview_argv_renders_the_first_item_of_each_stage():
    config = make_config(
        stages=[
            {"name": "one", "argv": ["sh", "-c", "echo {who}"]},
            {"name": "two", "argv": ["tool", "{item}", "{who}"], "needs": ["one"]},
        ],
        items=[{"key": "k1", "lane": "a", "who": "a b"}, {"key": "k2", "lane": "a", "who": "c"}],
    )
    assert preview_argv(config) == {
        "one": ["sh", "-c", "echo 'a b'"],
        "two": ["tool", "k1", "a b"],
    }
    assert preview_argv(make_config(items=[])) == {}
