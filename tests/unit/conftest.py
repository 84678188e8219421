"""Make ``unit_helpers`` importable however pytest names these modules (with or without
``__init__.py`` files in tests/ and tests/unit/), and ``tests.wait`` (the repository root on the
path)."""

import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
for _p in (str(_HERE), str(_HERE.parent.parent)):
    if _p not in sys.path:
        sys.path.insert(0, _p)
