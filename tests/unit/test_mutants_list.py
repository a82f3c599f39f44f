"""tools/mutants.py's list follows the code: every mutant's fragment occurs exactly once in its
file, and every test it names exists (a stale entry would only show when the slow check is run)."""

from __future__ import annotations

from pathlib import Path

from tools import mutants

ROOT = Path(__file__).resolve().parents[2]


def test_every_fragment_occurs_once_and_every_named_test_exists():
    mutants.check_fragments(mutants.MUTANTS)  # SystemExit naming the stale entries
    for m in mutants.MUTANTS:
        for test in m.tests:
            path, _, name = test.partition("::")
            assert (ROOT / path).is_file(), (m.name, test)
            assert not name or f"def {name}(" in (ROOT / path).read_text(), (m.name, test)
