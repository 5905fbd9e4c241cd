"""What a POSIX shell makes of a script, for quoting the values laneway inserts into one.

Shell rule: a value substituted into a shell's ``-c`` script (argv[0] ``sh``, ``bash``,
``zsh``, ``dash``, ``ksh``, ``ash`` or ``mksh``, also behind ``env`` or ``busybox``) is
shell-quoted for the place it lands in, so item data is never run as code; ``{name:raw}``
inserts it unquoted, as code. Where a script cannot be quoted (backquotes,
here-documents, ...) only plain values are accepted, checked for every item when the
config is loaded. See docs/security.md.

This module knows shells, not templates: which argv element a shell parses as a script
(``shell_script_index``), the quoting context at a point of a script (``ShellScanner``)
and a value quoted for that context (``quote_for``). ``render_shell_script`` in
controller/templates.py drives them, value by value.
"""

from __future__ import annotations

import os
import re
import shlex

SHELLS = frozenset({"sh", "bash", "zsh", "dash", "ksh", "ash", "mksh"})
"""argv[0] basenames whose ``-c`` argument is a script that the shell parses."""
PLAIN_VALUE = re.compile(r"[A-Za-z0-9_@%+=:,./-]*")
"""Characters with no meaning to a shell in any context: such a value is inserted as
it is where laneway cannot quote (a here-document, backquotes, ``${...}``, ...)."""
PLAIN_NUMBER = re.compile(r"-?[0-9]+(\.[0-9]+)?")


class ShellScanner:
    """Follows the quoting context of a POSIX shell script as it is written out, so
    that each value inserted into it can be quoted for the place it lands in.

    Contexts it quotes in: unquoted words (also inside ``$(...)``), ``"..."`` and
    ``'...'``, and comments. Anywhere else (after a backslash or a ``$``, inside
    backquotes, ``${...}``, ``$((...))``, ``$'...'``, after a here-document starts, or
    after a ``case`` inside ``$(...)``, whose ``)`` it cannot follow) it reports the
    context as unknown, and only a plain value may go there."""

    def __init__(self) -> None:
        self.stack: list[str] = ["code"]
        self.depth: list[int] = [0]
        self.escape = False
        self.dollar = False
        self.subst_opened = False
        self.arith_closing = False
        self.word_start = True
        self.word = ""
        self.less = 0
        self.heredoc_pending = False
        self.unknown: str | None = None

    def context(self) -> tuple[str, str]:
        """(``code`` | ``dq`` | ``sq`` | ``comment`` | ``unknown``, why unknown)."""
        if self.unknown:
            return "unknown", self.unknown
        if self.escape:
            return "unknown", "right after a backslash"
        if self.dollar:
            return "unknown", "right after a $"
        top = self.stack[-1]
        if top in ("code", "subst"):
            return "code", ""
        if top in ("dq", "sq", "comment"):
            return top, ""
        where = {
            "backtick": "inside `...` (use $(...) instead)",
            "param": "inside ${...}",
            "arith": "inside $((...))",
            "ansi": "inside $'...'",
        }
        return "unknown", where[top]

    def feed(self, text: str) -> None:
        for char in text:
            self._char(char)

    def after_word(self) -> None:
        """A quoted value was written: it continues the current word."""
        self.word_start = False
        self.word += "x"
        self.less = 0

    def _push(self, frame: str) -> None:
        self.stack.append(frame)
        self.depth.append(0)

    def _pop(self) -> None:
        if len(self.stack) > 1:
            self.stack.pop()
            self.depth.pop()

    def _end_word(self) -> None:
        if self.word == "case" and "subst" in self.stack:
            self.unknown = "after a case statement inside $(...)"
        self.word = ""

    def _char(self, char: str) -> None:
        if char == "\n" and self.heredoc_pending:
            self.unknown = "inside or after a here-document"
        top = self.stack[-1]
        if top == "comment":
            if char == "\n":
                self._pop()
                self.word_start = True
            return
        if self.escape:
            self.escape = False
            self.word_start = False
            return
        if top == "sq":
            if char == "'":
                self._pop()
            return
        if top in ("ansi", "backtick"):
            if char == "\\":
                self.escape = True
            elif char == ("'" if top == "ansi" else "`"):
                self._pop()
            return
        if self.dollar:
            self.dollar = False
            opened = {"(": "subst", "{": "param", "'": "ansi", '"': "dq"}.get(char)
            if opened and not (top == "dq" and char in "'\""):
                self._push(opened)
                self.subst_opened = opened == "subst"
                self.word = ""
                return
        if self.subst_opened:
            self.subst_opened = False
            if char == "(":
                self.stack[-1] = "arith"
                return
            top = self.stack[-1]
        if top == "param":
            if char in "'\"`\\$":
                self.unknown = "after a quote or $ inside ${...}"
            elif char == "{":
                self.depth[-1] += 1
            elif char == "}":
                if self.depth[-1] == 0:
                    self._pop()
                else:
                    self.depth[-1] -= 1
            return
        if top == "arith":
            if self.arith_closing:
                self.arith_closing = False
                if char == ")":
                    self._pop()
                else:
                    self.unknown = "after an ambiguous $(( ... )"
                return
            if char in "'\"`\\":
                self.unknown = "after a quote inside $((...))"
            elif char == "$":
                self.dollar = True
            elif char == "(":
                self.depth[-1] += 1
            elif char == ")":
                if self.depth[-1] == 0:
                    self.arith_closing = True
                else:
                    self.depth[-1] -= 1
            return
        if top == "dq":
            if char == "\\":
                self.escape = True
            elif char == '"':
                self._pop()
            elif char == "`":
                self._push("backtick")
            elif char == "$":
                self.dollar = True
            return
        # Unquoted shell code: the top level, or inside $(...).
        self.less = self.less + 1 if char == "<" else 0
        if self.less == 2:
            self.heredoc_pending = True
        elif self.less == 3:
            self.heredoc_pending = False  # <<< is a here-string: one word, no body
        if char == "#" and self.word_start:
            self._push("comment")
            return
        separator = char in " \t\n;&|()<>"
        if separator:
            self._end_word()
        else:
            self.word += char
        if char == "\\":
            self.escape = True
        elif char == "'":
            self._push("sq")
        elif char == '"':
            self._push("dq")
        elif char == "`":
            self._push("backtick")
        elif char == "$":
            self.dollar = True
        elif char == "(":
            self.depth[-1] += 1
        elif char == ")":
            if top == "subst" and self.depth[-1] == 0:
                self._pop()
            else:
                self.depth[-1] = max(0, self.depth[-1] - 1)
        self.word_start = separator


