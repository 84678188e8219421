"""Unix-socket server for the torch hooks (``torch_hooks.client``): registrations in, plan
notices out.

Why a socket of its own (``[hooks] socket``, by default beside the control socket:
``/run/linkpass/linkpass.sock`` -> ``/run/linkpass/linkpass.hooks.sock``) rather than
long-lived connections on the control socket: the control socket answers one request per
connection and closes it, so ``linkpass status`` stays a trivial client; hooks need
connections that live as long as the training process, with the daemon pushing notices at
any time.  Two sockets keep both protocols simple and let each have its own limits.

Protocol: :mod:`torch_hooks.protocol` (one JSON object per line, at most
``MAX_MESSAGE_BYTES``).  A client registers (job, rank, world size, local rank, GPU, the peer
hosts its process group talks to, its rail); from then on it gets a ``notice`` at every plan
change (plan generation bump) with the rails usable/unusable here and at its peers and which
of its rails/peers are affected.  The union of all registered peers is handed to the
``set_priority_peers`` callback: the daemon posts it as a ``HookPeersChanged`` event, and the
engine's ``SetProbePriority`` action makes the prober probe the job's own paths at the fast
interval.

Robustness (DESIGN.md rule 8): a malformed, oversized or unexpected message is dropped,
counted (``counters``) and logged (the first few per client at WARNING, then DEBUG); a client
that disconnects is forgotten; a client that stops reading (more than ``_MAX_BUFFERED`` bytes
queued) is dropped.  Nothing a client sends can stop the daemon.  The socket is created
0660, like the control socket; a unix socket only takes local connections, and each
client's pid/uid come from the kernel (SO_PEERCRED), not from what it claims.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
import struct
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from linkpass.core.model import HookPlan
from linkpass.core.pending import PENDING_FAULT_TTL_NS, PENDING_FAULTS_PER_GPU, PendingFaults  # noqa: F401  (re-exported)
from torch_hooks import protocol as proto

log = logging.getLogger("linkpass.hooks")
#: listen(2) backlog of the hook socket: the ranks and spares of one node registering at once
#: (Linux caps it at net.core.somaxconn, 4096 by default since 5.4)
HOOK_BACKLOG = 1024

_MAX_BUFFERED = 1 << 20    # bytes queued for one client before it is dropped as not reading
_LOUD_ERRORS = 5           # errors per client logged at WARNING; later ones at DEBUG
_READ_CHUNK = 65536
#: Fields of a kept report that the server fills in; a client's own values for them are dropped.
_SERVER_FIELDS = frozenset({"t_ns", "client_id", "job", "rank", "pid"})


@dataclass
class _PendingFault:
    """A ``device_fault`` message kept for GPU ``gpu`` (:class:`~linkpass.core.pending.PendingFaults`
    decides how long and how many)."""

    msg: dict
    gpu: int
    on_delivered: Callable[[int], None] | None = None


def default_socket_path(control_socket: str) -> str:
    """The hooks socket beside a control socket: ``/x/h0.sock`` -> ``/x/h0.hooks.sock``."""
    p = Path(control_socket)
    stem = p.name[:-5] if p.name.endswith(".sock") else p.name
    return str(p.with_name(f"{stem}.hooks.sock"))


#: What a notice is built from (the engine's :class:`~linkpass.core.model.NotifyHooks` carries one).
PlanState = HookPlan


@dataclass
class _Client:
    id: int
    writer: asyncio.StreamWriter
    pid: int | None
    uid: int | None
    since_ns: int
    reg: proto.Registration | None = None
    errors: int = 0
    notices_sent: int = 0
    last_report: dict | None = None
    closed: bool = False
    extra: dict = field(default_factory=dict)


def _peercred(writer: asyncio.StreamWriter) -> tuple[int | None, int | None]:
    sock = writer.get_extra_info("socket")
    try:
        pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
        return pid, uid
    except (OSError, AttributeError, struct.error):
        return None, None


class HookServer:
    """Serves torch hook clients on a unix socket.

    Args:
        path: socket path.
        host: this host's name (daemon.host).
        peer_names: configured peer host names (registrations naming others get them listed as
            ``unknown_peers``; only configured ones go to the prober).
        set_priority_peers: called with the sorted union of registered, configured peers
            whenever it changes (the daemon posts a ``HookPeersChanged`` event), or None.
        on_report: called with every kept report (the daemon posts a ``HookReport`` event), or None.
        max_clients: connections beyond this are refused (closed at once, counted).

    Attributes:
        counters: ``connections``, ``refused``, ``registered``, ``disconnects``,
            ``notices_sent``, ``reports``, ``pings``, ``dropped_slow``, and ``bad_<kind>`` for
            dropped messages (``bad_malformed``, also for JSON with NaN/Infinity or nested too
            deeply, ``bad_oversized``, ``bad_register``, ``bad_unregistered`` for a report before
            register, ``bad_type``); ``report_fields_dropped``: reports that tried to set a
            server-known field (``job``, ``rank``, ``pid``, ``client_id``, ``t_ns``), kept
            without those fields; ``device_faults_sent``, ``device_faults_kept`` (reached no
            client, kept for a client that registers on the GPU), ``device_faults_delivered_late``,
            ``device_faults_expired``, ``device_faults_unattributed`` (no GPU: sent to nobody).
        pending_faults: GPU index -> device faults that reached no client yet (at most
            :data:`PENDING_FAULTS_PER_GPU` each, for :data:`PENDING_FAULT_TTL_NS`).
        reports: the last 100 reports, newest last.
        instance: token of this daemon run (notices carry it; clients tell a restart by it).
    """

    def __init__(self, path: str, host: str, peer_names: Sequence[str] = (),
                 set_priority_peers: Callable[[Sequence[str]], None] | None = None, max_clients: int = 1024,
                 on_report: Callable[[dict], None] | None = None):
        self.path = path
        self.host = host
        self.peer_names = frozenset(peer_names)
        self.set_priority_peers = set_priority_peers
        self.on_report = on_report
        self.max_clients = max_clients
        self.counters: Counter[str] = Counter()
        self.reports: deque[dict] = deque(maxlen=100)
        self.instance = f"{os.getpid()}-{secrets.token_hex(4)}"
        self.plan: PlanState | None = None
        self.clients: dict[int, _Client] = {}
        self._next_id = 1
        self._server: asyncio.AbstractServer | None = None
        self._priority: tuple[str, ...] = ()
        self._pending: PendingFaults[_PendingFault] = PendingFaults()  # faults no client got yet

    # ---------------------------------------------------------------- lifecycle

    def check_path(self) -> None:
        """Refuse a path we must not take; remove a stale socket of ours.

        Raises:
            OSError: the directory does not exist, the path is not a socket, or something
                answers there (another daemon).
        """
        p = Path(self.path)
        if not p.parent.is_dir():
            raise FileNotFoundError(f"directory {p.parent} does not exist")
        if p.is_symlink() or (p.exists() and not p.is_socket()):
            raise FileExistsError(f"{p} exists and is not a socket; refusing to replace it")
        if p.exists():
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            probe.settimeout(1.0)
            try:
                probe.connect(str(p))
            except (ConnectionRefusedError, FileNotFoundError):
                p.unlink(missing_ok=True)
            else:
                raise FileExistsError(f"{p}: another daemon is listening there")
            finally:
                probe.close()

    async def start(self) -> None:
        """Listen (socket mode 0660).

        Raises:
            OSError: see :meth:`check_path`, or the socket cannot be bound.
        """
        self.check_path()
        # every rank of a node (and its spares) connects at start, at about the same moment
        self._server = await asyncio.start_unix_server(self._serve, path=self.path, backlog=HOOK_BACKLOG)
        os.chmod(self.path, 0o660)
        log.info("hook socket %s listening", self.path)

    async def close(self) -> None:
        if self._server:
            self._server.close()
        for c in list(self.clients.values()):
            self._drop(c, None)
        try:
            Path(self.path).unlink()
        except OSError:
            pass

    def reconfigure(self, host: str, peer_names: Sequence[str]) -> None:
        self.host, self.peer_names = host, frozenset(peer_names)
        self._update_priority()

    # ---------------------------------------------------------------- notices

    @property
    def generation(self) -> int:
        return 0 if self.plan is None else self.plan.generation

    def publish(self, plan: PlanState) -> None:
        """A plan change: send a notice to every registered client (never raises)."""
        self.plan = plan
        for c in list(self.clients.values()):
            if c.reg is not None:
                self._notify(c)

    def publish_device_fault(self, incident: Mapping, gpu: int | None, t_ns: int,
                             on_delivered: Callable[[int], None] | None = None) -> int:
        """A device fault that needs a rank moved: a ``device_fault`` message to the registered
        clients on GPU ``gpu`` (and those that registered no GPU: they check the GPU themselves).

        ``gpu`` None (a fault the daemon cannot map to a GPU) is sent to nobody: every rank of
        the host would move; the caller says so to the operators.  A fault that reached no
        client is kept for :data:`PENDING_FAULT_TTL_NS` and delivered to the first client(s)
        that register on that GPU (``on_delivered(n)`` is then called with how many got it); a
        fault that reached at least one client is not kept.  Returns how many clients it went to
        now; never raises."""
        if gpu is None:
            self.counters["device_faults_unattributed"] += 1
            return 0
        try:
            msg = proto.build_device_fault(instance=self.instance, host=self.host, incident=incident, gpu=gpu, t_ns=t_ns)
            proto.encode(msg)
        except proto.ProtocolError as e:
            log.error("cannot build a device_fault message: %s", e)
            return 0
        sent = self._send_to_gpu(msg, gpu)
        self.counters["device_faults_sent"] += sent
        if sent == 0:
            now = time.monotonic_ns()
            self._expire_pending(now)
            self.counters["device_faults_expired"] += self._pending.keep(gpu, _PendingFault(msg, gpu, on_delivered), now)
            self.counters["device_faults_kept"] += 1
            log.warning("device fault %s on GPU %d: no hook client on that GPU now; kept for %d s for a client that registers on it",
                        incident.get("code"), gpu, PENDING_FAULT_TTL_NS // 1_000_000_000)
        return sent

    def publish_at_risk(self, verdict: Mapping, gpu: int, t_ns: int) -> int:
        """A GPU at risk (:class:`~linkpass.core.model.NotifyAtRisk`): a ``gpu_at_risk`` message
        to the registered clients on GPU ``gpu`` (and those that registered no GPU).  Not kept
        for later clients: a process that starts on a GPU at risk is the scheduler's to avoid
        (the alert says drain the node).  Returns how many clients it went to; never raises."""
        try:
            msg = proto.build_gpu_at_risk(instance=self.instance, host=self.host, gpu=gpu, verdict=verdict, t_ns=t_ns)
            proto.encode(msg)
        except proto.ProtocolError as e:
            log.error("cannot build a gpu_at_risk message: %s", e)
            return 0
        sent = self._send_to_gpu(msg, gpu)
        self.counters["at_risk_sent"] += sent
        return sent

    def _send_to_gpu(self, msg: dict, gpu: int) -> int:
        """``msg`` to the registered clients on GPU ``gpu`` and those that registered no GPU
        (they check the GPU themselves); returns how many."""
        sent = 0
        for c in list(self.clients.values()):
            if c.reg is None or (c.reg.gpu is not None and c.reg.gpu != gpu):
                continue
            self._send(c, msg)
            sent += 1
        return sent

    @property
    def pending_faults(self) -> dict[int, list[_PendingFault]]:
        """GPU index -> the device faults kept for it, oldest first (a copy)."""
        return {gpu: [k.item for k in ks] for gpu, ks in self._pending.by_gpu.items()}

    def _expire_pending(self, now_ns: int) -> None:
        for gpu, gone in self._pending.expire(now_ns).items():
            self.counters["device_faults_expired"] += gone
            log.warning("%d device fault(s) on GPU %d reached no hook client within %d s; dropped", gone, gpu,
                        PENDING_FAULT_TTL_NS // 1_000_000_000)

    def _deliver_pending(self, c: _Client) -> None:
        """A client registered on a GPU: give it the faults kept for that GPU (then forgotten)."""
        if c.reg is None or c.reg.gpu is None or not self._pending:
            return
        self._expire_pending(time.monotonic_ns())
        for k in self._pending.take(c.reg.gpu):
            p = k.item
            self._send(c, p.msg)
            self.counters["device_faults_sent"] += 1
            self.counters["device_faults_delivered_late"] += 1
            age = (time.monotonic_ns() - k.kept_ns) / 1e9
            log.warning("hook client %d (job %s rank %d) registered on GPU %d: delivered the device fault %s kept for %.1f s",
                        c.id, c.reg.job, c.reg.rank, c.reg.gpu, (p.msg.get("incident") or {}).get("code"), age)
            if p.on_delivered is not None:
                try:
                    p.on_delivered(1)
                except Exception:
                    log.exception("device fault delivery callback failed")

    def _notify(self, c: _Client) -> None:
        p = self.plan
        if p is None:
            return
        try:
            msg = proto.build_notice(generation=p.generation, instance=self.instance, host=self.host, all_rails=p.rails,
                                     usable=p.usable, peer_usable=p.peer_usable, reason=p.reason, t_ns=p.t_ns, reg=c.reg)
            self._send(c, msg)
        except proto.ProtocolError as e:  # a notice too big for the line limit: say so, never crash
            log.error("hook client %d: cannot build notice: %s", c.id, e)
            return
        c.notices_sent += 1
        self.counters["notices_sent"] += 1

    def _send(self, c: _Client, msg: dict) -> None:
        if c.closed:
            return
        c.writer.write(proto.encode(msg))
        if c.writer.transport.get_write_buffer_size() > _MAX_BUFFERED:
            self.counters["dropped_slow"] += 1
            log.warning("hook client %d (pid %s) does not read its notices; dropping it", c.id, c.pid)
            self._drop(c, None)

    # ---------------------------------------------------------------- clients

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.counters["connections"] += 1
        if len(self.clients) >= self.max_clients:
            self.counters["refused"] += 1
            log.warning("hook socket: %d clients already; refusing another", len(self.clients))
            writer.close()
            return
        pid, uid = _peercred(writer)
        c = _Client(self._next_id, writer, pid, uid, time.monotonic_ns())
        self._next_id += 1
        self.clients[c.id] = c
        buf = bytearray()
        discarding = False
        try:
            while not c.closed:
                chunk = await reader.read(_READ_CHUNK)
                if not chunk:
                    break
                buf += chunk
                while True:
                    nl = buf.find(b"\n")
                    if nl < 0:
                        if len(buf) >= proto.MAX_MESSAGE_BYTES:
                            if not discarding:
                                self._bad(c, "oversized", f"line longer than {proto.MAX_MESSAGE_BYTES} bytes")
                            discarding = True
                            buf.clear()
                        break
                    line = bytes(buf[:nl])
                    del buf[:nl + 1]
                    if discarding:  # the tail of an oversized line
                        discarding = False
                        continue
                    if line.strip():
                        self._on_line(c, line)
        except (ConnectionError, OSError):
            pass
        except Exception:  # a bug here must cost one client, never the daemon
            log.exception("hook client %d: unexpected error; dropping it", c.id)
        finally:
            self._drop(c, "disconnected")

    def _drop(self, c: _Client, why: str | None) -> None:
        if c.closed:
            return
        c.closed = True
        self.clients.pop(c.id, None)
        try:
            c.writer.close()
        except Exception:
            pass
        if why:
            self.counters["disconnects"] += 1
        if c.reg is not None:
            log.info("hook client %d (job %s rank %d, pid %s) %s; forgotten", c.id, c.reg.job, c.reg.rank, c.pid, why or "dropped")
            self._update_priority()

    def _bad(self, c: _Client, kind: str, why: str) -> None:
        self.counters[f"bad_{kind}"] += 1
        c.errors += 1
        lvl = logging.WARNING if c.errors <= _LOUD_ERRORS else logging.DEBUG
        log.log(lvl, "hook client %d (pid %s): dropped a %s message: %s", c.id, c.pid, kind, why)
        try:
            self._send(c, {"type": "error", "error": f"{kind}: {why}"[:500]})
        except proto.ProtocolError:
            pass

    def _on_line(self, c: _Client, line: bytes) -> None:
        try:
            msg = proto.decode(line, proto.CLIENT_TYPES)
        except proto.ProtocolError as e:
            kind = "oversized" if "limit" in str(e) else ("type" if "message type" in str(e) else "malformed")
            self._bad(c, kind, str(e))
            return
        except (RecursionError, ValueError) as e:  # decode maps these itself; never lose the client over one
            self._bad(c, "malformed", f"not usable JSON: {type(e).__name__}")
            return
        t = msg["type"]
        if t == "ping":
            self.counters["pings"] += 1
            self._send(c, {"type": "pong", "generation": self.generation, "instance": self.instance})
        elif t == "register":
            try:
                reg = proto.parse_register(msg)
            except proto.ProtocolError as e:
                self._bad(c, "register", str(e))
                return
            first = c.reg is None
            c.reg = reg
            self.counters["registered"] += 1
            unknown = [p for p in reg.peers if p not in self.peer_names]
            log.info("hook client %d %s: job %s rank %d/%d local_rank %s gpu %s rail %s backend %s, peers %s (pid %s uid %s)",
                     c.id, "registered" if first else "re-registered", reg.job, reg.rank, reg.world_size, reg.local_rank,
                     reg.gpu, reg.rail, reg.backend, ",".join(reg.peers) or "-", c.pid, c.uid)
            if unknown:
                log.warning("hook client %d names peers this daemon does not know: %s", c.id, ", ".join(unknown))
            self._send(c, {"type": "registered", "client_id": c.id, "host": self.host, "instance": self.instance,
                           "unknown_peers": unknown})
            self._notify(c)
            self._deliver_pending(c)
            self._update_priority()
        elif t == "report":
            if c.reg is None:
                self._bad(c, "unregistered", "report before register")
                return
            ev = msg.get("event")
            if not isinstance(ev, str) or not ev:
                self._bad(c, "malformed", "report: 'event' must be a non-empty string")
                return
            self.counters["reports"] += 1
            claimed = sorted(k for k in msg if k in _SERVER_FIELDS)
            if claimed:  # identity comes from the registration and the kernel, never from a report
                self.counters["report_fields_dropped"] += 1
                lvl = logging.WARNING if self.counters["report_fields_dropped"] <= _LOUD_ERRORS else logging.DEBUG
                log.log(lvl, "hook client %d (job %s rank %d, pid %s): report sets server-known field(s) %s; ignored",
                        c.id, c.reg.job, c.reg.rank, c.pid, ", ".join(claimed))
            detail = {k: v for k, v in msg.items() if k not in _SERVER_FIELDS and k not in ("type", "event")}
            rec = {**detail, "event": ev, "t_ns": time.monotonic_ns(), "client_id": c.id, "job": c.reg.job,
                   "rank": c.reg.rank, "pid": c.pid}
            c.last_report = rec
            self.reports.append(rec)
            if self.on_report is not None:
                try:
                    self.on_report(rec)
                except Exception:
                    log.exception("hook report not passed on")
            log.log(logging.WARNING if ev in ("unmovable", "rebuild_failed") else logging.INFO,
                    "hook job %s rank %d: %s %s", c.reg.job, c.reg.rank, ev, detail)

    def _update_priority(self) -> None:
        names = tuple(sorted({p for c in self.clients.values() if c.reg for p in c.reg.peers if p in self.peer_names}))
        if names == self._priority:
            return
        self._priority = names
        if self.set_priority_peers is not None:
            try:
                self.set_priority_peers(list(names))
            except Exception:
                log.exception("prober refused priority peers %s", names)
        log.info("peers of registered jobs (probed first): %s", ", ".join(names) or "none")

    # ---------------------------------------------------------------- status

    def status(self) -> dict:
        now = time.monotonic_ns()
        return {
            "socket": self.path,
            "instance": self.instance,
            "generation_sent": self.generation,
            "priority_peers": list(self._priority),
            "clients": [{
                "id": c.id, "pid": c.pid, "uid": c.uid, "connected_s": round((now - c.since_ns) / 1e9, 3),
                "notices_sent": c.notices_sent, "errors": c.errors,
                **({"job": c.reg.job, "rank": c.reg.rank, "world_size": c.reg.world_size, "local_rank": c.reg.local_rank,
                    "gpu": c.reg.gpu, "peers": list(c.reg.peers), "rail": c.reg.rail, "netdev": c.reg.netdev,
                    "backend": c.reg.backend} if c.reg else {"registered": False}),
                "last_report": c.last_report,
            } for c in self.clients.values()],
            "reports": list(self.reports)[-20:],
            "pending_device_faults": [{"gpu": k.item.gpu, "code": (k.item.msg.get("incident") or {}).get("code"),
                                       "device": (k.item.msg.get("incident") or {}).get("device"),
                                       "age_s": round((now - k.kept_ns) / 1e9, 3)}
                                      for k in self._pending],
            "counters": dict(self.counters),
        }
