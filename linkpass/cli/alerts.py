"""``linkpass alerts tail``: follow the alert events the daemons publish to MQTT, for operators.

    linkpass alerts tail [--config FILE] [--broker HOST:PORT] [--host H] [--json] [--status]
                         [--count N] [--timeout S] [--session NAME [--session-expiry-s S]]

Subscribes (QoS 1) to ``<prefix>events`` of host H, or of every host (``{host}`` -> ``+``),
using the broker address, topic prefix, TLS files and credentials of ``[mqtt]`` in the config
file (``--broker`` overrides the address).  Prints one readable line per event (rich), or the
event payloads as JSON lines with ``--json``.  An event delivered twice (the daemon re-sends
what the broker had not acknowledged) is printed once (de-duplicated by its ``id``).  With
``--status`` the hosts' ``online``/``offline`` messages are printed too; the last will is
shown as "connection lost (last will, set at connect <ts> ...)", since its ``ts`` is when the
connection was made, not when it was lost.

Without ``--session`` the tail is a clean-session client with a random id: events published
while it is disconnected (a broker restart: the daemons reconnect and send their outboxes,
often before the tail is back) are not delivered to it.  ``--session NAME`` makes it a
persistent-session client: client id NAME, clean start / clean session off, MQTT 5 session
expiry ``--session-expiry-s`` (default one day), QoS 1 subscriptions, and each event is
acknowledged only after it was printed.  The broker then queues the events for NAME while the
tail is away (its own restart too, when the broker runs with ``persistence true``), and a tail
started again with the same NAME gets them: every event at least once, in order, printed once
per run.  One tail per NAME (two clients with one id throw each other off the broker).

Exit codes: 0 (``--count`` reached, ``--timeout`` over, or interrupted), 2 bad arguments or
config, 3 the broker cannot be reached or refused us (one line on stderr, no traceback; the
libraries' own log lines are not shown).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import logging
import re
import sys
from collections import OrderedDict

#: seconds to wait for the broker's CONNACK (and each SUBACK); paho's TCP/TLS connect has its own 5 s
CONNECT_TIMEOUT_S = 5.0
#: MQTT 5 session expiry of ``--session`` (seconds the broker keeps the session after we left)
DEFAULT_SESSION_EXPIRY_S = 86400
#: a --session connection the broker closes within this many seconds of accepting it, QUICK_LOSSES
#: times in a row, is taken to be thrown off by another client with the same id (mosquitto 2.0
#: just closes the old connection, without MQTT 5's DISCONNECT "Session taken over")
QUICK_LOSS_S = 3.0
QUICK_LOSSES = 3
_SESSION_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}")

_COLORS = {"fault": "red", "failover": "red", "incident": "magenta", "degraded": "yellow", "route_error": "red",
           "migration": "magenta", "rebuild": "magenta", "recovery": "green", "failback": "green", "reroute": "cyan",
           "drain": "blue", "damping": "yellow", "peer_rails": "cyan"}


def register(sub) -> None:
    """Add ``alerts`` (with ``tail``) to the ``linkpass`` sub-command parser."""
    a = sub.add_parser("alerts", help="follow the MQTT alert events of linkpass daemons")
    asub = a.add_subparsers(dest="alerts_command", required=True, metavar="ACTION")
    t = asub.add_parser("tail", help="subscribe and print events as they arrive")
    t.add_argument("--config", help="config file whose [mqtt] table gives broker, prefix, TLS and credentials")
    t.add_argument("--broker", metavar="HOST:PORT", help="broker address (overrides the config)")
    t.add_argument("--host", metavar="H", help="only this host's events (default: every host)")
    t.add_argument("--json", action="store_true", help="print each event payload as one JSON line")
    t.add_argument("--status", action="store_true", help="print the hosts' online/offline messages too")
    t.add_argument("--count", type=int, metavar="N", help="exit after N events")
    t.add_argument("--timeout", type=float, metavar="S", help="exit (status 0) after S seconds")
    t.add_argument("--session", metavar="NAME", help="persistent session: client id NAME, clean session off, QoS 1; the "
                   "broker keeps events for NAME while this tail is away (one tail per NAME)")
    t.add_argument("--session-expiry-s", type=int, metavar="S", help="MQTT 5 session expiry of --session: how long the "
                   f"broker keeps the session after the tail left (default {DEFAULT_SESSION_EXPIRY_S} s)")
    t.set_defaults(func=cmd_tail)


def _die(msg: str, code: int) -> int:
    print(f"linkpass: alerts: {msg}", file=sys.stderr)
    return code


def parse_broker(text: str) -> tuple[str, int]:
    """``"HOST:PORT"`` / ``"[v6]:PORT"`` / ``"HOST"`` (port 1883) -> (host, port).

    Raises:
        ValueError: one line saying what is wrong.
    """
    host, port = text, "1883"
    if text.startswith("["):
        end = text.find("]")
        if end < 0:
            raise ValueError(f"--broker {text!r}: missing ']'")
        host, rest = text[1:end], text[end + 1:]
        if rest:
            if not rest.startswith(":"):
                raise ValueError(f"--broker {text!r}: expected [ADDRESS]:PORT")
            port = rest[1:]
    elif text.count(":") == 1:
        host, port = text.split(":")
    if not host:
        raise ValueError(f"--broker {text!r}: no host")
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"--broker {text!r}: port must be 1..65535")
    return host, int(port)


def describe(doc: dict) -> str:
    """One readable line (no timestamp/host) for an event payload."""
    ev = doc.get("event", "?")
    rail = doc.get("rail")
    where = f"rail {rail}" + (f" ({doc['netdev']})" if doc.get("netdev") else "") if rail is not None else ""
    if ev in ("fault", "recovery", "drain"):
        move = f"{doc.get('old')} -> {doc.get('new')}" if doc.get("new") else f"{doc.get('old')} cleared"
        return f"{where} {move}: {doc.get('reason', '')}".strip()
    if ev == "degraded":
        loss = doc.get("loss")
        return f"{where} DEGRADED: probe loss {100 * loss:.1f}% over {doc.get('samples')} probes" if isinstance(loss, (int, float)) \
            else f"{where} DEGRADED"
    if ev in ("failover", "failback", "reroute"):
        parts = [f"generation {doc.get('generation')}", f"usable rails {doc.get('usable')}"]
        if doc.get("lost"):
            parts.append(f"lost {doc['lost']}")
        if doc.get("gained"):
            parts.append(f"gained {doc['gained']}")
        return ", ".join(parts) + f": {doc.get('reason', '')}"
    if ev == "incident":
        return (f"{doc.get('domain')} {doc.get('code')} on {doc.get('device') or '?'}: {doc.get('summary') or '-'}; "
                f"action {doc.get('action')}, remedy {doc.get('remedy')}" + (" (backlog)" if doc.get("backlog") else ""))
    if ev in ("migration", "rebuild"):
        detail = doc.get("detail") or {}
        extra = ", ".join(f"{k}={v}" for k, v in detail.items() if k in ("reason", "spare", "epoch", "rail_from", "rail_to", "exit_code"))
        return f"job {doc.get('job')} rank {doc.get('rank')}: {doc.get('report')}" + (f" ({extra})" if extra else "")
    if ev == "damping":
        d = doc.get("damping") or {}
        return f"{where} suppressed for flapping (penalty {d.get('penalty')})"
    if ev == "peer_rails":
        return f"peer {doc.get('peer')}: usable rails {doc.get('was')} -> {doc.get('usable')}"
    if ev == "route_error":
        return f"generation {doc.get('generation')}: {'; '.join(doc.get('errors') or [])} {'; '.join(doc.get('conflicts') or [])}".strip()
    return json.dumps({k: v for k, v in doc.items() if k not in ("schema", "id", "host", "seq", "ts")})


def _subscription(prefix: str, host: str | None) -> str:
    p = prefix.replace("{host}", host or "+")
    return p if p.endswith("/") else p + "/"


class _PahoLog(logging.Handler):
    """Keeps the last problem paho-mqtt / aiomqtt logged (they log to the logger we give them;
    without this their lines would reach stderr through logging's last-resort handler)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.last: str | None = None

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.last = record.getMessage()
        except Exception:  # a bad format in a library message: keep going
            self.last = str(record.msg)


def _paho_logger() -> tuple[logging.Logger, _PahoLog]:
    """The logger handed to aiomqtt (and by it to paho): silent, remembers the last problem."""
    lg = logging.getLogger("linkpass.alerts.mqtt")
    lg.propagate = False
    lg.setLevel(logging.WARNING)
    for h in list(lg.handlers):
        lg.removeHandler(h)
    h = _PahoLog()
    lg.addHandler(h)
    return lg, h


class ClosedBeforeConnack(Exception):
    """The broker (or something on its port) closed the connection before answering CONNECT:
    typically a TLS listener talked to in plain MQTT.  ``detail`` is what paho saw, or None."""

    def __init__(self, detail: str | None):
        super().__init__(detail or "connection closed before the broker answered")
        self.detail = detail


@functools.cache
def _client_class():
    """aiomqtt.Client whose connect fails at once when the connection closes before CONNACK.

    aiomqtt 2.5.1 ignores a disconnect before CONNACK (``Client._on_disconnect`` returns early)
    and waits for its timeout, so a plain connect to a TLS port took the whole timeout and
    said "Operation timed out".  Here the pending connect gets :class:`ClosedBeforeConnack`
    (wrapped in ``aiomqtt.MqttError``) as soon as paho reports the loss.
    """
    import aiomqtt

    class _Client(aiomqtt.Client):
        paho_log: _PahoLog | None = None

        def _on_disconnect(self, client, userdata, flags, reason_code, properties=None):  # paho's callback
            connected = self._connected
            if not connected.done():
                detail = self.paho_log.last if self.paho_log else None

                def fail() -> None:
                    if not connected.done():
                        connected.set_exception(aiomqtt.MqttError(ClosedBeforeConnack(detail)))
                        connected.add_done_callback(lambda f: f.exception())  # never "not retrieved"
                self._loop.call_soon_threadsafe(fail)
                return
            super()._on_disconnect(client, userdata, flags, reason_code, properties)

    return _Client


def connect_error_text(e: BaseException, tls: bool) -> str:
    """One line for a failed connect (``aiomqtt.MqttError`` or ``OSError``), with a hint."""
    cause = e.args[0] if e.args and isinstance(e.args[0], ClosedBeforeConnack) else None
    if cause is not None:
        d = cause.detail or ""
        what = "connection reset" if ("reset" in d.lower() or "104" in d) else "connection closed"
        what += " before the broker answered MQTT CONNECT"
        if tls:
            return f"{what} (TLS handshake refused, or the broker dropped us without a CONNACK; see the broker's log)"
        return f"{what} (a TLS port? use --config with [mqtt] tls = true / ca_file)"
    text = str(e) or type(e).__name__
    if text == "Operation timed out":
        return f"no answer within {CONNECT_TIMEOUT_S:g} s"
    if "Connection refused" in text:
        return f"{text} (is a broker listening there?)"
    from linkpass.adapters.mqtt import _oserror_text
    return _oserror_text(e)


def _taken_over(e: BaseException) -> bool:
    """True when the broker ended our connection because another client took our session over
    (MQTT 5 DISCONNECT reason 0x8E "Session taken over", MQTT 5.0 section 3.14.2.1)."""
    for x in (e, e.__cause__, e.__context__):
        rc = getattr(x, "rc", None)
        if getattr(rc, "value", rc) == 0x8E:
            return True
    return False


def _session_props(expiry_s: int):
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.properties import Properties

    p = Properties(PacketTypes.CONNECT)
    p.SessionExpiryInterval = expiry_s
    return p


async def _tail(args, mc, host: str, port: int) -> int:
    import aiomqtt
    from aiomqtt.exceptions import MqttConnectError

    from linkpass.adapters.mqtt_credentials import MqttSetupError, build_tls_context, read_password_file
    from linkpass.adapters.mqtt_payloads import broker_address

    try:
        password = read_password_file(mc.password_file) if mc.password_file else None
        tls = build_tls_context(mc)
    except MqttSetupError as e:
        return _die(str(e), 2)
    where = broker_address(host, port)
    base = _subscription(mc.prefix, args.host)
    topics = [base + "events"] + ([base + "status"] if args.status else [])
    console = None
    if not args.json:
        from rich.console import Console
        console = Console(emoji=False, highlight=False, soft_wrap=True)
    seen: OrderedDict[str, None] = OrderedDict()
    printed = 0
    loop = asyncio.get_running_loop()
    deadline = None if args.timeout is None else loop.time() + args.timeout
    proto = aiomqtt.ProtocolVersion.V5 if mc.protocol != "3.1.1" else aiomqtt.ProtocolVersion.V311
    logger, paho_log = _paho_logger()
    Client = _client_class()
    session = args.session
    connected_once = False
    lost_said = False
    quick_losses = 0
    while True:
        up_at = None  # loop time this attempt was connected and subscribed
        if connected_once and deadline is not None and loop.time() >= deadline:
            return 0  # --timeout reached while the broker was away
        v5 = proto == aiomqtt.ProtocolVersion.V5
        kw: dict = {}
        if session:  # a persistent session: the broker keeps our subscriptions and queues events while we are away
            kw = {"identifier": session}
            if v5:
                kw.update(clean_start=False, properties=_session_props(args.session_expiry_s))
            else:
                kw.update(clean_session=False)
        paho_log.last = None
        client = Client(host, port, username=mc.username, password=password, protocol=proto, tls_context=tls,
                        keepalive=mc.keepalive_s, timeout=CONNECT_TIMEOUT_S, logger=logger, **kw)
        client.paho_log = paho_log
        paho = client._client  # noqa: SLF001 - aiomqtt 2.5.1 has no manual-ack API (aiomqtt issue #345)
        if session:
            paho.manual_ack_set(True)  # acknowledge an event only once printed: a killed tail loses none
        try:
            async with client:
                for t in topics:
                    await client.subscribe(t, qos=1)
                if connected_once:
                    print(f"linkpass: alerts: reconnected to {where}" + (f" (session {session})" if session else ""),
                          file=sys.stderr)
                connected_once, lost_said = True, False
                up_at = loop.time()
                async for msg in _until(client.messages, deadline):
                    try:
                        if _handle(msg, topics, args, console, seen):
                            printed += 1
                    finally:
                        if session and msg.qos > 0:
                            paho.ack(msg.mid, msg.qos)
                    if args.count and printed >= args.count:
                        return 0
                return 0  # timeout reached
        except MqttConnectError as e:
            rc = getattr(e, "rc", None)
            if mc.protocol == "auto" and v5 and getattr(rc, "value", rc) in (1, 0x84):
                proto = aiomqtt.ProtocolVersion.V311  # the broker speaks 3.1.1 only
                continue
            return _die(f"broker {where} refused the connection: {e}", 3)
        except (aiomqtt.MqttError, OSError) as e:
            if not connected_once:
                return _die(f"cannot connect to broker {where}: {connect_error_text(e, tls is not None)}", 3)
            if session and up_at is not None:  # reconnecting would throw the other one off, and so on
                quick_losses = quick_losses + 1 if loop.time() - up_at < QUICK_LOSS_S else 0
                if _taken_over(e):
                    return _die(f"session {session}: another client connected to {where} with the same client id and "
                                "took the session over; stopping (one tail per --session NAME)", 3)
                if quick_losses >= QUICK_LOSSES:
                    return _die(f"session {session}: {where} closed the connection within {QUICK_LOSS_S:g} s of accepting "
                                f"it, {quick_losses} times in a row: is another client using client id {session}? "
                                "stopping (one tail per --session NAME)", 3)
            if not lost_said:
                print(f"linkpass: alerts: connection to {where} lost ({e}); reconnecting"
                      + (f" (session {session}: the broker keeps events for us)" if session else
                         " (events published meanwhile are not seen: use --session NAME)"), file=sys.stderr)
                lost_said = True
            wait = 1.0 if deadline is None else max(0.0, min(1.0, deadline - loop.time()))
            await asyncio.sleep(wait)


def _handle(msg, topics: list[str], args, console, seen: OrderedDict) -> bool:
    """Print one message (an event once per ``id``, or a status); True when it was a new event."""
    if not any(msg.topic.matches(t) for t in topics):
        return False  # a subscription an earlier run left in the same --session
    try:
        doc = json.loads(msg.payload)
    except (ValueError, TypeError, RecursionError):  # RecursionError: nesting deeper than the parser's stack
        print(f"linkpass: alerts: {msg.topic}: payload is not JSON; skipped", file=sys.stderr)
        return False
    if not isinstance(doc, dict):
        return False
    if str(msg.topic).endswith("/status"):
        _show_status(console, args.json, doc, bool(msg.retain))
        return False
    eid = doc.get("id")
    if eid in seen:
        return False
    seen[eid] = None
    if len(seen) > 10000:
        seen.popitem(last=False)
    _show_event(console, args.json, doc)
    return True


async def _until(messages, deadline):
    """The messages until ``deadline`` (loop time; None: forever)."""
    it = messages.__aiter__()
    loop = asyncio.get_running_loop()
    while True:
        if deadline is None:
            yield await it.__anext__()
            continue
        left = deadline - loop.time()
        if left <= 0:
            return
        try:
            yield await asyncio.wait_for(it.__anext__(), left)
        except asyncio.TimeoutError:
            return


def _show_event(console, as_json: bool, doc: dict) -> None:
    if as_json:
        sys.stdout.write(json.dumps(doc, separators=(",", ":")) + "\n")
        sys.stdout.flush()
        return
    ev = str(doc.get("event", "?"))
    color = _COLORS.get(ev, "white")
    from rich.text import Text
    line = Text()
    line.append(f"{doc.get('ts', '?')}  ", style="dim")
    line.append(f"{doc.get('host', '?')}  ", style="bold")
    line.append(f"#{doc.get('seq', '?')!s:<6} ", style="dim")
    line.append(f"{ev.upper():<11} ", style=f"bold {color}")
    line.append(describe(doc))
    console.print(line)


def status_text(doc: dict, retained: bool, received_ts: str) -> tuple[str, str]:
    """(time column, text) for a ``status`` payload.

    The last will (``reason`` "connection lost (last will)") was composed when the daemon
    connected (MQTT fixes the will at CONNECT), so its ``ts`` is the connect time, not when
    the connection was lost.  A will received live is shown at ``received_ts`` (the broker
    published it when it noticed the loss); a retained one with no time ("-").
    """
    from linkpass.adapters.mqtt_payloads import WILL_REASON

    ts = str(doc.get("ts", "?"))
    reason = str(doc.get("reason", ""))
    if doc.get("status") == "offline" and reason == WILL_REASON:
        if retained:
            return "-", f"connection lost (last will, set at connect {ts}; retained: when it was lost is not known)"
        return received_ts, f"connection lost (last will, set at connect {ts}; published by the broker when it noticed the loss)"
    return ts, reason


def _show_status(console, as_json: bool, doc: dict, retained: bool = False) -> None:
    if as_json:
        sys.stdout.write(json.dumps(doc, separators=(",", ":")) + "\n")
        sys.stdout.flush()
        return
    from rich.text import Text

    from linkpass.adapters.mqtt_payloads import utc_ts
    st = doc.get("status", "?")
    when, text = status_text(doc, retained, utc_ts())
    line = Text()
    line.append(f"{when:<27}  ", style="dim")
    line.append(f"{doc.get('host', '?')}  ", style="bold")
    line.append(f"{'':<8}{str(st).upper():<11} ", style="bold green" if st == "online" else "bold red")
    line.append(text)
    console.print(line)


def cmd_tail(args) -> int:
    """``linkpass alerts tail``."""
    from linkpass.config import ConfigError, MqttSection, load_config

    if args.count is not None and args.count < 1:
        return _die("--count must be at least 1", 2)
    if args.timeout is not None and not args.timeout > 0:
        return _die("--timeout must be more than 0 seconds", 2)
    if args.session_expiry_s is not None and not args.session:
        return _die("--session-expiry-s needs --session NAME", 2)
    if args.session_expiry_s is None:
        args.session_expiry_s = DEFAULT_SESSION_EXPIRY_S
    if not 1 <= args.session_expiry_s <= 2**32 - 1:
        return _die(f"--session-expiry-s {args.session_expiry_s}: must be 1..{2**32 - 1} seconds", 2)
    if args.session is not None:
        if not _SESSION_RE.fullmatch(args.session):
            return _die(f"--session {args.session!r}: use 1-128 letters, digits and . _ : @ - (starting with a letter "
                        "or digit); it becomes the MQTT client id", 2)
        if args.session.startswith("linkpass-"):
            return _die(f"--session {args.session!r}: names linkpass-* are the daemons' client ids (linkpass-<host>); "
                        "the same id would throw the daemon off the broker: pick another name", 2)
    try:
        mc = load_config(args.config).mqtt if args.config else MqttSection()
    except ConfigError as e:
        return _die(str(e), 2)
    if args.session is not None and args.session == mc.client_id:
        return _die(f"--session {args.session!r}: is mqtt.client_id of {args.config}, the daemon's own id: pick another name", 2)
    host, port = mc.host, mc.port
    if args.broker:
        try:
            host, port = parse_broker(args.broker)
        except ValueError as e:
            return _die(str(e), 2)
    try:
        return asyncio.run(_tail(args, mc, host, port))
    except KeyboardInterrupt:
        return 0


def main(argv: list[str] | None = None) -> int:
    """Run ``alerts`` on its own (``python -m linkpass.cli.alerts tail ...``)."""
    p = argparse.ArgumentParser(prog="linkpass")
    register(p.add_subparsers(dest="command", required=True))
    args = p.parse_args(["alerts", *(argv if argv is not None else sys.argv[1:])])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
