"""scripts/mutations.py keeps the proof that each fix has a test: a mutation whose text the code
no longer holds proves nothing, so every one must still apply (its text found once)."""

from __future__ import annotations

from pathlib import Path

from scripts.mutations import MUTATIONS

ROOT = Path(__file__).resolve().parents[2]


def test_every_mutation_still_applies_to_the_code():
    stale = [m.name for m in MUTATIONS if (ROOT / m.path).read_text().count(m.old) != 1]
    assert stale == [], f"these mutations' text is not found once in their file: {stale}"
