"""MQTT alerts: an aiomqtt publisher behind a durable outbox (:mod:`linkpass.adapters.outbox`).

Topics (``[mqtt] prefix``, default ``linkpass/v1/{host}/``; deploy/asyncapi.yaml describes
every topic and payload):

==============  ========  ====  ===================================================================
topic           retained  QoS   what
==============  ========  ====  ===================================================================
``status``      yes       qos   ``online`` at connect; ``offline`` as the last will (connection
                                lost, daemon killed) and on a clean stop.  The will's payload
                                (``reason`` = :data:`WILL_REASON`) is fixed when the connection
                                is made (MQTT CONNECT carries it), so its ``ts`` is the connect
                                time, not the time of the loss: the broker publishes it when it
                                notices the loss (socket closed, or 1.5 x keepalive silent).
``state``       yes       qos   rails (state, usable, reason, loss), peers, plan generation, outbox
                                depth; republished after rail, plan, peer and incident changes
                                (coalesced: at most every ``STATE_MIN_INTERVAL_S``, events first).
``topology``    yes       qos   rails (netdev, address) and peers this daemon works with; at connect.
``events``      no        qos   one message per alert event (below), through the outbox.
==============  ========  ====  ===================================================================

``qos`` is ``[mqtt] qos`` (1 by default).  Every payload is a JSON object with ``schema``
(``linkpass.<kind>/v1``), ``id`` (UUID, unique per message; an event keeps its id when it is
sent again), ``host``, ``seq`` and ``ts`` (UTC, RFC 3339).  ``seq`` of an event is the host's
event sequence number (1, 2, ... without gaps, kept across restarts in the outbox); ``seq``
of the other payloads is the last event sequence number handed out when they were built.
An event's ``ts`` is when it happened (wall clock now minus the monotonic age of the event);
``ts`` never decreases as ``seq`` grows: when the wall clock (or the age arithmetic) would go
backwards, the event gets the previous event's ``ts`` (kept in the outbox, across restarts).

Events: which engine history entries and torch hook reports become events, and their fields:
:mod:`linkpass.core.alerts`.

Delivery (no alert lost): :meth:`MqttPublisher.on_entries` writes events to the outbox
synchronously, inside the engine step, *before* anything is sent; the publisher task sends
the oldest rows (up to ``WINDOW`` in flight, in order on one connection) and removes each
only when the broker acknowledged it.  After an outage or a restart the outbox is sent again
from its oldest row: at-least-once, in order; subscribers de-duplicate by ``id``.  That
reaches every subscriber only if it has a persistent session (fixed client id, clean session
off / MQTT 5 session expiry, QoS 1; a broker with ``persistence true`` when the broker itself
restarts): after a broker restart we send the outbox at once, usually before clean-session
subscribers are back, and the broker delivers only to the sessions it has
(``linkpass alerts tail --session NAME``; README "MQTT alerts").

MQTT 5 (``protocol = "auto"``, the default) gives events a message expiry
(``message_expiry_s``) and user properties (``schema``, ``host``, ``id``, ``seq``,
``event``); a broker that refuses MQTT 5 (CONNACK "unsupported protocol version", what a
3.1.1 broker answers, MQTT 3.1.1 section 3.2.2.3) gets MQTT 3.1.1 from then on.

Failures never stop the daemon: the task catches everything, logs each distinct problem once
at ERROR (repeats at DEBUG; ``status()["last_error"]`` keeps it) and reconnects with capped
exponential backoff and full jitter (``reconnect_min_s`` .. ``reconnect_max_s``).  Files are
re-read at every attempt, so a fixed password or certificate is picked up without a restart.
A key or password file that others may read (any ``o`` permission bit) is refused.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import socket
import time
import uuid
from collections.abc import Callable, Iterable, Mapping

import aiomqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from aiomqtt.exceptions import MqttConnectError

# the names below that this module does not use itself are re-exported: callers and tests
# reach the MQTT edge through this module
from linkpass.adapters.mqtt_credentials import (  # noqa: F401
    MAX_PASSWORD_FILE_BYTES,
    MqttSetupError,
    build_tls_context,
    check_private_file,
    read_password_file,
)
from linkpass.adapters.mqtt_payloads import (  # noqa: F401
    EVENT_SCHEMA,
    STATE_SCHEMA,
    STATUS_SCHEMA,
    TOPOLOGY_SCHEMA,
    WILL_REASON,
    broker_address,
    compact_state,
    dumps,
    event_doc,
    topic_prefix,
    topology_of,
    utc_ts,
    utc_ts_us,
)
from linkpass.adapters.outbox import Outbox, OutboxError, OutboxRow
from linkpass.core.alerts import EVENT_TYPES, Alert, AlertMapper  # noqa: F401

log = logging.getLogger("linkpass.mqtt")

#: events in flight (published, not yet acknowledged) at once (bench/mqtt_outbox.py: 32 to 100
#: give the same throughput; 20 and fewer in lock-step batches fell to a few hundred a second)
WINDOW = 64
#: history kinds that change what ``state`` shows (others, like ``path`` or ``link_dump``, do not)
STATE_KINDS = frozenset({"rail", "plan", "routes_applied", "degraded", "recovered", "damping", "peer_rails", "incident",
                         "config_reloaded"})
#: ``state`` is republished at most this often (it is rebuilt from the engine's status)
STATE_MIN_INTERVAL_S = 0.5
_CLOSE_TIMEOUT_S = 3.0


# ---------------------------------------------------------------------------- publisher


class _Lost(Exception):
    """The connection went away while we waited for the broker."""


class MqttPublisher:
    """Publishes events (through the outbox), state, topology and status to the broker.

    Args:
        mc: the validated ``[mqtt]`` section (:class:`linkpass.config.MqttSection`).
        host: this host's name (``daemon.host``).
        rails: rail id -> netdev (event ``netdev`` fields).
        state_fn: returns the ``state`` body (see :func:`compact_state`); called when it is sent.
        topology_fn: returns the ``topology`` body (see :func:`topology_of`).
        outbox: an outbox to use (tests); default: ``mc.outbox_path``, or an in-memory one
            (logged as an error: not durable) when that file cannot be used.

    Attributes:
        counters: ``events`` (queued), ``published`` (acknowledged), ``connects``,
            ``connect_failures``, ``disconnects``, ``state_published``, ``put_errors`` (events
            that could not be stored: lost), ``setup_errors`` (attempts that did not get as far
            as connecting: unusable TLS or password files).
        connected: True while a broker connection is up.
        protocol: ``"5"`` or ``"3.1.1"`` (what the next/current connection uses).
        last_error: the last problem logged, or None since the last successful connect.
    """

    def __init__(self, mc, host: str, rails: Mapping[int, str], state_fn: Callable[[], dict] | None = None,
                 topology_fn: Callable[[], dict] | None = None, outbox: Outbox | None = None):
        self.mc = mc
        self.host = host
        self.prefix = topic_prefix(mc.prefix, host)
        self.client_id = mc.client_id or f"linkpass-{host}"
        self.state_fn = state_fn
        self.topology_fn = topology_fn
        self.mapper = AlertMapper(rails)
        self.protocol = "3.1.1" if mc.protocol == "3.1.1" else "5"
        self.connected = False
        self.last_error: str | None = None
        self.counters: dict[str, int] = dict.fromkeys(
            ("events", "published", "connects", "connect_failures", "disconnects", "state_published", "put_errors", "setup_errors"), 0)
        self._wake = asyncio.Event()
        self._closing = False
        self._state_dirty = True
        self._topology_dirty = True
        self._task: asyncio.Task | None = None
        self._state_at = -1e9  # monotonic s of the last state publish
        self._state_timer: asyncio.TimerHandle | None = None
        self._clock_back = False  # a wall-clock step back was logged
        self.outbox = outbox if outbox is not None else self._open_outbox()

    # ---------------------------------------------------------------- outbox

    def _open_outbox(self) -> Outbox:
        mc = self.mc
        try:
            return Outbox(mc.outbox_path, mc.outbox_max_events, mc.outbox_sync)
        except (OutboxError, OSError) as e:
            log.error("mqtt.outbox_path: %s; events are kept in memory only (lost if the daemon stops before the broker "
                      "has them)", e)
            return Outbox(":memory:", mc.outbox_max_events)

    def depth(self) -> int:
        """Events in the outbox, waiting for the broker's acknowledgement (a metric)."""
        return self.outbox.depth()

    @property
    def dropped_total(self) -> int:
        """Events the outbox dropped because it was full (ever; persisted; a metric)."""
        return self.outbox.dropped_total

    @property
    def dropped(self) -> int:
        """Same as :attr:`dropped_total`."""
        return self.outbox.dropped_total

    def topic(self, name: str) -> str:
        """Full topic of ``status``, ``state``, ``topology`` or ``events``."""
        return self.prefix + name

    # ---------------------------------------------------------------- inputs (engine loop)

    def on_entries(self, entries: Iterable) -> None:
        """New engine history entries, oldest first: the entries of each :class:`~linkpass.core.model.PublishHistory`
        action (the daemon's dispatch table hands them over, on the engine loop)."""
        dirty = False
        for e in entries:
            dirty = dirty or e.kind in STATE_KINDS
            a = self.mapper.from_entry(e.kind, e.t_ns, e.data)
            if a is not None:
                self.enqueue(a)
        if dirty:
            self._state_dirty = True
            self._wake.set()

    def on_hook_report(self, rec: Mapping) -> None:
        """A torch hook report (rebuild / migration / snapshot) as kept by the hook server."""
        try:
            a = self.mapper.from_report(rec, time.monotonic_ns())
        except Exception:
            log.exception("hook report %r not turned into an event", rec)
            return
        if a is not None:
            self.enqueue(a)

    def topology_changed(self) -> None:
        """Republish ``topology`` (after a config reload)."""
        self._topology_dirty = True
        self._wake.set()

    def enqueue(self, a: Alert) -> int | None:
        """Store one event in the outbox (numbered there) and wake the sender; returns its seq,
        None when it could not be stored (counted in ``put_errors``, logged)."""
        now_mono, now_wall_ns = time.monotonic_ns(), time.time_ns()
        # when it happened: now minus its monotonic age; never before the previous event's ts
        raw_us = (now_wall_ns - max(0, now_mono - a.t_mono_ns)) // 1000
        last_us = self.outbox.last_ts_us
        ts_us = max(raw_us, last_us)
        if last_us - raw_us > 1_000_000:  # the wall clock stepped back (not just jitter): say so once
            if not self._clock_back:
                log.warning("mqtt: the wall clock is %.1f s behind the last event's ts; event ts stays at %s until it "
                            "catches up (ts never decreases with seq)", (last_us - raw_us) / 1e6, utc_ts_us(last_us))
            self._clock_back = True
        elif raw_us >= last_us:
            self._clock_back = False
        ts = utc_ts_us(ts_us)
        gen = self.mapper.generation

        def build(seq: int) -> bytes:
            return dumps(event_doc(a, host=self.host, seq=seq, ts=ts, generation=gen, event_id=str(uuid.uuid4())))
        try:
            seq = self.outbox.put(build, critical=a.critical, ts_us=ts_us)
        except Exception as e:  # sqlite3.Error (disk full, I/O error), or an unserialisable field (a bug)
            self.counters["put_errors"] += 1
            self._error(f"outbox {self.outbox.path}: cannot store a {a.event} event: {e}; event lost", exc=False)
            return None
        self.counters["events"] += 1
        self._wake.set()
        return seq

    # ---------------------------------------------------------------- payloads

    def _envelope(self, schema: str) -> dict:
        return {"schema": schema, "id": str(uuid.uuid4()), "host": self.host, "seq": self.outbox.last_seq, "ts": utc_ts()}

    def status_payload(self, status: str, reason: str) -> bytes:
        """The ``status`` message body (``online`` / ``offline``)."""
        return dumps({**self._envelope(STATUS_SCHEMA), "status": status, "reason": reason, "pid": os.getpid(),
                       "client_id": self.client_id})

    def _props(self, schema: str, expiry: int | None = None, **user: object) -> Properties | None:
        if self.protocol != "5":
            return None
        p = Properties(PacketTypes.PUBLISH)
        p.PayloadFormatIndicator = 1
        p.ContentType = "application/json"
        if expiry:
            p.MessageExpiryInterval = expiry
        p.UserProperty = [("schema", schema), ("host", self.host)] + [(k, str(v)) for k, v in user.items()]
        return p

    def _will(self) -> aiomqtt.Will:
        props = None
        if self.protocol == "5":
            props = Properties(PacketTypes.WILLMESSAGE)
            props.PayloadFormatIndicator = 1
            props.ContentType = "application/json"
            props.UserProperty = [("schema", STATUS_SCHEMA), ("host", self.host)]
        return aiomqtt.Will(self.topic("status"), self.status_payload("offline", WILL_REASON),
                            qos=self.mc.qos, retain=True, properties=props)

    # ---------------------------------------------------------------- connection

    def _client(self) -> aiomqtt.Client:
        """A fresh client for one connection attempt (re-reads password and TLS files).

        Raises:
            MqttSetupError: a password, key or certificate file problem.
        """
        mc = self.mc
        password = read_password_file(mc.password_file) if mc.password_file else None
        tls = build_tls_context(mc)
        v5 = self.protocol == "5"
        return aiomqtt.Client(
            mc.host, mc.port, username=mc.username, password=password, identifier=self.client_id,
            protocol=aiomqtt.ProtocolVersion.V5 if v5 else aiomqtt.ProtocolVersion.V311,
            will=self._will(), clean_session=None if v5 else True, keepalive=mc.keepalive_s, timeout=10,
            max_inflight_messages=WINDOW, tls_context=tls, logger=logging.getLogger("linkpass.mqtt.client"),
        )

    def _error(self, msg: str, exc: bool = False) -> None:
        """Log a problem once at ERROR (the same problem again at DEBUG)."""
        if msg != self.last_error:
            log.error("%s", msg, exc_info=exc)
        else:
            log.debug("%s", msg)
        self.last_error = msg

    def _backoff(self, attempt: int) -> float:
        """Full-jitter capped exponential backoff (AWS architecture blog, "Exponential Backoff
        and Jitter", 2015): uniform(0, min(max, min * 2**attempt)), never below ``reconnect_min_s``."""
        lo, hi = self.mc.reconnect_min_s, self.mc.reconnect_max_s
        cap = min(hi, lo * (2 ** min(attempt, 30)))
        return max(lo, random.uniform(0, cap))

    def start(self) -> asyncio.Task:
        """Start the publisher task (never raises; stop it with :meth:`close`)."""
        self._task = asyncio.get_running_loop().create_task(self.run(), name="mqtt")
        return self._task

    async def run(self) -> None:
        """Connect, send, reconnect, until :meth:`close`.  Never raises (but CancelledError)."""
        attempt = 0
        while not self._closing:
            try:
                retry_now = await self._attempt()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a bug: never let it stop the daemon
                self._error(f"mqtt: unexpected {type(e).__name__}: {e}", exc=True)
                retry_now = False
            finally:
                self.connected = False
            if self._closing:
                break
            if retry_now:
                continue
            if self.counters["connects"] and self.last_error is None:
                attempt = 0  # the last connection worked: start again from the shortest delay
            delay = self._backoff(attempt)
            attempt += 1
            try:  # close() interrupts the wait; new events do not (they wait in the outbox)
                await asyncio.wait_for(self._closed_event().wait(), delay)
            except asyncio.TimeoutError:
                pass

    async def _attempt(self) -> bool:
        """One connection, from connect to loss (or clean stop).  Returns True to retry at once
        (MQTT 5 refused: next try is 3.1.1).  Expected problems are logged here, never raised."""
        mc = self.mc
        where = broker_address(mc.host, mc.port)
        try:
            client = self._client()
            async with client:
                self.connected = True
                self.counters["connects"] += 1
                if self.last_error:
                    log.info("mqtt: connected to %s (MQTT %s) after: %s", where, self.protocol, self.last_error)
                else:
                    log.info("mqtt: connected to %s (MQTT %s) as %s", where, self.protocol, self.client_id)
                self.last_error = None
                await self._session(client)
        except MqttSetupError as e:
            self.counters["setup_errors"] += 1
            self._error(f"mqtt: {e}; not connecting (the daemon runs on; retried with backoff, files are re-read)")
        except MqttConnectError as e:
            self.counters["connect_failures"] += 1
            if self._refused_v5(e):
                log.warning("mqtt: broker %s refuses MQTT 5 (%s); using MQTT 3.1.1", where, e)
                self.protocol = "3.1.1"
                return True
            self._error(f"mqtt: broker {where} refused the connection: {_connack_text(e)}"
                        f"{' (check mqtt.username and mqtt.password_file)' if _auth_refused(e) else ''}")
        except (aiomqtt.MqttError, _Lost, OSError) as e:
            if self.connected:
                self.counters["disconnects"] += 1
                log.warning("mqtt: connection to %s lost (%s); %d event(s) wait in the outbox", where, e or type(e).__name__, self.depth())
            else:
                self.counters["connect_failures"] += 1
                self._error(f"mqtt: cannot connect to {where}: {_oserror_text(e)}")
        return False

    def _closed_event(self) -> asyncio.Event:
        ev = getattr(self, "_closed_ev", None)
        if ev is None:
            ev = self._closed_ev = asyncio.Event()
            if self._closing:
                ev.set()
        return ev

    def _refused_v5(self, e: MqttConnectError) -> bool:
        rc = getattr(e, "rc", None)
        value = getattr(rc, "value", rc)
        return self.mc.protocol == "auto" and self.protocol == "5" and value in (1, 0x84)

    async def _session(self, client: aiomqtt.Client) -> None:
        """One connection: status online, topology, then events (a sliding window of up to
        ``WINDOW`` unacknowledged publishes, in outbox order) and state as they come."""
        mc = self.mc
        client.pending_calls_threshold = WINDOW + 10
        watcher = asyncio.get_running_loop().create_task(self._watch(client))
        inflight: dict[asyncio.Future, int] = {}  # publish task -> outbox row id
        last_sent = 0  # row id of the newest row handed to the broker on this connection
        try:
            await self._guard(client.publish(self.topic("status"), self.status_payload("online", "connected"), mc.qos,
                                             True, self._props(STATUS_SCHEMA)), watcher)
            self._state_dirty = True
            self._topology_dirty = True
            while True:
                self._wake.clear()
                if self._closing:
                    if inflight:  # let the events on the wire get their acknowledgement (bounded)
                        await asyncio.wait(set(inflight), timeout=_CLOSE_TIMEOUT_S / 2)
                        self._acked(inflight)
                    await self._guard(client.publish(self.topic("status"), self.status_payload("offline", "daemon stopped"),
                                                     mc.qos, True, self._props(STATUS_SCHEMA), timeout=_CLOSE_TIMEOUT_S), watcher)
                    return
                if self._topology_dirty and self.topology_fn is not None:
                    self._topology_dirty = False
                    body = self._body(self.topology_fn, "topology")
                    if body is None:
                        continue
                    await self._guard(client.publish(self.topic("topology"), dumps({**self._envelope(TOPOLOGY_SCHEMA), **body}),
                                                     mc.qos, True, self._props(TOPOLOGY_SCHEMA)), watcher)
                    continue
                room = WINDOW - len(inflight)
                if room > 0:
                    # publish() hands the message to paho before its first await: starting the
                    # tasks in row order puts them on the wire in row order
                    for r in self.outbox.peek(room, after=last_sent):
                        inflight[asyncio.ensure_future(self._publish_event(client, r))] = r.rowid
                        last_sent = r.rowid
                if not inflight and self._state_dirty and self.state_fn is not None and self._state_due():
                    self._state_dirty = False
                    self._state_at = time.monotonic()
                    body = self._body(self.state_fn, "state")
                    if body is None:
                        continue
                    doc = {**self._envelope(STATE_SCHEMA), **body,
                           "outbox": {"depth": self.depth(), "dropped_total": self.dropped_total}}
                    await self._guard(client.publish(self.topic("state"), dumps(doc), mc.qos, True,
                                                     self._props(STATE_SCHEMA, generation=body.get("generation"))), watcher)
                    self.counters["state_published"] += 1
                    continue
                wake = asyncio.ensure_future(self._wake.wait())
                try:
                    await asyncio.wait(set(inflight) | {wake, watcher}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    wake.cancel()
                self._acked(inflight)
                if watcher.done():
                    raise _Lost(_watch_reason(watcher))
        finally:
            watcher.cancel()
            for t in inflight:
                t.cancel()
            if inflight:
                await asyncio.gather(*inflight, return_exceptions=True)
                try:
                    self._acked(inflight)  # what was acknowledged before the end leaves the outbox
                except _Lost:
                    pass

    def _body(self, fn: Callable[[], dict], what: str) -> dict | None:
        """``fn()``, or None (logged once) when it fails: a bug there must not cost the events."""
        try:
            return dict(fn())
        except Exception as e:
            self._error(f"mqtt: cannot build the {what} message: {type(e).__name__}: {e}", exc=True)
            return None

    def _state_due(self) -> bool:
        """True when ``state`` may go out now; else wake the loop when it may."""
        wait = self._state_at + STATE_MIN_INTERVAL_S - time.monotonic()
        if wait <= 0:
            return True
        if self._state_timer is None or self._state_timer.cancelled() or self._state_timer.when() < asyncio.get_running_loop().time():
            self._state_timer = asyncio.get_running_loop().call_later(wait, self._wake.set)
        return False

    def _acked(self, inflight: dict) -> None:
        """Remove the rows whose publish finished with the broker's acknowledgement from the
        outbox; a publish that failed (timed out) ends the connection (its row is sent again)."""
        done = [t for t in inflight if t.done()]
        if not done:
            return
        ok, failed = [], None
        for t in done:
            rowid = inflight.pop(t)
            if t.cancelled():
                continue
            if t.exception() is None:
                ok.append(rowid)
            elif failed is None:
                failed = t.exception()
        if ok:
            self.outbox.ack(ok)
            self.counters["published"] += len(ok)
        if failed is not None:
            raise _Lost(f"publish not acknowledged: {failed}")

    async def _publish_event(self, client: aiomqtt.Client, r: OutboxRow) -> None:
        doc = r.doc
        mc = self.mc
        props = self._props(EVENT_SCHEMA, mc.message_expiry_s, id=doc.get("id"), seq=r.seq, event=doc.get("event"))
        await client.publish(self.topic("events"), r.payload, mc.qos, False, props, timeout=30)

    async def _watch(self, client: aiomqtt.Client) -> None:
        """Ends (raising MqttError) when the connection goes away; we subscribe to nothing."""
        async for _ in client.messages:
            pass

    async def _guard(self, coro, watcher: asyncio.Task):
        """Await ``coro`` unless the connection goes away first (then raise :class:`_Lost`)."""
        task = asyncio.ensure_future(coro)
        try:
            await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            task.cancel()
            raise
        if task.done():
            return task.result()
        task.cancel()
        raise _Lost(_watch_reason(watcher))

    # ---------------------------------------------------------------- stop, status

    async def close(self) -> None:
        """Clean stop: ``offline`` (retained) while still connected, a clean DISCONNECT (so the
        broker drops the will), then the outbox is closed.  Bounded (a few seconds); never raises.
        Unsent events stay in the outbox for the next start."""
        self._closing = True
        self._closed_event().set()
        self._wake.set()
        task = self._task
        if task is not None and not task.done():
            try:
                await asyncio.wait_for(asyncio.shield(task), _CLOSE_TIMEOUT_S + 1)
            except (asyncio.TimeoutError, asyncio.CancelledError, Exception):
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        self.outbox.close()

    def status(self) -> dict:
        """JSON-ready: broker, protocol, connected, topics prefix, outbox depth/drops, counters."""
        return {
            "broker": broker_address(self.mc.host, self.mc.port),
            "client_id": self.client_id,
            "prefix": self.prefix,
            "protocol": self.protocol,
            "connected": self.connected,
            "outbox": {"path": self.outbox.path, "depth": self.depth(), "dropped_total": self.dropped_total,
                       "malformed": self.outbox.malformed, "max_events": self.outbox.max_events,
                       "last_seq": self.outbox.last_seq, "moved_aside": self.outbox.moved_aside},
            "counters": dict(self.counters),
            "last_error": self.last_error,
        }


def _watch_reason(watcher: asyncio.Task) -> str:
    if not watcher.done() or watcher.cancelled():
        return "connection lost"
    e = watcher.exception()
    cause = getattr(e, "__cause__", None) if e else None
    return f"{e}: {cause}" if cause else str(e or "connection lost")


def _connack_text(e: MqttConnectError) -> str:
    rc = getattr(e, "rc", None)
    return str(rc) if rc is not None and not isinstance(rc, int) else str(e)


def _auth_refused(e: MqttConnectError) -> bool:
    rc = getattr(e, "rc", None)
    return getattr(rc, "value", rc) in (4, 5, 0x86, 0x87, 0x8C)


def _oserror_text(e: BaseException) -> str:
    text = str(e) or type(e).__name__
    if "CERTIFICATE_VERIFY_FAILED" in text or "certificate verify failed" in text:
        text += " (is mqtt.ca_file the CA that signed the broker's certificate, and does the certificate name mqtt.host?)"
    elif isinstance(e, socket.gaierror) or "Name or service not known" in text:
        text += " (mqtt.host does not resolve)"
    return text
