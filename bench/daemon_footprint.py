#!/usr/bin/env python3
"""Memory and idle CPU of linkpass daemons on an idle emulated fabric.

    sudo .venv/bin/python bench/daemon_footprint.py --hosts 2 --rails 2 --idle-s 30 \\
        --json bench/results/daemon_footprint.json

Brings up a fabric (name ``bnfp`` by default), starts one daemon per host, waits until every
daemon is ready, lets them settle, then leaves them alone for ``--idle-s`` seconds (no
control-socket queries during the window) and reads /proc:

* ``vmrss_mb``: resident memory at the end of the window (max of 1 s samples in ``vmrss_max_mb``);
* ``vmhwm_mb``: peak resident memory since the daemon started (includes start-up);
* ``idle_cpu_pct``: (utime+stime delta) / wall time of the window, in % of one core; also
  from the threads' schedstat (ns resolution) as ``idle_cpu_pct_sched``.

Metrics are on (the ``[metrics]`` default); the report says whether each daemon's endpoint
listened.  ``--mqtt`` also turns MQTT alerts on: one real mosquitto (Debian package
``mosquitto``) per host namespace, listening on 127.0.0.1:1883 inside that namespace
(tests/integration/mosquitto.py's :class:`Mosquitto`), and an ``[mqtt]`` table in each
daemon's config (outbox in the run's work directory).  After the window the script checks
that MQTT really works: every daemon reports ``connected`` with state published and no error,
its broker holds the daemon's retained ``status`` (``online``, the daemon's pid), ``state``
and ``topology``, and a rail cut made after the window (figures already read) produces
events that the broker acknowledges.  If any check fails the run reports no figures and exits 1.

Targets printed beside the figures: RSS <= 80 MB, idle CPU <= 0.5 % of one core.
Prints figures, never asserts them.  Must run as root (network namespaces).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: tests.integration.mosquitto

from _cluster import (
    TARGETS,
    BenchCluster,
    BenchError,
    machine_info,
    proc_cpu,
    proc_mem,
    run_and_report,
)

from tests.integration.mosquitto import MOSQUITTO, MOSQUITTO_SUB, Mosquitto

SCHEMA = "linkpass.bench.daemon_footprint/v1"
BROKER_PORT = 1883  # inside each host namespace (its own loopback): always free


class MqttCluster(BenchCluster):
    """BenchCluster with one mosquitto per host namespace (127.0.0.1:``BROKER_PORT`` there) and
    an ``[mqtt]`` table pointing each daemon at its namespace's broker.  :meth:`close` stops
    the daemons first (they publish ``offline``), then the brokers, also when that fails."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.brokers: dict[int, Mosquitto] = {}

    def up(self) -> dict:
        """Build the fabric, start the brokers, write the ``[mqtt]`` tables.

        Raises:
            BenchError: a broker did not start (its stderr and log tail in the message).
        """
        desc = super().up()
        for h in desc["hosts"]:
            i = h["index"]
            b = self.brokers[i] = Mosquitto(self.workdir / f"broker-h{i}", netns=h["netns"], port=BROKER_PORT, persistence=False)
            try:
                b.start()
            except AssertionError as e:
                raise BenchError(f"mosquitto in namespace {h['netns']}: {e}") from None
            self.add_config(i, {"mqtt": {"enabled": True, "host": b.host, "port": b.port,
                                         "outbox_path": str(self.workdir / f"outbox-h{i}.sqlite")}})
        return desc

    def close(self) -> None:
        try:
            super().close()
        finally:
            for b in self.brokers.values():
                b.close()

    def retained(self, i: int, prefix: str) -> dict:
        """What host i's broker holds retained under ``prefix`` (a subscriber in its namespace):
        ``{topic suffix: payload (parsed JSON)}``; ``{"error": ...}`` when mosquitto_sub failed."""
        b = self.brokers[i]
        argv = ["ip", "netns", "exec", b.netns, MOSQUITTO_SUB, "-h", b.host, "-p", str(b.port), "-t", prefix + "#",
                "--retained-only", "-C", "3", "-W", "3", "-F", "%j"]
        try:
            p = subprocess.run(argv, capture_output=True, text=True, timeout=15, check=False)
        except (OSError, subprocess.TimeoutExpired) as e:
            return {"error": f"mosquitto_sub: {e}"}
        out: dict = {}
        for line in p.stdout.splitlines():
            try:
                m = json.loads(line)
                payload = m.get("payload")
                out[m["topic"].removeprefix(prefix)] = json.loads(payload) if isinstance(payload, str) else payload
            except (ValueError, KeyError, TypeError):
                continue
        if not out and p.returncode not in (0, 27):  # 27: -W timed out
            out["error"] = f"mosquitto_sub exited {p.returncode}: {p.stderr.strip()[-300:]}"
        return out


