"""In-process companion for PyTorch training jobs.

* :mod:`torch_hooks.protocol`: the hook protocol (pure; shared with the daemon's
  ``linkpass/adapters/hook_server.py``).
* :mod:`torch_hooks.client`: :class:`~torch_hooks.client.DaemonClient`, the daemon client
  (no torch import): registers the rank, keeps the newest plan notice, reconnects.
* :mod:`torch_hooks.guard`: :class:`~torch_hooks.guard.LinkPassGuard`, the abortable,
  rebuildable process group around the training step (imports torch).
* :mod:`torch_hooks.pg`: :class:`~torch_hooks.pg.ResilientProcessGroup`, the process group
  unmodified DDP / FSDP2 scripts get after :func:`torch_hooks.pg.install` (backends
  ``linkpass_gloo`` / ``linkpass_nccl``): abort, rebuild on a new generation, re-issue the
  interrupted collectives (imports torch).
* :mod:`torch_hooks.agreement`: the rebuild decision (resume step, rail, reason) from every
  rank's proposal; pure, no torch.
* :mod:`torch_hooks.sockets`: find and shut down a gloo group's TCP sockets (no torch).

Nothing here imports torch at package level: ``import torch_hooks.guard`` does.
"""
