"""What a rank's process becomes once a spare has taken its rank over (``execv``: same pid).

torchrun's agent watches its workers by pid and ends the whole job when one exits with an
error; the replaced process must therefore live on until the job ends, without its CUDA context
(gone with the exec) and without touching the job.  It waits for the spare and exits with the
spare's exit status (the spare is its child: it was started by this process before the exec).
A spare that is not its child is watched through ``/proc`` and its status is then unknown:
``--code-if-lost`` (1).  SIGTERM/SIGINT (the agent stopping the job) are passed to the spare.

    python -m torch_hooks.proxy --pid PID --spare ID [--code-if-lost N]
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="torch_hooks.proxy")
    p.add_argument("--pid", type=int, required=True)
    p.add_argument("--spare", type=int, default=-1)
    p.add_argument("--code-if-lost", type=int, default=1)
    a = p.parse_args(argv)

    def forward(signum, _frame):
        try:
            os.kill(a.pid, signum)
        except ProcessLookupError:
            pass

    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, forward)
    print(f"linkpass: this process handed its rank to spare {a.spare} (pid {a.pid}) and waits for it", file=sys.stderr,
          flush=True)
    while True:
        try:
            pid, status = os.waitpid(a.pid, 0)
        except InterruptedError:
            continue
        except ChildProcessError:
            break  # not our child: watch it through /proc
        if pid == a.pid:
            return os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)
    while os.path.exists(f"/proc/{a.pid}"):
        time.sleep(0.2)
    return a.code_if_lost


if __name__ == "__main__":
    sys.exit(main())
