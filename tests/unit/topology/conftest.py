"""Shared fixtures for topology tests: the corpus expectations."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"


@pytest.fixture(scope="session")
def expected() -> dict:
    """tests/fixtures/corpus/expected.json (a copy of ../shared/corpus/expected.json)."""
    return json.loads((FIXTURES / "corpus" / "expected.json").read_text())


def corpus_file(rel: str) -> Path:
    return FIXTURES / "corpus" / rel