def quote_for(context: str, value: str) -> str:
    """``value`` as one literal word in ``context``: closing and reopening the quotes
    around a single-quoted word keeps it verbatim inside ``"..."`` and ``'...'``."""
    if context == "dq":
        return '"' + shlex.quote(value) + '"'
    if context == "sq":
        return "'" + shlex.quote(value) + "'"
    if context == "comment":
        return shlex.quote(value.replace("\n", " ").replace("\r", " "))
    return shlex.quote(value)


def _skip_env(argv: list[str], index: int) -> int | None:
    """The index of the command an ``env`` at ``index`` runs (past its options and
    NAME=value assignments), or None when that cannot be told (``env -S``)."""
    index += 1
    takes_value = {"-u", "--unset", "-C", "--chdir", "-P"}
    while index < len(argv):
        word = argv[index]
        if word == "--":
            return index + 1
        if word in takes_value:
            index += 2
        elif word.startswith(("-S", "--split-string")):
            return None
        elif word.startswith("-") or ("=" in word and not word.startswith("=")):
            index += 1
        else:
            return index
    return None


def shell_script_index(argv: list[str]) -> int | None:
    """Which element of a (rendered) argv a shell parses as a script: the argument of
    ``-c`` when argv[0] is a shell (sh, bash, zsh, dash, ksh, ash, mksh), also behind
    ``env [OPTION] [NAME=value ...]`` or ``busybox``; else None."""
    index = 0
    while index < len(argv):
        base = os.path.basename(argv[index])
        if base == "env":
            found = _skip_env(argv, index)
            if found is None:
                return None
            index = found
            continue
        if base == "busybox":
            index += 1
            continue
        if base not in SHELLS:
            return None
        break
    else:
        return None
    index += 1
    dash_c = False
    while index < len(argv):
        word = argv[index]
        if word == "--":
            index += 1
            break
        if word in ("-o", "+o", "-O", "+O", "--rcfile", "--init-file"):
            index += 2
            continue
        if word.startswith("--"):
            index += 1
            continue
        if len(word) > 1 and word[0] in "-+":
            if word[0] == "-" and "c" in word[1:]:
                dash_c = True
            index += 1
            continue
        break
    return index if dash_c and index < len(argv) else None
