"""LinkPassGuard: keep a data-parallel job training when the rail under its process group dies.

The lifecycle follows torchft's reconfigurable process group (``ProcessGroup.configure(store,
rank, world_size)`` builds a fresh group for a new store prefix, ``abort()`` drops the old one,
``errored()`` says whether an async error happened; torchft/process_group.py)::

    import torch.distributed as dist
    from torch_hooks.guard import LinkPassGuard

    # the store must live outside the ranks (torchrun's agent hosts it; or a store process like
    # ``python -m linkpass.lab.demo_train --store-only``): a rank hosting it cannot be migrated (the
    # store would die with it), so only then can every rank move to a spare
    store = dist.TCPStore(master_addr, port, world_size, is_master=False)
    guard = LinkPassGuard(store, rank, world_size, rails={0: "rail0", 1: "rail1"}, rail=0,
                          state=[model, opt], job="llm7", peers=["gpu-node-08"])

    def train_step(step):                       # the user's step, unchanged except that its
        opt.zero_grad()                         # collectives go through the guard
        loss = loss_fn(model(batch(step)))
        loss.backward()
        guard.all_reduce(flat_grads)            # instead of dist.all_reduce(flat_grads)
        opt.step()
        return loss

    for step in range(steps):
        loss = guard.step(train_step, step)     # never raises for a link fault it handled
    guard.close()

What happens on a link fault (a daemon notice, :mod:`torch_hooks.client`, whose affected
rails include the rail of the current process group):

1. **abort at once**: the collective in flight is abandoned (collectives are issued with
   ``async_op`` semantics and waited in a loop that also watches notices, so nobody waits for
   the process group timeout).  Gloo has no working abort for an operation blocked on a dead
   peer: ``ProcessGroupGloo.abort()`` returns but the pending work stays blocked until the
   timeout (measured with torch 2.13, see tests/unit/test_torch_hooks_guard.py), and its
   destructor joins the worker threads, so it would block too.  The guard therefore also
   ``shutdown(SHUT_RDWR)``s the TCP sockets the group opened (recorded when it was built), which
   makes gloo fail the pending work with "Connection closed" within milliseconds.
2. **agree**: every rank must rebuild, including those whose own daemon has not heard of the
   fault yet.  The rank that saw the notice writes ``rebuild/<epoch>/req`` in the store;
   every rank checks that key while it waits on a collective (every ``store_check_s``) and
   after a collective error.  Each rank then writes the step it was in and the rails it may
   use (its daemon's ``usable_common``); all ranks read all proposals and compute the same
   answer: resume at the lowest step (a rank may be one step ahead: it finished a collective
   whose last message never reached its peer), on the first rail of ``rails`` usable by every
   rank (the current one if still usable).
3. **rebuild**: a new process group for epoch N with its own store prefix
   (``PrefixStore("linkpass/<job>/gen<N>", store)``), same ranks, the gloo device bound to the
   chosen rail's interface (``ProcessGroupGloo.create_device(interface=...)``, the same thing
   ``GLOO_SOCKET_IFNAME`` selects).  Daemon plan generations are per host, so the group's
   generation is the job-wide rebuild epoch; notices' generations are reported alongside.
4. **replay**: the model/optimizer state (``state``: objects with ``state_dict`` /
   ``load_state_dict``) and torch's CPU RNG state are restored to what they were before the
   step to replay, the step is run again, and training continues.  Bitwise the same result as
   without the fault when the step is deterministic (same data for the same step index, same
   reduction order: same ranks, same algorithm).

It reports what it did to the daemon (``report``: ``rebuilt``, ``unmovable``) and logs it
(logger ``linkpass.torch_hooks``); :attr:`events` keeps the record (timings in ms on the
monotonic clock).

**Where it cannot move in-process** (``backend="nccl"``): NCCL reads its HCA list once per
process and never rescans (NCCL-REFERENCE.md 1.7: the ``ncclNIbDevs`` guard in
``src/transport/net_ib/init.cc`` is never reset), so a new communicator in the same process
would use the dead HCA again.  Unless NCCL's own port failover is configured
(``NCCL_IB_RESILIENCY_PORT_FAILOVER=1``, NCCL >= 2.29.7, which then handles the fault inside
its fused NIC and the guard leaves it alone; ``linkpass nccl-env``/``exec`` set it only when a
listed NIC has a second healthy port on the same card, and the guard ignores it when
``NCCL_IB_HCA`` names a single port, see :func:`nccl_port_failover`), the guard aborts the communicator
(``ProcessGroupNCCL.abort()`` -> ``ncclCommAbort``), reports ``unmovable`` to the daemon, logs
why, and exits the process with status :data:`EXIT_MIGRATE` (75, ``EX_TEMPFAIL`` in
sysexits.h: "try again later") for the launcher to restart the rank elsewhere (rank migration
is a later issue).  The other ranks learn it through the store and exit with the same status.
The same happens when no rail is usable by every rank.

Requirements and limits:

* the store must be reachable over a network the fault does not cut (the rendezvous store
  normally lives on the front-end network);
* the step must start from the restored state: it computes gradients from zero, and reads its
  data by step index (or from a loader whose position is part of ``state``);
* one snapshot of ``state`` per step (a clone of every tensor): fine for the demo's MLP, costly
  for large models (there, snapshot on GPU or rely on a checkpoint instead);
* every rank must call :meth:`step` the same number of times, with the same collectives.

The code, by idea: :mod:`~torch_hooks.guard.group` (:class:`LinkPassGuard`: lifecycle,
collectives, the step loop), :mod:`~torch_hooks.guard.state` (snapshot and restore),
:mod:`~torch_hooks.guard.store` (the job's store connections), :mod:`~torch_hooks.guard.rebuild`
(agree and rebuild), :mod:`~torch_hooks.guard.migration` (device fault, spare takeover) and
:mod:`~torch_hooks.guard.exits` (exit statuses, exceptions, how a rank stops).
"""

from torch_hooks.guard.exits import EXIT_MIGRATE, EXIT_REBUILD_FAILED, LinkPassExit, RebuildFailed, _Interrupted  # noqa: F401
from torch_hooks.guard.group import LinkPassGuard, log, nccl_port_failover  # noqa: F401
from torch_hooks.guard.state import _Call, _clone, _clone_od  # noqa: F401
# the gloo socket shutdown lives in torch_hooks.sockets (shared with torch_hooks.pg); the old
# names stay importable from here
from torch_hooks.sockets import _shutdown_fds, _socket_fds, _tcp_fds  # noqa: F401
