"""Suite-wide settings: every engine the tests make checks its per-rail probe counts against a
scan of the rail's paths (linkpass.core.engine.CHECK_COUNTS), so every engine and scenario test
also tests the counts."""

import linkpass.core.engine as _engine

_engine.CHECK_COUNTS = True
