"""``linkpass demo --script FILE --scenario rail|rail-latched|device-fault|snapshot``: an unmodified script
under ``linkpass exec`` + torchrun on the emulated fabric.

One torchrun agent per host (``--nnodes H --node-rank i --nproc-per-node 1``), each started as
``linkpass exec --config <host config> [--spares N] [--latched] -- torchrun ... FILE ARGS`` in the
host's namespace.  The fabric is in per-rail-IP mode and every daemon runs with ``reroute =
"notify-only"``: the kernel never moves a route, so only the hook can save the job.  The job's
store is torchrun's (agent on host 0, rendezvous address on host 0's rail-1 address, a network
the cut does not touch); the job's gloo traffic starts on rail 0 (``GLOO_SOCKET_IFNAME`` from
``linkpass exec``: the first usable rail).

The same script runs twice, each in a fresh working directory (so a snapshot file the script
writes is its own per run): once fault-free (the reference), then with the fault:

* ``rail``: rail 0 of the last host is cut (``--mode``, carrier loss by default) when that host
  has done about 30 % of the reference's steps; the hook rebuilds in-process on rail 1;
* ``rail-latched``: the same cut with the gloo wrapper latched as NCCL is (``linkpass exec
  --latched``): the cut rank hands over to its warm spare, the others rebuild in-process;
* ``device-fault``: Xid 79 on the last host's GPU 0 (``linkpass inject``): the rank moves to a
  warm spare with state from a healthy replica;
* ``at-risk``: at about 30 % of the run the last host's rail 0 starts to fail slowly: its
  ``port_rcv_errors`` climb (``linkpass inject counters``, 200 a second, until the daemon acts);
  the host's daemon finds the rail at risk by its counters (rule ``ib.port_rcv_errors.rate``),
  drains it (no fault yet), and the hooks move the job's process group to rail 1 at a step
  boundary; then the rail is cut (``--mode``).  The JSON adds ``at_risk`` (the verdict, the time
  from the first injected error to the drain ``verdict_ms``, and ``lead_time_ms``, drain ->
  cut), ``drained_before_cut``, ``rebuilds_after_cut`` (0: nothing was left on the rail) and
  ``stall_at_cut_ms`` (the longest gap between two optimizer steps of the cut host within 2 s
  after the cut or until its last step, progress polled every ms), next to ``max_step_stall_ms`` of the whole run
  (which holds the planned rebuild); ``recovery_ms`` is drain -> the slowest rank's first step
  on the new rail;
* ``snapshot``: no fault; at about 30 % of the run ``linkpass snapshot --job ... --wait`` (in host
  0's namespace, where the job's store is) takes a snapshot of the running job; then a third,
  fresh run starts with ``linkpass exec --resume`` from it.  The JSON adds ``snapshot_consistent``
  (the snapshot is complete, every rank's part is there and of the same step),
  ``restored_weights_match`` (every rank's weights right after the restore are bitwise the ones it
  saved: ``LINKPASS_SNAPSHOT_VERIFY=1``), ``snapshot_stall_ms`` (the longest training stall a
  rank had for it), ``snapshot_bytes``, ``snapshot_step``, ``snapshotted_run_matches_reference``
  (the snapshot did not change training); ``weights_match_reference`` compares the resumed run's
  final weights, ``recovery_ms`` is the slowest rank's restore (DCP load) and ``steps_lost`` the
  reference's steps minus the fewest a resumed rank ended at.

Report (JSON with ``--json``): ``scenario``, ``steps`` (optimizer steps of the reference run),
``steps_lost`` (reference steps minus the fewest any rank of the faulted run finished),
``weights_match_reference`` (each rank's sha256 over the parameters of the modules the hook
protects, bitwise equal to the same rank's in the reference), ``recovery_ms`` (fault issued ->
the slowest rank's first optimizer step after its recovery), ``max_step_stall_ms`` (the longest
time between two optimizer steps of any rank, faulted run), ``script_sha256`` (of FILE as run),
``protected_modules``, ``per_rank``, ``workdir`` and ``reference_from_cache``.

``--reference-cache DIR``: the fault-free run's reports are kept in DIR, keyed by what they
depend on (:meth:`ScriptDemo.reference_key`: the script, its arguments, the hosts, the
interpreter, torch, the CPU, linkpass's and the hook's code, the environment, any
``sitecustomize.py`` on ``PYTHONPATH``), and a later demo with the same key takes
them from there instead of training the reference again (the test suite runs a dozen scenarios
of the same script).
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from linkpass.lab import fabric as fab
from linkpass.lab.demo import DemoError, RebuildDemo

SCENARIOS = ("rail", "rail-latched", "device-fault", "snapshot", "at-risk")
DEFAULT_SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "ddp_train.py"
#: the default script's arguments: about 800 steps of a few ms each per rank
DEFAULT_SCRIPT_ARGS = "--epochs 3 --samples 16384 --batch-size 32 --snapshot snapshot.pt"


#: environment variables left out of :meth:`ScriptDemo.reference_key` (prefixes): they differ
#: between shells and test cases and no training script reads them
_VOLATILE_ENV = ("PYTEST_", "PWD", "OLDPWD", "SHLVL", "_", "COLUMNS", "LINES", "TERM", "SSH_", "DISPLAY", "XDG_",
                 "INVOCATION_ID", "JOURNAL_STREAM", "LS_COLORS", "MAIL", "HISTFILE")


class ScriptDemo(RebuildDemo):
    """See the module docstring."""

    def __init__(self, script: str, script_args: str, scenario: str, hosts: int, rails: int, name: str, mode: str,
                 spares: int = 1, fault_host: int | str | None = None, log=print):
        if scenario not in SCENARIOS:
            raise DemoError(f"--scenario for --script must be one of {', '.join(SCENARIOS)}", 2)
        p = Path(script)
        if not p.is_file():
            raise DemoError(f"--script {script}: no such file", 2)
        try:
            self.script_bytes = p.read_bytes()
        except OSError as e:
            raise DemoError(f"--script {script}: cannot read it ({e.strerror})", 2) from None
        try:
            compile(self.script_bytes, str(p), "exec")
        except SyntaxError as e:
            raise DemoError(f"--script {script}: line {e.lineno}: {e.msg} (the script does not compile)", 2) from None
        except ValueError as e:
            raise DemoError(f"--script {script}: {e}", 2) from None
        try:
            self.script_args = shlex.split(script_args)
        except ValueError as e:
            raise DemoError(f"--script-args: {e}", 2) from None
        super().__init__(hosts, rails, 50, name, mode, log=log)
        self.script = str(p.resolve())
        self.scenario = scenario
        self.spares = spares if scenario not in ("rail", "snapshot", "at-risk") else 0
        if fault_host == "all":
            if scenario in ("device-fault", "at-risk"):
                raise DemoError("--fault-host all: only for the rail scenarios (rail, rail-latched)", 2)
            self.fault_hosts = list(range(hosts))
        else:
            h = hosts - 1 if fault_host is None else fault_host
            if not isinstance(h, int) or not 0 <= h < hosts:
                raise DemoError(f"--fault-host must be 0..{hosts - 1} or all", 2)
            self.fault_hosts = [h]
        self.fault_host = self.fault_hosts[-1]  # the host whose progress times the fault
        #: in-memory snapshot interval of the device-fault run (steps; a rolled-back job redoes at most this many)
        self.memory_every = 10
        #: inject the fault when this file exists (None: at about 30 % of the run)
        self.fault_when: str | None = None
        #: a directory of fault-free runs' reports (``--reference-cache``; None: always run it)
        self.reference_cache: Path | None = None
        self.reference_from_cache = False
        if scenario not in ("rail", "snapshot", "at-risk") and spares < 1:
            raise DemoError(f"--scenario {scenario} needs --spares 1 or more", 2)

    # ------------------------------------------------------------- jobs

    def _launch(self, tag: str, port: int, spares: int = 0, latched: bool = False, exec_args: tuple = ()) -> None:
        import torch_hooks

        self.jobs = []
        store_addr = self.desc["hosts"][0]["rails"][self.STORE_RAIL]["address"]
        run_dir = self.workdir / tag
        run_dir.mkdir(exist_ok=True)
        exe = [sys.executable, "-m", "linkpass.cli"]
        root = str(Path(torch_hooks.__file__).resolve().parent.parent)
        for h in self.desc["hosts"]:
            i = h["index"]
            for f in (self._report_path(tag, i), self._progress_path(tag, i)):
                f.unlink(missing_ok=True)
            cfg = self.workdir / f"h{i}-notify-only.toml"
            cmd = exe + ["exec", "--config", str(cfg), "--no-live"]
            if spares:
                cmd += ["--spares", str(spares)]
            if latched:
                cmd += ["--latched"]
            cmd += list(exec_args)
            cmd += ["--", sys.executable, "-m", "torch.distributed.run", "--nnodes", str(self.hosts), "--node-rank", str(i),
                    "--nproc-per-node", "1", "--master-addr", store_addr, "--master-port", str(port),
                    "--max-restarts", "0", "--monitor-interval", "0.1", self.script] + self.script_args
            env = dict(os.environ, LINKPASS_JOB=f"demo-{tag}", LINKPASS_REPORT=str(self.workdir / f"{tag}-rank{{rank}}.json"),
                       LINKPASS_PROGRESS=str(self.workdir / f"{tag}-rank{{rank}}.progress"),
                       PYTHONPATH=os.pathsep.join([root] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])),
                       OMP_NUM_THREADS="1", LINKPASS_REBUILD_TIMEOUT_S="60", LINKPASS_HOST=h["name"],
                       LINKPASS_JOBS_DIR=str(self.workdir / "jobs"), LINKPASS_SNAPSHOT_VERIFY="1")
            env.pop("GLOO_SOCKET_IFNAME", None)
            logf = open(self.workdir / f"{tag}-host{i}.log", "w")
            self.jobs.append(subprocess.Popen(fab.netns_exec(self.name, i) + cmd, stdout=logf, stderr=subprocess.STDOUT,
                                              start_new_session=True, cwd=run_dir, env=env))

    def _wait_spares(self, tag: str, timeout: float = 120) -> None:
        """Until every worker's spares are listed in the job's store (each writes
        ``<progress file>.spare<id>`` then)."""
        deadline = time.monotonic() + timeout
        while True:
            n = [len(list(self.workdir.glob(f"{tag}-rank{h['index']}.progress.spare*"))) for h in self.desc["hosts"]]
            if all(k >= self.spares for k in n):
                return
            if any(j.poll() is not None for j in self.jobs):
                raise DemoError(f"{tag} run ended before its spares were up; see {self.workdir}/{tag}-host*.log")
            if time.monotonic() > deadline:
                raise DemoError(f"spares not up within {timeout:.0f} s (per host: {n}); see {self.workdir}/{tag}-host*.log")
            time.sleep(0.05)

    def _wait_file(self, path: Path, timeout: float) -> None:
        """Until ``path`` exists (``--fault-when``)."""
        deadline = time.monotonic() + timeout
        while not path.exists():
            if any(j.poll() is not None for j in self.jobs):
                raise DemoError(f"the run ended before {path} appeared; see {self.workdir}/faulted-host*.log")
            if time.monotonic() > deadline:
                raise DemoError(f"--fault-when {path}: not there within {timeout:.0f} s; see {self.workdir}/faulted-host*.log")
            time.sleep(0.01)

    def reference_key(self) -> str:
        """What the fault-free run's reports depend on, hashed (sha256 hex): the script's bytes and
        arguments, the number of hosts, the interpreter, torch and the CPU it computes with (its
        SIMD level changes float results), linkpass's and the hook's code, the environment the
        workers inherit (but for :data:`_VOLATILE_ENV`), and every ``sitecustomize.py`` on
        ``PYTHONPATH`` (it runs in the workers).  Files the script itself reads (modules of its
        own, data) are not in it: a cache is for a series of runs of the same script."""
        import platform

        import torch
        import torch_hooks

        h = hashlib.sha256()
        here = Path(__file__).resolve().parents[1]  # the linkpass package
        code = sorted(Path(torch_hooks.__file__).resolve().parent.rglob("*.py")) + sorted(here.rglob("*.py"))
        for d in filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep)):
            code.append(Path(d) / "sitecustomize.py")
        for f in code:
            try:
                h.update(str(f).encode() + b"\0" + f.read_bytes() + b"\0")
            except OSError:
                h.update(str(f).encode() + b"\0-\0")
        env = {k: v for k, v in os.environ.items() if not k.startswith(_VOLATILE_ENV)}
        h.update(json.dumps({"script": hashlib.sha256(self.script_bytes).hexdigest(), "args": self.script_args,
                             "hosts": self.hosts, "python": sys.executable, "torch": torch.__version__,
                             "machine": platform.machine(), "cpu": torch.backends.cpu.get_cpu_capability(),
                             "env": env}, sort_keys=True).encode())
        return h.hexdigest()

    def _reference(self) -> list[dict]:
        """The fault-free run's per-rank reports: from :attr:`reference_cache` when a run with the
        same :meth:`reference_key` is there (a run is deterministic: every scenario checks its
        weights bitwise against it), else run now (and kept there)."""
        cached = None if self.reference_cache is None else self.reference_cache / f"reference-{self.reference_key()}.json"
        if cached is not None and cached.is_file():
            try:
                ref = json.loads(cached.read_text())
                if (isinstance(ref, list) and all(isinstance(r, dict) for r in ref)
                        and sorted(r.get("rank", -1) for r in ref) == list(range(self.hosts))
                        and all(isinstance(r.get("steps"), int) and isinstance(r.get("weights_sha256"), str) for r in ref)):
                    self.reference_from_cache = True
                    self.log(f"reference run: not run again, its reports are taken from {cached} (the same script, "
                             "arguments, hosts, interpreter, torch, CPU, code and environment)")
                    return ref
                self.log(f"reference cache {cached}: not a list of {self.hosts} rank reports; running the reference")
            except (OSError, ValueError, TypeError) as e:  # TypeError: ranks of mixed types
                self.log(f"reference cache {cached}: unreadable ({e}); running the reference")
        self.log(f"reference run: {' '.join([Path(self.script).name, *self.script_args])} under linkpass exec + torchrun, "
                 "no fault")
        self._launch("reference", 29500)
        ref = self._wait_all("reference")
        if cached is not None:
            tmp = cached.with_suffix(f".tmp{os.getpid()}")
            try:
                tmp.write_text(json.dumps(ref))
                tmp.replace(cached)  # whole or not at all, for a demo running beside this one
            except OSError as e:
                self.log(f"reference cache {cached}: not written ({e.strerror})")
                tmp.unlink(missing_ok=True)
        return ref

    def _report_path(self, tag: str, rank: int) -> Path:
        return self.workdir / f"{tag}-rank{rank}.json"

    def _progress_path(self, tag: str, rank: int) -> Path:
        return self.workdir / f"{tag}-rank{rank}.progress"

    def _wait_all(self, tag: str, timeout: float = 300) -> list[dict]:
        deadline = time.monotonic() + timeout
        for j in self.jobs:
            try:
                j.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise DemoError(f"{tag} run did not finish in {timeout:.0f} s; see {self.workdir}/{tag}-host*.log") from None
        codes = [j.returncode for j in self.jobs]
        if any(codes):
            tails = "; ".join(f"h{i}: exit {c}: " + (_exit_reason(self.workdir / f"{tag}-host{i}.log")
                                                      or _tail(self.workdir / f"{tag}-host{i}.log"))
                              for i, c in enumerate(codes) if c)
            raise DemoError(f"{tag} run failed ({tails}); logs in {self.workdir}")
        res = []
        for h in self.desc["hosts"]:
            p = self._report_path(tag, h["index"])
            try:
                res.append(json.loads(p.read_text()))
            except (OSError, json.JSONDecodeError):
                raise DemoError(f"{tag} run: rank {h['index']} wrote no linkpass report ({p}): was the hook "
                                f"started? see {self.workdir}/{tag}-host{h['index']}.log") from None
        return res

    # ------------------------------------------------------------- run

    def run(self) -> dict:
        self.start()
        ref = self._reference()
        steps = min(r["steps"] for r in ref)
        if steps < 10:
            raise DemoError(f"the script made only {steps} optimizer steps: too few to cut mid-run (give it more work "
                            "with --script-args)", 2)
        if self.scenario == "snapshot":
            return self._run_snapshot(ref, steps)
        fault_host = self.fault_host
        latched = self.scenario == "rail-latched"
        self.log(f"faulted run: scenario {self.scenario}" + (f", {self.spares} warm spare(s) per worker" if self.spares else ""))
        # device fault: in-memory snapshots on, so a sharded (FSDP2) rank can be rebuilt from its peer's copy
        # (a DDP rank still takes a replica's state: 0 steps redone)
        mem = (("--snapshot-in-memory", "--snapshot-memory-every", str(self.memory_every))
               if self.scenario == "device-fault" and self.memory_every else ())
        self._launch("faulted", 29501, self.spares, latched, exec_args=mem)
        if self.spares:
            self._wait_spares("faulted")
        if self.fault_when:
            self._wait_file(Path(self.fault_when), timeout=240)
        else:
            # about 30 % of the run, and not before the spares are listed (they start with the job)
            self._wait_progress("faulted", fault_host, max(3, steps * 3 // 10, self._progress("faulted", fault_host) + 5),
                                timeout=240)
        step_at_fault = self._progress("faulted", fault_host)
        if step_at_fault > steps * 6 // 10 and not self.fault_when:
            raise DemoError(f"the script is too short: the spares were up only at step {step_at_fault} of {steps}; give it "
                            "more work with --script-args (more samples or epochs)", 2)
        if self.scenario == "at-risk":
            return self._run_at_risk(ref, steps, fault_host, step_at_fault)
        if self.scenario == "device-fault":
            from linkpass.lab.inject import inject_device_fault

            inj = inject_device_fault(self.name, fault_host, 0, 79)
            t_fault = inj.get("t_issued_ns") or time.monotonic_ns()
            fault = {"host": fault_host, "gpu": 0, "xid": 79, "step_at_fault": step_at_fault}
            self.log(f"injected Xid 79 on h{fault_host} GPU 0 at step {step_at_fault}")
        else:
            t_fault = min(fab.cut(self.name, h, self.PG_RAIL, self.mode)["t_issued_ns"] for h in self.fault_hosts)
            fault = {"host": fault_host if len(self.fault_hosts) == 1 else "all", "hosts": self.fault_hosts,
                     "rail": self.PG_RAIL, "mode": self.mode, "step_at_fault": step_at_fault}
            self.log(f"cut rail {self.PG_RAIL} of {', '.join(f'h{h}' for h in self.fault_hosts)} ({self.mode}) at step "
                     f"{step_at_fault}")
        res = self._wait_all("faulted")
        if self.scenario != "device-fault":
            for h in self.fault_hosts:
                fab.heal(self.name, h, self.PG_RAIL)
        return self._summary(ref, res, steps, fault, t_fault)

    def _rail_at_risk(self, host: int, rail: int) -> dict | None:
        from linkpass.lab.demo.common import _status

        st = _status(self.desc["hosts"][host]["control_socket"])
        r = next((x for x in st.get("rails", []) if x["id"] == rail), {})
        return r.get("at_risk") if r.get("state") == "DRAINED" else None

    def _rebuilt_lines(self, tag: str) -> int:
        n = 0
        for h in self.desc["hosts"]:
            try:
                n += (self.workdir / f"{tag}-host{h['index']}.log").read_text(errors="replace").count("process groups rebuilt")
            except OSError:
                pass
        return n

    def _run_at_risk(self, ref: list[dict], steps: int, host: int, step_at_fault: int) -> dict:
        """See ``at-risk`` in the module docstring."""
        import threading

        from linkpass.lab.inject import inject_counters

        rail = self.PG_RAIL
        drained = threading.Event()
        inj: dict = {}

        def climb() -> None:
            try:
                inj.update(inject_counters(self.name, host, "rail", rail, "port_rcv_errors", rate=200.0, duration_s=60.0,
                                           stop=drained.is_set))
            except Exception as e:  # noqa: BLE001 - reported below as no verdict
                inj["error"] = str(e)

        t_inject = time.monotonic_ns()
        th = threading.Thread(target=climb, daemon=True)
        th.start()
        self.log(f"h{host} rail {rail}: port_rcv_errors climb at 200/s from step {step_at_fault} (linkpass inject counters)")
        verdict = None
        deadline = time.monotonic() + 60
        while verdict is None:
            verdict = self._rail_at_risk(host, rail)
            if verdict is None:
                if time.monotonic() > deadline or inj.get("error"):
                    drained.set()
                    raise DemoError(f"h{host}'s daemon did not find rail {rail} at risk within 60 s"
                                    f"{': ' + inj['error'] if inj.get('error') else ''}; see `linkpass status`")
                time.sleep(0.05)
        t_drain = time.monotonic_ns()
        drained.set()
        th.join(5)
        self.log(f"h{host}'s daemon drained rail {rail}: {verdict.get('summary')} (rule {verdict.get('rule')})")
        # the hooks move the process group off the drained rail at a step boundary (every rank rebuilds)
        wait_until = time.monotonic() + 60
        while self._rebuilt_lines("faulted") < len(self.desc["hosts"]):
            if time.monotonic() > wait_until or any(j.poll() is not None for j in self.jobs):
                raise DemoError(f"the job's process groups did not leave rail {rail} within 60 s of the drain; see "
                                f"{self.workdir}/faulted-host*.log")
            time.sleep(0.01)
        # the cut comes once the job trains on the new rail (20 more steps), so what happens at the
        # cut is the cut's, not the tail of the planned rebuild
        self._wait_progress("faulted", host, self._progress("faulted", host) + 20, timeout=60)
        step_at_cut = self._progress("faulted", host)
        t_cut = fab.cut(self.name, host, rail, self.mode)["t_issued_ns"]
        self.log(f"cut rail {rail} of h{host} ({self.mode}) at step {step_at_cut}, {(t_cut - t_drain) / 1e6:.0f} ms after the drain")
        # the longest gap between two optimizer steps of the cut host in the 2 s after the cut
        last_step, last_t, gap = step_at_cut, time.monotonic_ns(), 0
        end = time.monotonic() + 2.0
        while time.monotonic() < end and self.jobs[host].poll() is None:
            now, cur = time.monotonic_ns(), self._progress("faulted", host)
            if cur >= steps:
                break  # the run is done: no step comes after its last one
            if cur != last_step:
                last_step, last_t = cur, now
            gap = max(gap, now - last_t)
            time.sleep(0.001)
        res = self._wait_all("faulted")
        fab.heal(self.name, host, rail)
        out = self._summary(ref, res, steps, {"host": host, "rail": rail, "mode": self.mode, "step_at_fault": step_at_fault,
                                              "step_at_cut": step_at_cut, "counter": "port_rcv_errors",
                                              "counter_from": inj.get("from"), "counter_to": inj.get("to")}, t_drain)
        after_cut = sum(1 for r in res for e in r.get("rebuilds", []) if (e.get("trigger_t_ns") or 0) >= t_cut)
        out.update(at_risk={**verdict, "verdict_ms": round((t_drain - t_inject) / 1e6, 3),
                            "lead_time_ms": round((t_cut - t_drain) / 1e6, 3)},
                   drained_before_cut=True, rebuilds_after_cut=after_cut, stall_at_cut_ms=round(gap / 1e6, 3),
                   recovery="drained before the fault (at risk by its counters)")
        return out

    def _run_snapshot(self, ref: list[dict], steps: int) -> dict:
        from torch_hooks import snapdir

        self.log("snapshotted run: the same script; a snapshot at about 30 % of it (linkpass snapshot --wait)")
        self._launch("snapshotted", 29501)
        self._wait_progress("snapshotted", 0, max(3, steps * 3 // 10), timeout=240)
        snaps = self.workdir / "snapshots"
        cmd = fab.netns_exec(self.name, 0) + [sys.executable, "-m", "linkpass.cli", "snapshot", "--job", "demo-snapshotted",
                                              "--to", str(snaps), "--wait", "--json", "--timeout", "240"]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                           env=dict(os.environ, LINKPASS_JOBS_DIR=str(self.workdir / "jobs")))
        if p.returncode != 0:
            raise DemoError(f"linkpass snapshot failed: {p.stderr.strip()[-400:]}; logs in {self.workdir}")
        taken = json.loads(p.stdout)
        snapped = self._wait_all("snapshotted")
        self.log(f"snapshot after step {taken['step']}: {taken['path']} ({taken['bytes']} bytes, stall {taken['stall_ms']} ms)")
        try:
            manifest = snapdir.read_manifest(taken["path"])
            consistent = (manifest["step"] == taken["step"] and manifest["world_size"] == len(snapped)
                          and all(part.get("ok") for part in manifest["ranks"].values())
                          and all([(e["step"], e["ok"]) for e in r.get("snapshots", [])] == [(taken["step"], True)]
                                  for r in snapped))
        except snapdir.SnapshotError as e:
            self.log(f"the snapshot is not usable: {e}")
            consistent = False
        self.log(f"resumed run: a fresh job, linkpass exec --resume {taken['path']}")
        self._launch("resumed", 29502, exec_args=("--resume", taken["path"]))
        res = self._wait_all("resumed")
        out = self._summary(ref, res, steps, {"kind": "snapshot", "step": taken["step"], "path": taken["path"]}, 0)
        by_rank = {r["rank"]: r for r in ref}
        resumes = [r.get("resume") or {} for r in res]
        out.update(
            snapshot_step=taken["step"], snapshot_path=taken["path"], snapshot_bytes=taken["bytes"],
            snapshot_stall_ms=taken["stall_ms"], snapshot_write_ms=taken["write_ms"], snapshot_consistent=consistent,
            restored_weights_match=all(e.get("match") is True for e in resumes),
            recovery_ms=max((e.get("restore_ms") or 0.0) for e in resumes) if all(resumes) else None,
            snapshotted_run_matches_reference=all(r["weights_sha256"] == by_rank.get(r["rank"], {}).get("weights_sha256")
                                                  for r in snapped),
            max_step_stall_ms=max((r["max_step_stall_ms"] or 0.0) for r in snapped))
        for r in res:
            out["per_rank"][str(r["rank"])]["resume"] = r.get("resume")
        return out

    def _summary(self, ref: list[dict], res: list[dict], steps: int, fault: dict, t_fault: int) -> dict:
        by_rank = {r["rank"]: r for r in ref}
        same = all(r["weights_sha256"] is not None and r["weights_sha256"] == by_rank.get(r["rank"], {}).get("weights_sha256")
                   for r in res)
        firsts = []
        for r in res:
            after = [e for e in r.get("rebuilds", []) + r.get("handovers", []) if (e.get("trigger_t_ns") or 0) >= t_fault - 10**9]
            firsts.append(after[0] if after else None)
        resumed = [e.get("first_step_t_ns") for e in firsts if e]
        recovery = round((max(resumed) - t_fault) / 1e6, 3) if resumed and None not in resumed and len(resumed) == len(res) else None
        stall = max((r["max_step_stall_ms"] or 0.0) for r in res)
        rollbacks = [e for e in firsts if e and e.get("event") == "rollback"]
        return {
            "recovery": ("rollback to the in-memory snapshot" if rollbacks else
                         "replica state" if any(e and e.get("kind") == "device" for e in firsts) else "in-process"),
            "steps_redone": max((int(e["at_step"]) - int(e["step"]) for e in rollbacks
                                 if e.get("at_step") is not None and e.get("step") is not None), default=0),
            "rollback_step": rollbacks[0].get("step") if rollbacks else None,
            "scenario": self.scenario,
            "steps": steps,
            "steps_lost": steps - min(r["steps"] for r in res),
            "weights_match_reference": same,
            "reference_from_cache": self.reference_from_cache,
            "recovery_ms": recovery,
            "max_step_stall_ms": stall,
            "median_step_ms": res[0].get("median_step_ms"),
            "script": self.script,
            "script_sha256": hashlib.sha256(self.script_bytes).hexdigest(),
            "script_args": self.script_args,
            "protected_modules": res[0].get("protected_modules", []),
            "fault": fault,
            "per_rank": {str(r["rank"]): {"steps": r["steps"], "weights_sha256": r["weights_sha256"],
                                          "reference_sha256": by_rank.get(r["rank"], {}).get("weights_sha256"),
                                          "recoveries": [{k: v for k, v in e.items() if not k.endswith("_t_ns")}
                                                         for e in r.get("rebuilds", []) + r.get("handovers", [])],
                                          "groups": r.get("groups")} for r in res},
            "reroute": "notify-only",
            "hosts": self.hosts,
            "rails": self.rails,
            "workdir": str(self.workdir),
        }


def _exit_reason(p: Path) -> str | None:
    """The hook's own exit line in a host's log (``linkpass: ...; exiting with status N``)."""
    try:
        lines = p.read_text(errors="replace").splitlines()
    except OSError:
        return None
    mine = [ln.strip() for ln in lines if ln.startswith("linkpass: ") and "exiting with status" in ln]
    return mine[0][:400] if mine else None


def _tail(p: Path, n: int = 300) -> str:
    try:
        lines = [ln for ln in p.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "(no log)"
    return " | ".join(lines[-3:])[-n:]


def print_summary(r: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    snap = r["scenario"] == "snapshot"
    ok = r["steps_lost"] == 0 and r["weights_match_reference"] and (not snap or (r["snapshot_consistent"]
                                                                               and r["restored_weights_match"]))
    t = Table(title=f"linkpass demo --scenario {r['scenario']}: {Path(r['script']).name}, unmodified", show_header=False)
    why = []
    if r["steps_lost"]:
        why.append(f"{r['steps_lost']} steps lost")
    bad = [k for k, v in r.get("per_rank", {}).items() if v.get("weights_sha256") != v.get("reference_sha256")]
    if bad:
        why.append(f"weights differ from the fault-free run on rank(s) {', '.join(bad)}")
    if snap:
        if not r["snapshot_consistent"]:
            why.append("the snapshot is not consistent")
        if not r["restored_weights_match"]:
            why.append("the restored weights are not the snapshot's")
    good = ("the snapshot restored bitwise in a fresh run, which ended with the uninterrupted run's weights" if snap else
            "the script trained through the fault; weights identical to the fault-free run")
    t.add_row("result", f"[green]{good}[/]" if ok else f"[red]the job was disturbed: {'; '.join(why) or 'see the table'}[/]")
    if snap:
        t.add_row("snapshot", f"after step {r['snapshot_step']}: {r['snapshot_bytes']} bytes, training stalled "
                  f"{r['snapshot_stall_ms']} ms, written in {r['snapshot_write_ms']} ms; consistent {r['snapshot_consistent']}")
        t.add_row("restored weights match the snapshot", str(r["restored_weights_match"]))
    if r["scenario"] == "at-risk":
        v = r["at_risk"]
        t.add_row("at risk", f"{v.get('summary')}: drained {v['verdict_ms']:.0f} ms after the first injected error, "
                  f"{v['lead_time_ms']:.0f} ms before the cut")
        t.add_row("leaving the drained rail", f"a planned rebuild at a step boundary, {r['recovery_ms']} ms from the drain to "
                  f"the last rank's first step on the new rail (the longest step of the run, below, is likely this one)")
        t.add_row("at the cut", f"{r['rebuilds_after_cut']} rebuilds, longest gap between steps {r['stall_at_cut_ms']} ms")
    t.add_row("fault", json.dumps(r["fault"]))
    t.add_row("steps / lost", f"{r['steps']} / {r['steps_lost']}")
    t.add_row("weights match reference", str(r["weights_match_reference"]))
    if r["scenario"] != "at-risk":
        t.add_row("restore (DCP load, slowest rank)" if snap else "recovery (fault -> training resumed)", f"{r['recovery_ms']} ms")
    t.add_row("longest step (stall)", f"{r['max_step_stall_ms']} ms (median {r['median_step_ms']} ms)")
    t.add_row("protected modules", ", ".join(f"{m['kind']}:{m['class']} ({m['numel']} params)" for m in r["protected_modules"]))
    t.add_row("script sha256", r["script_sha256"][:16] + "...")
    Console(emoji=False).print(t)
