"""A plan's route requests go to the kernel in one datagram (``NexthopSocket.request_many``):
against a real kernel, two namespaces joined by two veth rails (198.18.0.0/15), the code run
by a child in namespace A.  What is checked: every request gets its own answer (a refused one
in the middle of a batch fails alone, the ones after it still go in), batches larger than
``BATCH_MAX`` are split, and the route actuator reports exactly the refused destinations."""

from __future__ import annotations

import errno
import json
import secrets
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from .daemons import sh, veth_pair

ROOT = Path(__file__).resolve().parents[2]
OCTET = 238  # rails 198.18.238.0/24 (r0) and 198.18.239.0/24 (r1)
BAD_GW = "198.18.250.2"  # on no subnet of r0: the kernel refuses a route via it (fib_check_nh)


def dst(i: int) -> str:
    return f"198.19.{100 + i // 250}.{1 + i % 250}/32"


RAW = textwrap.dedent("""
    import json, socket, sys
    from linkpass.adapters import nhlink
    from linkpass.core.model import Nexthop, RouteSpec
    n, bad = int(sys.argv[1]), int(sys.argv[2])
    def dst(i): return f"198.19.{100 + i // 250}.{1 + i % 250}/32"
    idx = {"r0": socket.if_nametoindex("r0")}
    msgs = [nhlink.inline_route_request(RouteSpec(dst(i), (Nexthop("198.18.250.2" if i == bad else "198.18.238.2", "r0", 0),),
                                                  "", 254, 0, 201), idx, 0) for i in range(n)]
    nl = nhlink.NexthopSocket()
    sends = []
    class Counting:  # the socket, counting the datagrams sent
        def __init__(self, s): self.s = s
        def send(self, b): sends.append(len(b)); return self.s.send(b)
        def recv(self, n): return self.s.recv(n)
        def close(self): self.s.close()
    nl.sock = Counting(nl.sock)
    print(json.dumps({"errnos": nl.request_many(msgs), "sends": len(sends)}))
""")

ACTUATOR = textwrap.dedent("""
    import asyncio, json, logging, sys
    from linkpass.adapters.routes import RouteActuator, RouteSettings
    lines = []
    class Keep(logging.Handler):
        def emit(self, rec): lines.append([rec.levelname, rec.getMessage()])
    logging.getLogger("linkpass.routes").addHandler(Keep())
    logging.getLogger("linkpass.routes").setLevel(logging.INFO)
    from linkpass.core.model import ApplyRoutes, Nexthop, RouteSpec
    NH = {0: Nexthop("198.18.238.2", "r0", 0), 1: Nexthop("198.18.239.2", "r1", 1), 9: Nexthop("198.18.250.2", "r0", 0)}
    def dst(i): return f"198.19.{100 + i // 250}.{1 + i % 250}/32"
    async def main():
        a = RouteActuator(lambda e: None, RouteSettings(201, 254, sys.argv[1] == "1"))
        gen = 0
        for line in sys.stdin:
            c = json.loads(line)
            gen += 1
            routes = tuple(RouteSpec(dst(i), tuple(sorted(NH[k] for k in rails)), "198.19.238.1", 254, 0, 201)
                           for i, rails in enumerate(c["rails"]))
            routes += tuple(RouteSpec(d, (NH[1],), "198.19.238.1", 254, 0, 201) for d in c.get("extra", ()))
            lines.clear()
            r = await a.reconcile(ApplyRoutes(gen, routes))
            print(json.dumps({"replaced": r.replaced, "deleted": r.deleted, "errors": list(r.errors), "log": lines}), flush=True)
    asyncio.run(main())
""")


@pytest.fixture
def pair():
    tag = secrets.token_hex(3)
    a, b = f"lpnb{tag}a", f"lpnb{tag}b"
    veth_pair(a, b, OCTET)
    try:
        yield a
    finally:
        for ns in (a, b):
            sh("ip", "netns", "del", ns, check=False)


