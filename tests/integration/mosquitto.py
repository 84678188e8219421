"""Test helpers: a real Mosquitto broker (Debian package ``mosquitto``) on a free loopback port,
and a real subscriber (``mosquitto_sub``), optionally inside a network namespace.

Nothing here needs the system service: each broker runs from a generated mosquitto.conf in the
test's temporary directory (``listener PORT 127.0.0.1``, ``user root`` so it keeps reading
root's 0600 files, persistence in the same directory) and is stopped by the fixture.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

from linkpass.lab.ports import listen_port

MOSQUITTO = shutil.which("mosquitto") or ("/usr/sbin/mosquitto" if os.path.exists("/usr/sbin/mosquitto") else None)
MOSQUITTO_SUB = shutil.which("mosquitto_sub")
MOSQUITTO_PASSWD = shutil.which("mosquitto_passwd")
HAVE_MOSQUITTO = bool(MOSQUITTO and MOSQUITTO_SUB and MOSQUITTO_PASSWD)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (root namespace), outside the ephemeral range
    (:mod:`linkpass.lab.ports`)."""
    return listen_port()


def _prefix(netns: str | None) -> list[str]:
    return ["ip", "netns", "exec", netns] if netns else []


def wait_for(pred, timeout: float = 10.0, what: str = "condition", step: float = 0.02):
    """Poll ``pred`` until truthy; AssertionError naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = pred()
        if last:
            return last
        time.sleep(step)
    raise AssertionError(f"timed out after {timeout} s waiting for {what} (last value {last!r})")


class Mosquitto:
    """One mosquitto process.

    Args:
        workdir: directory for the config, log, persistence and password file.
        netns: network namespace to run in (None: the test's own, i.e. root).
        port: listener port (default: a free one; inside a fresh namespace every port is free).
        users: ``{user: password}`` -> password_file made with mosquitto_passwd and no anonymous
            access; None -> allow_anonymous.
        tls: ``{"cafile", "certfile", "keyfile", "require_certificate": bool}`` for the listener.
    """

    def __init__(self, workdir: Path, netns: str | None = None, port: int | None = None,
                 users: dict[str, str] | None = None, tls: dict | None = None, persistence: bool = True):
        self.dir = Path(workdir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.netns = netns
        self.port = port or (free_port() if netns is None else 20000 + int.from_bytes(os.urandom(2), "big") % 30000)
        self.host = "127.0.0.1"
        self.conf = self.dir / f"mosquitto-{self.port}.conf"
        self.log = self.dir / f"mosquitto-{self.port}.log"
        self.proc: subprocess.Popen | None = None
        self.subscribers: list["Subscriber"] = []  # closed by close(), also when a test fails
        lines = [f"listener {self.port} 127.0.0.1", "user root", f"log_dest file {self.log}",
                 "log_type error", "log_type warning", "log_type notice", "log_type information", "log_type subscribe",
                 "connection_messages true", "max_queued_messages 0"]
        if persistence:
            (self.dir / "db").mkdir(exist_ok=True)
            lines += ["persistence true", f"persistence_location {self.dir / 'db'}/", "autosave_interval 1"]
        if users:
            pw = self.dir / "passwd"
            pw.unlink(missing_ok=True)
            for i, (u, p) in enumerate(users.items()):
                subprocess.run([MOSQUITTO_PASSWD, "-b"] + (["-c"] if i == 0 else []) + [str(pw), u, p], check=True,
                               capture_output=True)
            os.chmod(pw, 0o600)
            lines += [f"password_file {pw}", "allow_anonymous false"]
        else:
            lines += ["allow_anonymous true"]
        if tls:
            lines += [f"cafile {tls['cafile']}", f"certfile {tls['certfile']}", f"keyfile {tls['keyfile']}",
                      f"require_certificate {'true' if tls.get('require_certificate') else 'false'}"]
        self.conf.write_text("\n".join(lines) + "\n")

    def start(self, timeout: float = 10.0) -> "Mosquitto":
        """Start and wait until it listens (its log says so)."""
        mark = self.log.stat().st_size if self.log.exists() else 0
        self.proc = subprocess.Popen(_prefix(self.netns) + [MOSQUITTO, "-c", str(self.conf)], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, start_new_session=True)

        def ready():
            if self.proc.poll() is not None:
                raise AssertionError(f"mosquitto exited ({self.proc.returncode}): {self.proc.stderr.read().decode(errors='replace')}"
                                     f"{self.log_text()[-1500:]}")
            return self.log.exists() and " running" in self.log.read_text(errors="replace")[mark:]
        wait_for(ready, timeout, "mosquitto to listen")
        return self

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Stop it (SIGTERM saves persistence) and wait."""
        p, self.proc = self.proc, None
        if p is None or p.poll() is not None:
            return
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            pass
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(5)
        if p.stderr:
            p.stderr.close()

    def subscriptions(self, topic: str, client_id: str | None = None) -> int:
        """How many SUBSCRIBEs to exactly ``topic`` (by ``client_id``, or anyone) the log shows."""
        cid = re.escape(client_id) if client_id else r"\S+"
        return len(re.findall(rf"^\d+: {cid} \d {re.escape(topic)}$", self.log_text(), re.M))

    def wait_subscribed(self, topic: str, count: int = 1, client_id: str | None = None, timeout: float = 10.0) -> None:
        """Wait until ``count`` subscriptions to ``topic`` are in place (messages published
        before that would not reach the subscriber)."""
        wait_for(lambda: self.subscriptions(topic, client_id) >= count, timeout, f"{count} subscription(s) to {topic}")

    def close(self) -> None:
        """Stop the subscribers made for this broker, then the broker (fixture teardown)."""
        for s in self.subscribers:
            s.close()
        self.stop()

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


class Subscriber:
    """``mosquitto_sub`` writing one JSON object per message (``-F %j``, MQTT 5, properties
    included) to a file; a persistent session (``-c``) by default, so messages published while
    the broker restarts still reach it.

    Args:
        broker: the :class:`Mosquitto` to connect to (its namespace is used).
        topics: topic filters.
        qos: subscription QoS (2: every message arrives with the QoS it was published with).
        client_id: session id (persistent when ``persistent``).
        user, password: credentials, if the broker needs them.
    """

    def __init__(self, broker: Mosquitto, topics: list[str], qos: int = 2, client_id: str | None = None,
                 persistent: bool = True, user: str | None = None, password: str | None = None, v5: bool = True):
        self.broker = broker
        broker.subscribers.append(self)
        self.topics = list(topics)
        self.client_id = client_id or f"test-sub-{os.getpid()}-{time.monotonic_ns() % 10**9}"
        self.out = broker.dir / f"sub-{client_id or os.getpid()}-{int(time.monotonic_ns())}.jsonl"
        argv = [MOSQUITTO_SUB, "-h", broker.host, "-p", str(broker.port), "-q", str(qos), "-F", "%j"]
        if v5:
            argv += ["-V", "mqttv5"]
        argv += ["-i", self.client_id]
        if persistent:
            argv += ["-c"]
            if v5:
                argv += ["-x", "3600"]  # session expiry: keep the session while the broker restarts
        if user:
            argv += ["-u", user, "-P", password or ""]
        for t in topics:
            argv += ["-t", t]
        self._f = open(self.out, "wb")
        self.proc = subprocess.Popen(_prefix(broker.netns) + ["stdbuf", "-oL"] + argv, stdout=self._f,
                                     stderr=subprocess.PIPE, start_new_session=True)

    def messages(self) -> list[dict]:
        """Every message so far: mosquitto_sub's JSON (``topic``, ``qos``, ``retain``,
        ``properties``) with ``payload`` parsed as JSON when it is JSON."""
        out = []
        for line in self.out.read_bytes().splitlines():
            if not line.strip():
                continue
            try:
                m = json.loads(line)
            except ValueError:
                continue  # a line being written
            p = m.get("payload")
            if isinstance(p, str):
                try:
                    m["payload"] = json.loads(p)
                except ValueError:
                    pass
            out.append(m)
        return out

    def on(self, suffix: str) -> list[dict]:
        """Messages whose topic ends with ``suffix`` (``events``, ``state``, ...)."""
        return [m for m in self.messages() if m["topic"].endswith(suffix)]

    def wait_connected(self, timeout: float = 10.0) -> None:
        """Wait until the broker logged this subscriber's subscriptions (once is enough: a
        persistent session keeps them across broker restarts)."""
        def subscribed():
            if self.proc.poll() is not None:
                raise AssertionError(f"mosquitto_sub exited: {self.proc.stderr.read().decode(errors='replace')}")
            return all(self.broker.subscriptions(t, self.client_id) for t in self.topics)
        wait_for(subscribed, timeout, f"subscriber {self.client_id} to subscribe")

    def close(self) -> None:
        """Stop mosquitto_sub (idempotent)."""
        if self._f.closed:
            return
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        if self.proc.stderr:
            self.proc.stderr.close()
        self._f.close()


def dedup(events: list[dict]) -> list[dict]:
    """Event payloads in arrival order, the first of each ``id`` only."""
    seen: set = set()
    out = []
    for m in events:
        p = m["payload"]
        if p["id"] in seen:
            continue
        seen.add(p["id"])
        out.append(p)
    return out


def make_tls(dirpath: Path, cn: str = "127.0.0.1") -> dict:
    """A CA, a broker certificate for 127.0.0.1 and a client certificate (openssl CLI);
    returns their paths (``ca``, ``server_cert``, ``server_key``, ``client_cert``, ``client_key``)."""
    d = Path(dirpath)
    d.mkdir(parents=True, exist_ok=True)

    def ossl(*a: str) -> None:
        subprocess.run(["openssl", *a], check=True, capture_output=True)

    ossl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=linkpass test CA",
         "-keyout", str(d / "ca.key"), "-out", str(d / "ca.pem"))
    (d / "san.ext").write_text(f"subjectAltName=IP:{cn}\n")
    for name, subj in (("server", f"/CN={cn}"), ("client", "/CN=linkpass-client")):
        ossl("req", "-newkey", "rsa:2048", "-nodes", "-subj", subj, "-keyout", str(d / f"{name}.key"), "-out", str(d / f"{name}.csr"))
        ossl("x509", "-req", "-in", str(d / f"{name}.csr"), "-CA", str(d / "ca.pem"), "-CAkey", str(d / "ca.key"),
             "-CAcreateserial", "-days", "2", "-out", str(d / f"{name}.pem"),
             *(["-extfile", str(d / "san.ext")] if name == "server" else []))
        os.chmod(d / f"{name}.key", 0o600)
    return {"ca": str(d / "ca.pem"), "server_cert": str(d / "server.pem"), "server_key": str(d / "server.key"),
            "client_cert": str(d / "client.pem"), "client_key": str(d / "client.key")}