def event_probe(cl: MqttCluster, timeout_s: float = 10.0) -> tuple[list[dict], list[str]]:
    """After the window (its figures already read): cut rail 0 of every host (admin-down) and
    wait until every daemon has queued events for it and its broker acknowledged all of them
    (outbox empty).  Idle daemons publish no events, so this is what shows the events path
    works.  Returns per-host ``{"events", "acked"}`` (counter increases) and the problems."""
    from linkpass.lab import fabric as fab

    before = [cl.ask(i)["mqtt"]["counters"] for i in range(cl.hosts)]
    for i in range(cl.hosts):
        fab.cut(cl.name, i, 0, "admin-down")
    deadline = time.monotonic() + timeout_s
    while True:
        now = [cl.ask(i)["mqtt"] for i in range(cl.hosts)]
        out = [{"events": m["counters"]["events"] - b["events"], "acked": m["counters"]["published"] - b["published"]}
               for m, b in zip(now, before)]
        if all(o["events"] > 0 and o["acked"] >= o["events"] and m["outbox"]["depth"] == 0 for o, m in zip(out, now)):
            return out, []
        if time.monotonic() > deadline:
            return out, [f"h{i}: after a rail cut {o['events']} event(s) queued, {o['acked']} acknowledged, outbox depth "
                         f"{m['outbox']['depth']} after {timeout_s:.0f} s" for i, (o, m) in enumerate(zip(out, now))
                         if not (o["events"] > 0 and o["acked"] >= o["events"] and m["outbox"]["depth"] == 0)]
        time.sleep(0.1)