def our_routes(ns: str) -> dict[str, list[str]]:
    """dst -> the netdevs its route uses (inline nexthops or a nexthop group's members)."""
    out = {}
    nhs = {o["id"]: o for o in json.loads(sh("ip", "-j", "-n", ns, "nexthop", "show").stdout or "[]")}
    for r in json.loads(sh("ip", "-j", "-n", ns, "route", "show", "table", "254").stdout or "[]"):
        if r.get("protocol") not in (201, "201"):
            continue
        if "nhid" in r:
            devs = [nhs[m["id"]]["dev"] for m in nhs[r["nhid"]].get("group", [])] or [nhs[r["nhid"]]["dev"]]
        elif "nexthops" in r:
            devs = [nh["dev"] for nh in r["nexthops"]]
        else:
            devs = [r["dev"]]
        out[r["dst"] + ("" if "/" in r["dst"] else "/32")] = sorted(devs)
    return out


def test_a_refused_request_in_a_batch_fails_alone_and_big_batches_are_split(pair):
    n, bad = 300, 150  # 300 requests: 3 datagrams of at most BATCH_MAX (128)
    p = subprocess.run(["ip", "netns", "exec", pair, sys.executable, "-c", RAW, str(n), str(bad)], capture_output=True,
                       text=True, cwd=ROOT, timeout=60)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["sends"] == 3
    errnos = out["errnos"]
    assert len(errnos) == n and errnos[bad] != 0
    assert [i for i, e in enumerate(errnos) if e] == [bad]
    routes = our_routes(pair)
    assert set(routes) == {dst(i) for i in range(n) if i != bad}


@pytest.mark.parametrize("objects", [False, True], ids=["inline", "nexthop-objects"])
def test_the_actuator_reports_exactly_the_refused_destinations_of_a_big_plan(pair, objects):
    n = 200
    child = subprocess.Popen(["ip", "netns", "exec", pair, sys.executable, "-c", ACTUATOR, "1" if objects else "0"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)

    def plan(rails: list[list[int]], extra: tuple[str, ...] = ()) -> dict:
        child.stdin.write(json.dumps({"rails": rails, "extra": list(extra)}) + "\n")
        child.stdin.flush()
        line = child.stdout.readline()
        assert line, "the actuator child died"
        return json.loads(line)

    try:
        r = plan([[0, 1]] * n)
        assert r["errors"] == [] and r["replaced"] >= n
        assert our_routes(pair) == {dst(i): ["r0", "r1"] for i in range(n)}
        # a big plan logs its first LOG_EACH (16) changes and how many more, not one line each
        info = [m for lvl, m in r["log"] if lvl == "INFO"]
        assert len(info) == 17 and info[-1].endswith(f"{r['replaced'] - 16} more changes in this batch (listed at DEBUG)"), info
        # rail 0 out for everyone, and destination 7 onto a gateway the kernel refuses
        r = plan([[9] if i == 7 else [1] for i in range(n)])
        if objects:  # the refused leaf, and the one group that was to use it
            assert len(r["errors"]) == 2 and "198.18.250.2" in r["errors"][0], r["errors"]
        else:
            assert len(r["errors"]) == 1 and dst(7) in r["errors"][0], r["errors"]
        logged = [m for lvl, m in r["log"] if lvl == "ERROR"]
        assert all(any(e.split(":")[0] in m for m in logged) for e in r["errors"]), r["log"]  # every failure logged
        want = {dst(i): ["r1"] for i in range(n)}
        want[dst(7)] = ["r0", "r1"]  # refused: left as it was
        assert our_routes(pair) == want
        # the next plan goes in whole
        r = plan([[1]] * n)
        assert r["errors"] == []
        assert our_routes(pair) == {dst(i): ["r1"] for i in range(n)}
        # a destination no request can carry (an address inet_aton refuses) fails alone
        r = plan([[0, 1]] * n, extra=("198.19.256.1/32",))
        assert len(r["errors"]) == 1 and "198.19.256.1" in r["errors"][0], r["errors"]
        assert our_routes(pair) == {dst(i): ["r0", "r1"] for i in range(n)}
    finally:
        child.stdin.close()
        child.wait(10)


def test_request_raises_the_kernels_errno(pair):
    code = textwrap.dedent("""
        from linkpass.adapters import nhlink
        nl = nhlink.NexthopSocket()
        try:
            nl.request(lambda seq: nhlink.nexthop_delete_request(987654, seq))
        except nhlink.NetlinkNackError as e:
            print(e.errno)
    """)
    p = subprocess.run(["ip", "netns", "exec", pair, sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                       timeout=60)
    assert p.returncode == 0, p.stderr
    assert int(p.stdout) == errno.ENOENT
