"""``linkpass alerts tail``: follow the alert events the daemons publish to MQTT, for operators.

    linkpass alerts tail [--config FILE] [--broker HOST:PORT] [--host H] [--json] [--count N]

Subscribes (QoS 1) to ``<prefix>events`` of host H, or of every host (``{host}`` -> ``+``),
using the broker address, topic prefix, TLS files and credentials of ``[mqtt]`` in the config
file (``--broker`` overrides the address).  Prints one readable line per event (rich), or the
event payloads as JSON lines with ``--json``.  An event delivered twice (the daemon re-sends
what the broker had not acknowledged) is printed once (de-duplicated by its ``id``).  With
``--status`` the hosts' ``online``/``offline`` messages are printed too.

Exit codes: 0 (``--count`` reached, or interrupted), 2 bad arguments or config, 3 the broker
cannot be reached or refused us (one line on stderr, no traceback).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections import OrderedDict

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


async def _tail(args, mc, host: str, port: int) -> int:
    import aiomqtt
    from aiomqtt.exceptions import MqttConnectError

    from linkpass.adapters.mqtt import MqttSetupError, build_tls_context, read_password_file

    try:
        password = read_password_file(mc.password_file) if mc.password_file else None
        tls = build_tls_context(mc)
    except MqttSetupError as e:
        return _die(str(e), 2)
    base = _subscription(mc.prefix, args.host)
    console = None
    if not args.json:
        from rich.console import Console
        console = Console(highlight=False, soft_wrap=True)
    seen: OrderedDict[str, None] = OrderedDict()
    printed = 0
    loop = asyncio.get_running_loop()
    deadline = None if args.timeout is None else loop.time() + args.timeout
    proto = aiomqtt.ProtocolVersion.V5 if mc.protocol != "3.1.1" else aiomqtt.ProtocolVersion.V311
    first = True
    while True:
        try:
            async with aiomqtt.Client(host, port, username=mc.username, password=password, protocol=proto,
                                      tls_context=tls, keepalive=mc.keepalive_s, timeout=10) as client:
                await client.subscribe(base + "events", qos=1)
                if args.status:
                    await client.subscribe(base + "status", qos=1)
                if not first:
                    print(f"linkpass: alerts: reconnected to {host}:{port}", file=sys.stderr)
                first = False
                async for msg in _until(client.messages, deadline):
                    try:
                        doc = json.loads(msg.payload)
                    except (ValueError, TypeError):
                        print(f"linkpass: alerts: {msg.topic}: payload is not JSON; skipped", file=sys.stderr)
                        continue
                    if not isinstance(doc, dict):
                        continue
                    if str(msg.topic).endswith("/status"):
                        _show_status(console, args.json, doc)
                        continue
                    eid = doc.get("id")
                    if eid in seen:
                        continue
                    seen[eid] = None
                    if len(seen) > 10000:
                        seen.popitem(last=False)
                    _show_event(console, args.json, doc)
                    printed += 1
                    if args.count and printed >= args.count:
                        return 0
                return 0  # timeout reached
        except MqttConnectError as e:
            rc = getattr(e, "rc", None)
            if mc.protocol == "auto" and proto == aiomqtt.ProtocolVersion.V5 and getattr(rc, "value", rc) in (1, 0x84):
                proto = aiomqtt.ProtocolVersion.V311  # the broker speaks 3.1.1 only
                continue
            return _die(f"broker {host}:{port} refused the connection: {e}", 3)
        except aiomqtt.MqttError as e:
            if first:
                return _die(f"cannot connect to broker {host}:{port}: {e}", 3)
            print(f"linkpass: alerts: connection to {host}:{port} lost ({e}); reconnecting", file=sys.stderr)
            await asyncio.sleep(1)


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


def _show_status(console, as_json: bool, doc: dict) -> None:
    if as_json:
        sys.stdout.write(json.dumps(doc, separators=(",", ":")) + "\n")
        sys.stdout.flush()
        return
    from rich.text import Text
    st = doc.get("status", "?")
    line = Text()
    line.append(f"{doc.get('ts', '?')}  ", style="dim")
    line.append(f"{doc.get('host', '?')}  ", style="bold")
    line.append(f"{'':<8}{str(st).upper():<11} ", style="bold green" if st == "online" else "bold red")
    line.append(str(doc.get("reason", "")))
    console.print(line)


def cmd_tail(args) -> int:
    """``linkpass alerts tail``."""
    from linkpass.config import ConfigError, MqttSection, load_config

    if args.count is not None and args.count < 1:
        return _die("--count must be at least 1", 2)
    try:
        mc = load_config(args.config).mqtt if args.config else MqttSection()
    except ConfigError as e:
        return _die(str(e), 2)
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
    """Run ``alerts`` on its own (``python -m linkpass.alerts_cli tail ...``)."""
    p = argparse.ArgumentParser(prog="linkpass")
    register(p.add_subparsers(dest="command", required=True))
    args = p.parse_args(["alerts", *(argv if argv is not None else sys.argv[1:])])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