def mqtt_report(cl: MqttCluster, i: int, pid: int, st0: dict, st1: dict) -> tuple[dict, list[str]]:
    """Host i's MQTT figures from its statuses before (``st0``) and after (``st1``) the window
    and its broker's retained messages, plus the problems that make the run a lie (empty when
    MQTT works: connected, no error, state published, events acknowledged, and the broker
    holds ``status`` online with this daemon's pid, ``state`` and ``topology``)."""
    m1, m0 = st1.get("mqtt"), st0.get("mqtt") or {}
    if m1 is None:
        return {"enabled": False}, [f"h{i}: status has no \"mqtt\" (MQTT not enabled in the daemon)"]
    c1, c0 = m1["counters"], m0.get("counters", {})
    ret = cl.retained(i, m1["prefix"])
    status_msg = ret.get("status") if isinstance(ret.get("status"), dict) else {}
    r = {
        "enabled": True,
        "broker": m1["broker"],
        "protocol": m1["protocol"],
        "connected": m1["connected"],
        "outbox_depth": m1["outbox"]["depth"],
        "outbox_dropped_total": m1["outbox"]["dropped_total"],
        "last_error": m1["last_error"],
        "counters": c1,
        "events_published_during_idle": c1["published"] - c0.get("published", 0),
        "state_published_during_idle": c1["state_published"] - c0.get("state_published", 0),
        "retained_at_broker": sorted(k for k in ret if k != "error"),
        "broker_status": status_msg.get("status"),
        "broker_status_pid": status_msg.get("pid"),
    }
    if "error" in ret:
        r["broker_check_error"] = ret["error"]
    problems = []
    if not m1["connected"]:
        problems.append(f"h{i}: not connected to {m1['broker']}")
    if m1["last_error"]:
        problems.append(f"h{i}: last_error {m1['last_error']}")
    if c1["connects"] < 1 or c1["state_published"] < 1:
        problems.append(f"h{i}: connects {c1['connects']}, state_published {c1['state_published']}")
    if c1["events"] and not c1["published"]:
        problems.append(f"h{i}: {c1['events']} event(s) queued, none acknowledged by the broker")
    if c1["put_errors"] or m1["outbox"]["dropped_total"]:
        problems.append(f"h{i}: outbox put_errors {c1['put_errors']}, dropped {m1['outbox']['dropped_total']}")
    missing = {"status", "state", "topology"} - set(ret)
    if missing:
        problems.append(f"h{i}: broker holds no retained {', '.join(sorted(missing))} under {m1['prefix']}"
                        + (f" ({ret['error']})" if "error" in ret else ""))
    if status_msg and (status_msg.get("status") != "online" or status_msg.get("pid") != pid):
        problems.append(f"h{i}: broker's retained status is {status_msg.get('status')!r} from pid {status_msg.get('pid')}, "
                        f"expected 'online' from {pid}")
    return r, problems


