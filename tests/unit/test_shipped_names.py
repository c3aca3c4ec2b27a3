"""The names (and with them the spec hashes) of every shipped kernel are pinned: refactoring the
kernel model must not rename or rebuild a shipped kernel by accident."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest

from fagen import paths
from fagen.model import load_spec_file

PINNED = Path(__file__).with_name("shipped_kernel_names.txt")


def pinned_names() -> dict[str, list[str]]:
    names = defaultdict(list)
    for line in PINNED.read_text().splitlines():
        if line and not line.startswith("#"):
            spec_file, name = line.split()
            names[spec_file].append(name)
    return names


@pytest.mark.parametrize("spec_file", sorted(pinned_names()))
def test_shipped_kernel_names_are_stable(spec_file):
    expansion = load_spec_file(paths.specs_dir() / spec_file)
    assert sorted(s.name for s in expansion.specs) == sorted(pinned_names()[spec_file])
