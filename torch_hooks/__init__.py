"""In-process companion for PyTorch training jobs.

* :mod:`torch_hooks.protocol`: the hook protocol (pure; shared with the daemon's
  ``linkpass/adapters/hook_server.py``).
* :mod:`torch_hooks.client`: :class:`~torch_hooks.client.DaemonClient`, the daemon client
  (no torch import): registers the rank, keeps the newest plan notice, reconnects.
* :mod:`torch_hooks.guard`: :class:`~torch_hooks.guard.LinkPassGuard`, the abortable,
  rebuildable process group around the training step (imports torch).

Nothing here imports torch at package level: ``import torch_hooks.guard`` does.
"""
