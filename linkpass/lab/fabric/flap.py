"""Flap helper: toggles one switch-side port of the emulated fabric, then leaves it up.

Started detached by :func:`linkpass.lab.fabric.cut` with mode ``flap:PERIOD_MS:COUNT``::

    python -m linkpass.lab.fabric.flap --netns lp-fab --port h0r1 --period-ms 200 --count 3 [--ready-fd N]

Each cycle sets the port down for PERIOD_MS/2, then up for PERIOD_MS/2, on a fixed schedule
(no drift).  After COUNT cycles the port is up and the process exits 0.  On SIGTERM it sets the
port up and exits.  With ``--ready-fd`` it writes the ``time.monotonic_ns()`` taken right before the
first down, as decimal text, to that file descriptor and closes it (the caller waits for it).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

from linkpass.lab.fabric._ns import NsError, get_flags, ns_socket, set_up


class _Stop(Exception):
    pass


def _on_term(signum, frame):  # noqa: ARG001
    raise _Stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m linkpass.lab.fabric.flap", description=__doc__.splitlines()[0])
    ap.add_argument("--netns", required=True)
    ap.add_argument("--port", required=True)
    ap.add_argument("--period-ms", type=int, required=True)
    ap.add_argument("--count", type=int, required=True)
    ap.add_argument("--ready-fd", type=int, default=None)
    a = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, _on_term)
    signal.signal(signal.SIGINT, _on_term)
    half_ns = a.period_ms * 1_000_000 // 2
    sock = None
    try:
        sock = ns_socket(a.netns)
        flags = get_flags(sock, a.port)
        t0 = time.monotonic_ns()
        set_up(sock, a.port, False, flags)
        if a.ready_fd is not None:
            os.write(a.ready_fd, str(t0).encode())
            os.close(a.ready_fd)
        for n in range(a.count):
            if n:
                _sleep_until(t0 + n * 2 * half_ns)
                set_up(sock, a.port, False, flags)
            _sleep_until(t0 + n * 2 * half_ns + half_ns)
            set_up(sock, a.port, True, flags)
        return 0
    except _Stop:
        return 0
    except NsError as e:
        print(f"linkpass fabric flap: {e}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if sock is not None:
            try:
                set_up(sock, a.port, True)
            except NsError:
                pass
            sock.close()


def _sleep_until(deadline_ns: int) -> None:
    while True:
        left = deadline_ns - time.monotonic_ns()
        if left <= 0:
            return
        time.sleep(left / 1e9)


if __name__ == "__main__":
    sys.exit(main())