def measure(args) -> dict:
    machine = machine_info()  # load average before the run
    cl = (MqttCluster if args.mqtt else BenchCluster)(args.hosts, args.rails, args.name, args.hold_down_ms)
    t_start = time.monotonic()
    try:
        cl.launch()
        time.sleep(args.settle_s)
        st0 = [cl.ask(i) for i in range(args.hosts)]
        cpu0 = [proc_cpu(p) for p in cl.pids]
        t0 = time.monotonic_ns()
        rss_max = [proc_mem(p)["vmrss_kb"] for p in cl.pids]
        end = time.monotonic() + args.idle_s
        while (left := end - time.monotonic()) > 0:
            time.sleep(min(1.0, left))
            for k, p in enumerate(cl.pids):
                rss_max[k] = max(rss_max[k], proc_mem(p)["vmrss_kb"])
        cpu1 = [proc_cpu(p) for p in cl.pids]
        t1 = time.monotonic_ns()
        mem = [proc_mem(p) for p in cl.pids]
        st1 = [cl.ask(i) for i in range(args.hosts)]
        wall_ns = t1 - t0
        mqtt_problems: list[str] = []
        daemons = []
        for i, pid in enumerate(cl.pids):
            d_stat = cpu1[i]["stat_ns"] - cpu0[i]["stat_ns"]
            d_sched = None if cpu1[i]["sched_ns"] is None else cpu1[i]["sched_ns"] - cpu0[i]["sched_ns"]
            c0, c1 = st0[i]["counters"], st1[i]["counters"]
            daemons.append({
                "host": f"h{i}",
                "pid": pid,
                "vmrss_mb": round(mem[i]["vmrss_kb"] / 1024, 2),
                "vmrss_max_mb": round(max(rss_max[i], mem[i]["vmrss_kb"]) / 1024, 2),
                "vmhwm_mb": round(mem[i]["vmhwm_kb"] / 1024, 2),
                "threads": mem[i].get("threads"),
                "idle_cpu_pct": round(100 * d_stat / wall_ns, 4),
                "idle_cpu_pct_sched": None if d_sched is None else round(100 * d_sched / wall_ns, 4),
                "idle_cpu_ms": round(d_stat / 1e6, 1),
                "startup_cpu_ms": round(cpu0[i]["stat_ns"] / 1e6, 1),
                "events_handled_during_idle": c1["events_handled"] - c0["events_handled"],
                "notices_sent_during_idle": c1.get("notices_sent", 0) - c0.get("notices_sent", 0),
                "metrics_listening": (st1[i].get("metrics") or {}).get("listening"),
            })
            if args.mqtt:
                daemons[-1]["mqtt"], p = mqtt_report(cl, i, pid, st0[i], st1[i])
                mqtt_problems += p
            else:
                daemons[-1]["mqtt"] = {"enabled": "mqtt" in st1[i]}
        if args.mqtt:
            probe, p = event_probe(cl)
            mqtt_problems += p
            for d, o in zip(daemons, probe):
                d["mqtt"]["event_probe_after_window"] = o
        problems = cl.log_problems()
        if mqtt_problems:
            raise BenchError("MQTT was asked for but does not work, so these figures would not be MQTT-on figures:\n  "
                             + "\n  ".join(mqtt_problems) + f"\n  daemon and broker logs: {cl.workdir}")
        rcs = cl.exit_codes()
        pid_check = cl.pid_check
    finally:
        cl.close()

    def mx(key):
        vals = [d[key] for d in daemons if d[key] is not None]
        return max(vals) if vals else None

    return {
        "schema": SCHEMA,
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine,
        "params": {"hosts": args.hosts, "rails": args.rails, "idle_s": args.idle_s, "settle_s": args.settle_s,
                   "hold_down_ms": args.hold_down_ms, "fabric_name": args.name, "mqtt": args.mqtt},
        "metrics_on": all(d["metrics_listening"] for d in daemons),
        "mqtt_on": all(d["mqtt"]["enabled"] for d in daemons),
        "mqtt_verified": bool(args.mqtt),  # with --mqtt, a run whose MQTT checks fail ends in BenchError instead
        "idle_wall_s": round(wall_ns / 1e9, 3),
        "daemons": daemons,
        "max": {k: mx(k) for k in ("vmrss_mb", "vmrss_max_mb", "vmhwm_mb", "idle_cpu_pct", "idle_cpu_pct_sched")},
        "targets": {"rss_mb": TARGETS["rss_mb"], "idle_cpu_pct": TARGETS["idle_cpu_pct"]},
        "pid_check": pid_check,
        "daemons_exited_early": [f"h{i} rc {rc}" for i, rc in enumerate(rcs) if rc is not None],
        "daemon_log_problems": problems,
        "logs": str(cl.workdir),
        "loadavg_at_end": list(os.getloadavg()),
        "run_wall_s": round(time.monotonic() - t_start, 1),
    }


