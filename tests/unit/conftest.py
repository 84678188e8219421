"""Make ``unit_helpers`` importable however pytest names these modules (with or without
``__init__.py`` files in tests/ and tests/unit/)."""

import sys
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
