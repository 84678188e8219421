"""linkpass's start-up hook, put first on PYTHONPATH by ``linkpass exec`` (see
torch_hooks/bootstrap.py).  It first imports the ``sitecustomize`` that would have run without
linkpass (the next one on ``sys.path``), then starts the hook in training workers: processes
with ``RANK`` and ``WORLD_SIZE`` set, unless ``LINKPASS_HOOK=0``.  It never stops the program:
any failure is one line on stderr."""

import os
import sys


def _chain() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    ours = sys.modules.pop("sitecustomize", None)
    saved = list(sys.path)
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    try:
        import importlib

        importlib.import_module("sitecustomize")
    except ImportError as e:
        if e.name != "sitecustomize":
            sys.stderr.write(f"linkpass: the site's own sitecustomize failed: {e}\n")
    except Exception as e:  # noqa: BLE001 - what Python itself does: report and go on
        sys.stderr.write(f"linkpass: the site's own sitecustomize failed: {type(e).__name__}: {e}\n")
    finally:
        sys.path[:] = saved
        if ours is not None:
            sys.modules["chained_sitecustomize"] = sys.modules.get("sitecustomize")
            sys.modules["sitecustomize"] = ours


_chain()

if os.environ.get("LINKPASS_HOOK", "1").strip() != "0" and os.environ.get("RANK") and os.environ.get("WORLD_SIZE"):
    try:
        from torch_hooks import bootstrap as _bootstrap

        _bootstrap.start()
    except Exception as _e:  # noqa: BLE001 - the script runs as without linkpass
        sys.stderr.write(f"linkpass: hook not started ({type(_e).__name__}: {_e}); the script runs unprotected\n")
