"""``source_check.changed_sources``: the one judgement of which frozen sources changed
(the claim's halt, ``retry``'s refusal and ``explain`` ask it)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from laneway.controller import pipeline, source_check

pytestmark = pytest.mark.no_ledger


def test_a_changed_file_and_a_gone_one_are_named_an_undone_edit_is_not(tmp_path: Path):
    kept, edited, gone = (tmp_path / name for name in ("kept.py", "edited.py", "gone.py"))
    for path in (kept, edited, gone):
        path.write_text(f"# {path.name}\n")
    recorded = {str(p): source_check.hash_file(p) for p in (kept, edited, gone)}
    assert source_check.changed_sources(recorded) == []

    edited.write_text("# edited\n")
    gone.unlink()
    kept.write_text(kept.read_text())  # the same bytes again: a new mtime, no change
    os.utime(kept, ns=(1, 1))
    changes = source_check.changed_sources(recorded)
    assert [(c.path, c.frozen) for c in changes] == [
        (str(edited), recorded[str(edited)]),
        (str(gone), recorded[str(gone)]),
    ]
    assert changes[0].actual == source_check.hash_file(edited) and changes[0].problem is None
    assert changes[1].actual is None and changes[1].problem
    # The claim's reason is these lines, each naming its file first (controller/advice.py
    # reads the file names back from it).
    lines = source_check.source_drift(recorded)
    assert lines == [change.line for change in changes]
    assert lines[0].startswith(f"{edited}: sha256 ") and "!= frozen" in lines[0]
    assert lines[1].startswith(f"{gone}: unreadable (")
    assert pipeline.source_drift is source_check.source_drift  # one function, re-exported
