"""`linkpass demo --scenario guard-device-fault`: a GPU fails under a rank and a hot spare takes
the rank over (:class:`DeviceFaultDemo`)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from linkpass.lab import fabric as fab
from linkpass.lab.demo.common import DemoError
from linkpass.lab.demo.rebuild import RebuildDemo


class DeviceFaultDemo(RebuildDemo):
    """``linkpass demo --scenario device-fault``: a GPU fails under a rank; a hot spare takes the
    rank over (rank migration, :mod:`torch_hooks.spare`).

    Same fabric and daemons as ``--scenario rebuild`` (per-rail IPs, notify-only).  Each host
    runs one rank on its GPU 0 and one hot spare (GPU 1 of that host, :func:`linkpass.lab.inject.fake_pci_bus_id`).
    At 30 % of the run ``linkpass inject device-fault --host <last> --gpu 0 --xid 79`` appends
    an Xid 79 record to that host's kernel log; its daemon classifies it (gpu, migrate-rank),
    maps the PCI id to GPU 0 and sends ``device_fault`` to the hook on GPU 0; that rank hands
    its rank to the spare on its host and exits (fenced); the other rank finds the request in
    the store, the group is re-formed with the spare in its place, the spare gets the state
    from rank 0 and the interrupted step is replayed.  The reference run has no spares, no fault.

    Report additions: ``migration_ms`` (inject issued -> first step completed by the spare),
    ``steps_lost``, ``weights_match_reference`` (the surviving rank and the spare, bitwise,
    against the fault-free run), ``migration`` (the spare's join event: agree/build/state
    timings, state bytes, how the faulty process was fenced), ``faulty_exit`` (its exit status:
    74, or -9 when the spare's fence killed it first), ``rank_exits`` (every rank's exit status),
    ``ok`` and ``result`` (one line).  With ``--spares 0`` the expected outcome is that every rank
    stops with 69 (no spare left): ``ok`` is true then, and the demo exits 0.
    """

    def __init__(self, hosts: int, rails: int, steps: int, name: str, mode: str, hold_down_ms: int = 2000, log=print,
                 spares: int = 1, fault_host: int | None = None):
        super().__init__(hosts, rails, steps, name, mode, hold_down_ms, log)
        if not 0 <= spares <= 4:
            raise DemoError("--spares must be 0..4", 2)
        fault_host = hosts - 1 if fault_host is None else fault_host
        if not 0 <= fault_host < hosts:
            raise DemoError(f"--fault-host must be 0..{hosts - 1} (the host whose rank loses its GPU), got {fault_host}", 2)
        self.spares, self.fault_host = spares, fault_host
        self.spare_jobs: list[subprocess.Popen] = []
        self.store_job: subprocess.Popen | None = None

    def _launch_job(self, tag: str, port: int, spares: int = 0) -> list[Path]:
        from linkpass.adapters.hook_server import default_socket_path

        outs = [self.workdir / f"{tag}-rank{h['index']}.json" for h in self.desc["hosts"]]
        self.jobs, self.spare_jobs = [], []
        store_addr = self.desc["hosts"][0]["rails"][self.STORE_RAIL]["address"]
        names = [h["name"] for h in self.desc["hosts"]]
        self._start_store(tag, store_addr, port)
        for h in self.desc["hosts"]:
            ifaces = ",".join(f"{r['rail']}={r['netdev']}" for r in sorted(h["rails"], key=lambda r: r["rail"] != self.PG_RAIL))
            common = ["--world-size", str(self.hosts), "--master-addr", store_addr, "--master-port", str(port),
                      "--steps", str(self.steps), "--hook", "--rail-ifaces", ifaces, "--rail", str(self.PG_RAIL),
                      "--hooks-socket", default_socket_path(h["control_socket"]), "--host", h["name"],
                      "--peers", ",".join(n for n in names if n != h["name"]), "--timeout-s", "30", "--external-store"]
            for k in range(spares + 1):
                tagk = f"rank{h['index']}" if k == 0 else f"spare{h['index']}-{k}"
                out, prog = self.workdir / f"{tag}-{tagk}.json", self.workdir / f"{tag}-{tagk}.progress"
                for f in (out, prog):
                    f.unlink(missing_ok=True)
                extra = ["--rank", str(h["index"]), "--gpu", "0"] if k == 0 else ["--rank", "0", "--gpu", str(k), "--spare",
                                                                               "--spare-wait-s", "300"]
                logf = open(self.workdir / f"{tag}-{tagk}.log", "w")
                p = subprocess.Popen(fab.netns_exec(self.name, h["index"]) + [sys.executable, "-m", "linkpass.lab.demo_train"]
                                     + extra + common + ["--out", str(out), "--progress", str(prog)],
                                     stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
                (self.jobs if k == 0 else self.spare_jobs).append(p)
        return outs

    def _start_store(self, tag: str, addr: str, port: int) -> None:
        """The job's TCPStore in a process of its own on host 0 (as torchrun's agent hosts it),
        so that any rank, rank 0 included, can lose its GPU and be migrated."""
        self._stop_store()
        prog = self.workdir / f"{tag}-store.progress"
        prog.unlink(missing_ok=True)
        logf = open(self.workdir / f"{tag}-store.log", "w")
        self.store_job = subprocess.Popen(fab.netns_exec(self.name, 0) + [
            sys.executable, "-m", "linkpass.lab.demo_train", "--store-only", "--rank", "0", "--world-size", str(self.hosts),
            "--master-addr", addr, "--master-port", str(port), "--out", os.devnull, "--progress", str(prog)],
            stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 60
        while not (prog.exists() and prog.read_text() == "ready"):
            if self.store_job.poll() is not None or time.monotonic() > deadline:
                raise DemoError(f"the job's store did not start on {addr}:{port}: "
                                f"{(self.workdir / f'{tag}-store.log').read_text()[-500:]}")
            time.sleep(0.05)

    def _stop_store(self) -> None:
        p, self.store_job = self.store_job, None
        if p is not None and p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
                p.wait(5)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def run(self) -> dict:
        from linkpass.lab.inject import inject_device_fault

        self.start()
        self.log(f"reference run: {self.steps} steps, no fault, no spares")
        ref = self._wait_jobs(self._launch_job("reference", 29500))
        if any(r["errors"] for r in ref):
            raise DemoError(f"reference run failed: {ref[0]['errors'] or ref[-1]['errors']}")
        fault_host = self.fault_host
        self.log(f"faulted run: {self.spares} hot spare(s) per host")
        self._launch_job("faulted", 29501, self.spares)
        self._wait_progress("faulted", fault_host, self.steps * 3 // 10)
        step_at_fault = self._progress("faulted", fault_host)
        inj = inject_device_fault(self.name, fault_host, 0, 79)
        self.log(f"injected Xid 79 on h{fault_host} GPU 0 ({inj['pci']}) at step {step_at_fault}")
        codes, taken, res = self._collect_faulted(fault_host, time.monotonic() + 180)
        return self._summarize_migration(ref, res, taken, codes, fault_host, inj, step_at_fault)

    def _collect_faulted(self, fault_host: int, deadline: float) -> tuple[dict, dict | None, list[dict]]:
        """After the fault: wait (until ``deadline``, monotonic s) for the ranks to exit, then for
        the spare that took a rank over; stop the other spares.  Returns ``(exit codes by rank,
        the taken spare's result or None, the healthy ranks' results)``."""
        codes = {}
        while len(codes) < len(self.jobs) and time.monotonic() < deadline:
            for i, j in enumerate(self.jobs):
                if i not in codes and j.poll() is not None:
                    codes[i] = j.returncode
            # the taken spare ends with the job; the others wait: stop when the taken one is done
            time.sleep(0.05)
        taken = None
        for k, sj in enumerate(self.spare_jobs):
            h, n = divmod(k, max(1, self.spares))
            f = self.workdir / f"faulted-spare{h}-{n + 1}.json"
            try:
                sj.wait(max(0.1, deadline - time.monotonic()) if self._spare_taken(h, n + 1) else 0.5)
            except subprocess.TimeoutExpired:
                pass
            if f.exists():
                d = json.loads(f.read_text())
                if not d.get("spare_unused") and "weights_sha256" in d:
                    taken = d
        self._stop_spares()
        res = []
        for h in self.desc["hosts"]:
            f = self.workdir / f"faulted-rank{h['index']}.json"
            if h["index"] != fault_host and f.exists():
                res.append(json.loads(f.read_text()))
        return codes, taken, res

    def _spare_taken(self, h: int, n: int) -> bool:
        try:
            return int((self.workdir / f"faulted-spare{h}-{n}.progress").read_text() or 0) > 0 or \
                "takes rank" in (self.workdir / f"faulted-spare{h}-{n}.log").read_text()
        except (OSError, ValueError):
            return False

    def _stop_spares(self) -> None:
        for p in self.spare_jobs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for p in self.spare_jobs:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)

    def _summarize_migration(self, ref, res, taken, codes, host, inj, step_at_fault) -> dict:
        survivors = res + ([taken] if taken else [])
        ok_ranks = len(survivors) == self.hosts
        if ok_ranks:
            steps_done = min(r["steps_done"] for r in survivors)
        else:  # the job stopped: the steps every rank finished (progress files; a stopped rank writes no result)
            steps_done = min((self._progress("faulted", h["index"]) for h in self.desc["hosts"]), default=0)
        same = ok_ranks and all(r["weights_sha256"] == ref[0]["weights_sha256"] for r in survivors + ref)
        joined = next((e for e in (taken or {}).get("rebuilds", []) if e.get("event") == "joined"), None)
        mig_ms = None
        if joined and joined.get("first_step_t_ns"):
            mig_ms = round((joined["first_step_t_ns"] - inj["t_issued_ns"]) / 1e6, 3)
        keep = ("epoch", "interrupted_step", "resume_step", "spare", "fenced", "agree_ms", "build_ms", "state_ms",
                "state_bytes", "rebuild_ms")
        from torch_hooks.spare import EXIT_NO_SPARE

        if self.spares == 0:
            # nothing can take the rank over: as designed, every rank stops with EXIT_NO_SPARE
            ok = len(codes) == self.hosts and all(c == EXIT_NO_SPARE for c in codes.values())
            outcome = (f"no spare left: every rank stopped cleanly with status {EXIT_NO_SPARE} (as designed)" if ok else
                       f"no spare left, but the ranks did not all stop with {EXIT_NO_SPARE}: exits {codes}")
        else:
            ok = self.steps - steps_done == 0 and bool(same)
            outcome = ("job kept training on a spare, weights identical to the fault-free run" if ok else
                       f"job was disturbed: {self.steps - steps_done} steps lost, weights match: {bool(same)}, exits {codes}")
        return {
            "scenario": "device-fault",
            "ok": ok,
            "result": outcome,
            "steps": self.steps,
            "steps_lost": self.steps - steps_done,
            "weights_match_reference": bool(same),
            "migration_ms": mig_ms,
            "fault": {"host": host, "gpu": 0, "pci": inj["pci"], "xid": inj["xid"], "step_at_fault": step_at_fault},
            "faulty_exit": codes.get(host),
            "rank_exits": {str(k): v for k, v in codes.items()},
            "spares_per_host": self.spares,
            "migration": None if joined is None else {k: joined.get(k) for k in keep},
            "peer_events": {str(r["rank"]): [{k: e.get(k) for k in ("epoch", "trigger", "migrated_rank", "state_from",
                                                                 "resume_step", "state_ms")} for e in r.get("rebuilds", [])]
                            for r in res},
            "hosts": self.hosts,
            "rails": self.rails,
            "errors": [e for r in survivors for e in r["errors"]],
            "workdir": str(self.workdir),
        }

    def close(self) -> None:
        self._stop_spares()
        self._stop_store()
        super().close()


def _print_device_fault_summary(r: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    ok = r["ok"]
    title = ("a hot spare takes the rank over" if r["spares_per_host"] else
             "no spare: every rank must stop cleanly (exit 69)")
    t = Table(title=f"linkpass demo --scenario device-fault: {title}", show_header=False)
    t.add_row("result", f"[green]{r['result']}[/]" if ok else f"[red]{r['result']}[/]")
    f = r["fault"]
    t.add_row("fault", f"host h{f['host']}, GPU {f['gpu']} ({f['pci']}), Xid {f['xid']} at step {f['step_at_fault']}")
    t.add_row("steps / lost", f"{r['steps']} / {r['steps_lost']}")
    t.add_row("weights match reference", str(r["weights_match_reference"]))
    t.add_row("migration (inject -> spare's first step)", "-" if r["migration_ms"] is None else f"{r['migration_ms']} ms")
    t.add_row("spare join", json.dumps(r["migration"]))
    t.add_row("faulty process exit", str(r["faulty_exit"]))
    t.add_row("rank exits", json.dumps(r["rank_exits"]))
    Console(emoji=False).print(t)