def print_report(r: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    c = Console(width=max(Console().width, 150))
    m = r["machine"]
    onoff = {True: "on", False: "off"}
    t = Table(title=f"linkpass daemon footprint: {r['params']['hosts']} hosts x {r['params']['rails']} rails, "
                    f"idle {r['idle_wall_s']} s, metrics {onoff[r['metrics_on']]}, MQTT {onoff[r['mqtt_on']]}"
                    f"{' (verified)' if r['mqtt_verified'] else ''}  "
                    f"({m['cpus']} CPUs, kernel {m['kernel']}, Python {m['python']})")
    for col in ("daemon", "pid", "VmRSS MB", "VmHWM MB", "idle CPU % (stat)", "idle CPU % (schedstat)", "threads", "events"):
        t.add_column(col, justify="right")
    for d in r["daemons"]:
        t.add_row(d["host"], str(d["pid"]), f"{d['vmrss_mb']:.1f}", f"{d['vmhwm_mb']:.1f}", f"{d['idle_cpu_pct']:.3f}",
                  "-" if d["idle_cpu_pct_sched"] is None else f"{d['idle_cpu_pct_sched']:.3f}", str(d["threads"]),
                  str(d["events_handled_during_idle"]))
    mx, tg = r["max"], r["targets"]

    def mark(v, lim):
        return "" if v is None else ("[green]ok[/]" if v <= lim else "[red]over[/]")

    t.add_section()
    t.add_row("max", "", f"{mx['vmrss_mb']:.1f}", f"{mx['vmhwm_mb']:.1f}", f"{mx['idle_cpu_pct']:.3f}",
              "-" if mx["idle_cpu_pct_sched"] is None else f"{mx['idle_cpu_pct_sched']:.3f}", "", "")
    t.add_row("target", "", f"<= {tg['rss_mb']:.0f} {mark(mx['vmhwm_mb'], tg['rss_mb'])}", "",
              f"<= {tg['idle_cpu_pct']} {mark(mx['idle_cpu_pct'], tg['idle_cpu_pct'])}", "", "", "")
    c.print(t)
    c.print("  metrics endpoints: " + ", ".join(f"{d['host']} {d['metrics_listening'] or 'off'}" for d in r["daemons"]))
    if r["mqtt_on"]:
        q = Table(title="MQTT: daemon status()[\"mqtt\"] after the window, retained messages read back from its broker")
        for col in ("daemon", "broker", "connected", "outbox depth", "events queued / acked", "state published",
                    "in window: events / state", "retained at broker", "broker status", "after a cut: acked / events"):
            q.add_column(col, justify="right")
        for d in r["daemons"]:
            x = d["mqtt"]
            q.add_row(d["host"], f"{x['broker']} MQTT {x['protocol']}", str(x["connected"]), str(x["outbox_depth"]),
                      f"{x['counters']['events']} / {x['counters']['published']}", str(x["counters"]["state_published"]),
                      f"{x['events_published_during_idle']} / {x['state_published_during_idle']}",
                      " ".join(x["retained_at_broker"]), f"{x['broker_status']} pid {x['broker_status_pid']}",
                      "{acked} / {events}".format(**x["event_probe_after_window"]))
        c.print(q)
    for line in r["pid_check"]:
        c.print(f"  {line}")
    if r["daemons_exited_early"]:
        c.print(f"[red]daemons exited early: {r['daemons_exited_early']}[/]")
    if r["daemon_log_problems"]:
        c.print(f"[yellow]{len(r['daemon_log_problems'])} warning/error line(s) in the daemon logs ({r['logs']}):[/]")
        for line in r["daemon_log_problems"][:10]:
            c.print(f"  {line}", markup=False)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hosts", type=int, default=2)
    ap.add_argument("--rails", type=int, default=2)
    ap.add_argument("--idle-s", type=float, default=30.0, help="length of the idle measuring window (default 30)")
    ap.add_argument("--settle-s", type=float, default=3.0, help="wait after the daemons are ready, before measuring (default 3)")
    ap.add_argument("--hold-down-ms", type=int, default=2000)
    ap.add_argument("--name", default="bnfp", help="fabric name (default bnfp)")
    ap.add_argument("--mqtt", action="store_true", help="also turn MQTT alerts on: one mosquitto per host namespace, "
                    "an [mqtt] table in each daemon's config; the run fails unless every daemon really publishes")
    ap.add_argument("--json", metavar="FILE", help="write the figures as JSON here (e.g. bench/results/daemon_footprint.json)")
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("daemon_footprint: must run as root (it creates network namespaces)", file=sys.stderr)
        return 2
    if args.hosts < 2 or args.rails < 1 or args.idle_s <= 0:
        print("daemon_footprint: need --hosts >= 2, --rails >= 1, --idle-s > 0", file=sys.stderr)
        return 2
    if args.mqtt and not (MOSQUITTO and MOSQUITTO_SUB):
        print("daemon_footprint: --mqtt needs mosquitto and mosquitto_sub (Debian: apt-get install mosquitto "
              "mosquitto-clients)", file=sys.stderr)
        return 2
    return run_and_report("daemon_footprint", measure, print_report, args)


if __name__ == "__main__":
    sys.exit(main())
