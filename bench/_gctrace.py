"""Start a linkpass daemon with Python's garbage-collector pauses logged (diagnostic).

    python bench/_gctrace.py run --config FILE      (what ``detect_reroute.py --gc-trace`` runs)

Same as ``python -m linkpass.cli ...`` plus one stderr line per collection that took 1 ms or
more, or was a full (generation 2) collection::

    GCTRACE gen2 24.138 ms start_ns 123456789 collected 42

``start_ns`` is ``time.monotonic_ns()`` when the collection began, so pauses can be matched
with the daemon's history.  Changes nothing else in the daemon.
"""

import gc
import sys
import time

_start = [0]


def _cb(phase: str, info: dict) -> None:
    if phase == "start":
        _start[0] = time.monotonic_ns()
        return
    d = time.monotonic_ns() - _start[0]
    if d >= 1_000_000 or info["generation"] == 2:
        sys.stderr.write(f"GCTRACE gen{info['generation']} {d / 1e6:.3f} ms start_ns {_start[0]} collected {info['collected']}\n")
        sys.stderr.flush()


gc.callbacks.append(_cb)

from linkpass.cli import main  # noqa: E402  (after the callback, so start-up collections are seen)

sys.exit(main(sys.argv[1:]))
