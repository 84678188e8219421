#!/usr/bin/env python3
"""Alert throughput through the durable outbox to a local Mosquitto broker.

    .venv/bin/python bench/mqtt_outbox.py --events 10000 --runs 3 --json bench/results/mqtt_outbox.json

Starts its own mosquitto (Debian package ``mosquitto``) on a free 127.0.0.1 port from a
generated config (no system service), and a ``mosquitto_sub`` that counts the events.  For each
run, with a fresh outbox file (``linkpass.adapters.outbox``, sqlite WAL, ``--sync``):

* ``live``: the publisher (``linkpass.adapters.mqtt.MqttPublisher``) is connected; ``--events``
  events are put into the outbox as fast as the caller can (each one a committed sqlite
  transaction, as the daemon does) while the sender publishes them at QoS 1 and removes each
  after its PUBACK.  ``events_per_s`` = events / (last PUBACK - first put).
* ``backlog``: the same number of events is queued while no broker is reachable (as during an
  outage), then the publisher connects and drains them.  ``events_per_s`` = events /
  (outbox empty - connected).

Also reported: ``put_per_s`` (outbox writes alone), whether the subscriber received every
event (``delivered``, counted after de-duplication by id), and the machine.  Target printed
beside the figures: >= 2000 events/s.  Prints figures, never asserts them.  No root needed.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import logging
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from linkpass.adapters.mqtt import Alert, MqttPublisher  # noqa: E402
from linkpass.config import MqttSection  # noqa: E402

from _cluster import machine_info  # noqa: E402 - bench/ is on sys.path when run as a script

SCHEMA = "linkpass.bench.mqtt_outbox/v1"
TARGET_EVENTS_PER_S = 2000.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Broker:
    """mosquitto on a free loopback port, from a generated config."""

    def __init__(self, workdir: Path):
        exe = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
        if not os.path.exists(exe):
            raise SystemExit("bench: mosquitto not found (Debian: apt-get install mosquitto mosquitto-clients)")
        self.port = _free_port()
        self.log = workdir / "mosquitto.log"
        conf = workdir / "mosquitto.conf"
        conf.write_text(f"listener {self.port} 127.0.0.1\nallow_anonymous true\nuser {os.environ.get('USER') or 'root'}\n"
                        f"log_dest file {self.log}\nmax_queued_messages 0\n")
        self.proc = subprocess.Popen([exe, "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True)
        deadline = time.monotonic() + 10
        while not (self.log.exists() and " running" in self.log.read_text(errors="replace")):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"bench: mosquitto did not start; see {self.log}")
            time.sleep(0.02)

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(10)


def _subscriber(port: int, topic: str, count: int, out: Path) -> subprocess.Popen:
    sub = shutil.which("mosquitto_sub")
    if not sub:
        raise SystemExit("bench: mosquitto_sub not found (Debian: apt-get install mosquitto-clients)")
    return subprocess.Popen([sub, "-h", "127.0.0.1", "-p", str(port), "-q", "1", "-t", topic, "-C", str(count), "-W", "120"],
                            stdout=open(out, "wb"), stderr=subprocess.DEVNULL)


async def _run_once(mode: str, broker: Broker, events: int, sync: str, workdir: Path, run: int) -> dict:
    host = f"bench{run}{mode[0]}"
    outbox = workdir / f"outbox-{mode}-{run}.sqlite"
    port = broker.port if mode == "live" else _free_port()  # backlog: nothing listens at first
    mc = MqttSection(enabled=True, host="127.0.0.1", port=port, outbox_path=str(outbox), outbox_max_events=max(events * 2, 10),
                     outbox_sync=sync, reconnect_min_s=0.05, reconnect_max_s=0.1)
    pub = MqttPublisher(mc, host, {0: "rail0"}, state_fn=lambda: {"generation": 1}, topology_fn=lambda: {"rails": []})
    got = workdir / f"sub-{mode}-{run}.txt"
    sub = _subscriber(broker.port, f"linkpass/v1/{host}/events", events, got)
    await asyncio.sleep(0.3)  # the subscription is in place before the first event
    pub.start()
    res: dict = {"mode": mode, "events": events, "sync": sync}
    if mode == "live":
        deadline = time.monotonic() + 10
        while not pub.connected:
            if time.monotonic() > deadline:
                raise SystemExit(f"bench: publisher did not connect: {pub.last_error}")
            await asyncio.sleep(0.01)
    t0 = time.monotonic()
    for i in range(events):
        pub.enqueue(Alert("fault", True, {"rail": 0, "netdev": "rail0", "old": "UP", "new": "DOWN", "reason": f"bench {i}"},
                          time.monotonic_ns()))
        if i % 200 == 199:
            await asyncio.sleep(0)  # the daemon's engine loop yields between events too
    t_put = time.monotonic()
    res["put_per_s"] = round(events / (t_put - t0), 1)
    if mode == "backlog":
        pub.mc = mc.model_copy(update={"port": broker.port})  # the broker comes back
        while not pub.connected:
            await asyncio.sleep(0.005)
        t0 = time.monotonic()
    while pub.depth():
        await asyncio.sleep(0.002)
    t_done = time.monotonic()
    res["seconds"] = round(t_done - t0, 3)
    res["events_per_s"] = round(events / (t_done - t0), 1)
    await pub.close()
    try:
        sub.wait(60)
    except subprocess.TimeoutExpired:
        sub.kill()
        sub.wait()
    ids = set()
    for line in got.read_bytes().splitlines():
        try:
            ids.add(json.loads(line)["id"])
        except (ValueError, KeyError):
            pass
    res["delivered"] = len(ids)
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--events", type=int, default=10000, help="events per run (default 10000)")
    ap.add_argument("--runs", type=int, default=3, help="runs per mode (default 3)")
    ap.add_argument("--sync", choices=["normal", "full"], default="normal", help="outbox sqlite synchronous mode")
    ap.add_argument("--json", metavar="FILE", help="write the results as JSON")
    args = ap.parse_args(argv)
    machine = machine_info()
    # the backlog runs start with no broker on purpose: their "cannot connect" lines are expected
    logging.getLogger("linkpass.mqtt").setLevel(logging.CRITICAL)
    work = Path(tempfile.mkdtemp(prefix="linkpass-bench-mqtt-"))
    broker = Broker(work)
    results = []
    try:
        for run in range(args.runs):
            for mode in ("live", "backlog"):
                r = asyncio.run(_run_once(mode, broker, args.events, args.sync, work, run))
                results.append(r)
                print(f"run {run} {mode:7s}: {r['events_per_s']:8.1f} events/s ({r['seconds']} s), outbox puts {r['put_per_s']:.0f}/s, "
                      f"delivered {r['delivered']}/{r['events']}", flush=True)
    finally:
        broker.close()
    summary = {}
    for mode in ("live", "backlog"):
        v = [r["events_per_s"] for r in results if r["mode"] == mode]
        summary[mode] = {"events_per_s_median": round(statistics.median(v), 1), "events_per_s_min": min(v),
                         "all_delivered": all(r["delivered"] == r["events"] for r in results if r["mode"] == mode)}
        ok = "meets" if summary[mode]["events_per_s_min"] >= TARGET_EVENTS_PER_S else "BELOW"
        print(f"{mode:7s}: median {summary[mode]['events_per_s_median']:.0f} events/s, min {summary[mode]['events_per_s_min']:.0f} "
              f"(target >= {TARGET_EVENTS_PER_S:.0f}: {ok}); every event delivered: {summary[mode]['all_delivered']}")
    machine["loadavg_at_end"] = list(os.getloadavg())
    doc = {"schema": SCHEMA, "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "params": {"events": args.events, "runs": args.runs, "sync": args.sync, "qos": 1},
           "target_events_per_s": TARGET_EVENTS_PER_S, "summary": summary, "runs": results, "machine": machine,
           "workdir": str(work)}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
        print(f"wrote {args.json}")
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
