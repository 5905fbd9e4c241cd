"""``controller.units.byte_size``: the sizes ``laneway artifacts`` and the report print."""

from __future__ import annotations

import pytest

from laneway.controller.units import byte_size


@pytest.mark.parametrize(
    ("count", "words"),
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1.0 KiB"),
        (1536, "1.5 KiB"),
        (5 * 1024**2 + 1024**2 // 2, "5.5 MiB"),
        (1024**3 - 1, "1024.0 MiB"),
        (12 * 1024**3, "12.0 GiB"),
        (3 * 1024**5, "3.0 PiB"),
        (2048 * 1024**5, "2048.0 PiB"),
    ],
)
def test_byte_size_uses_binary_units(count, words):
    assert byte_size(count) == words
