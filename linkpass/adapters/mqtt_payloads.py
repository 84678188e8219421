"""What linkpass publishes over MQTT, as bytes: topic names, timestamps, and the ``state`` and
``topology`` bodies (topics and payloads: :mod:`linkpass.adapters.mqtt`, deploy/asyncapi.yaml).
No connection here: the publisher sends what these build."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from datetime import datetime, timedelta, timezone

EVENT_SCHEMA = "linkpass.event/v1"
STATE_SCHEMA = "linkpass.state/v1"
TOPOLOGY_SCHEMA = "linkpass.topology/v1"
STATUS_SCHEMA = "linkpass.host-status/v1"
#: ``reason`` of the last will (``status`` ``offline`` published by the broker on connection loss);
#: a clean stop says ``"daemon stopped"``, a connect ``"connected"``
WILL_REASON = "connection lost (last will)"


def topic_prefix(prefix: str, host: str) -> str:
    """``prefix`` with ``{host}`` replaced and a trailing ``/``: ``"linkpass/v1/h0/"``."""
    p = prefix.replace("{host}", host)
    return p if p.endswith("/") else p + "/"


def utc_ts(epoch_s: float | None = None) -> str:
    """RFC 3339 UTC timestamp with microseconds: ``2026-11-29T21:50:16.266842Z``."""
    t = datetime.fromtimestamp(time.time() if epoch_s is None else epoch_s, tz=timezone.utc)
    return t.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


def utc_ts_us(epoch_us: int) -> str:
    """:func:`utc_ts` of an integer time in µs since the epoch (exact: no float rounding, so
    a larger ``epoch_us`` never gives a smaller string)."""
    return (_EPOCH + timedelta(microseconds=epoch_us)).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def broker_address(host: str, port: int) -> str:
    """``host:port`` for messages, IPv6 literals in brackets (RFC 3986 section 3.2.2):
    ``"[::1]:1883"``, ``"10.0.0.1:1883"``, ``"mqtt.example.net:8883"``."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def dumps(doc: Mapping) -> bytes:
    """A payload: compact JSON, UTF-8; NaN and infinity refused (ValueError), other objects as ``str()``."""
    return json.dumps(doc, separators=(",", ":"), allow_nan=False, default=str).encode()


def event_doc(alert, *, host: str, seq: int, ts: str, generation: int, event_id: str) -> dict:
    """The ``events`` payload body of one :class:`~linkpass.core.alerts.Alert`: the envelope
    (``schema``, ``id``, ``host``, ``seq``, ``ts``), ``event``, ``severity`` (``critical`` |
    ``info``), ``generation``, ``t_mono_ns``, then the event's own fields
    (:mod:`linkpass.core.alerts`).  ``ts``: :func:`utc_ts_us`; ``event_id``: a UUID string."""
    return {"schema": EVENT_SCHEMA, "id": event_id, "host": host, "seq": seq, "ts": ts, "event": alert.event,
            "severity": "critical" if alert.critical else "info", "generation": generation,
            "t_mono_ns": alert.t_mono_ns, **alert.fields}


def compact_state(st: Mapping) -> dict:
    """The ``state`` payload body from :meth:`linkpass.core.engine.Engine.status`."""
    return {
        "generation": st.get("generation"),
        "applied_generation": st.get("applied_generation"),
        "mode": st.get("mode"),
        "rails": [{k: r.get(k) for k in ("id", "netdev", "state", "usable", "reason", "degraded", "probe_loss")}
                  | {"suppressed": bool((r.get("damping") or {}).get("suppressed"))} for r in st.get("rails", [])],
        "peers": [{"name": p.get("name"), "usable_rails": p.get("usable_rails")} for p in st.get("peers", [])],
        "incident_counts": dict(st.get("incident_counts") or {}),
    }


def topology_of(cfg) -> dict:
    """The ``topology`` payload body from a validated :class:`linkpass.config.Config`."""
    return {
        "mode": cfg.daemon.mode,
        "host_ip": None if cfg.daemon.host_ip is None else str(cfg.daemon.host_ip),
        "source": cfg.topology.rails,
        "rails": [{"id": r.id, "netdev": r.netdev, "address": None if r.address is None else str(r.address)} for r in cfg.rails],
        "peers": [{"name": p.name, "host_ip": None if p.host_ip is None else str(p.host_ip),
                   "rail_ips": {str(k): str(v) for k, v in sorted(p.rail_ips.items())}} for p in cfg.peers],
    }
