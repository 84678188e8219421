"""The route actuator's in-turn apply (``submit(plan, now=True)``) against a real kernel: two
namespaces joined by two veth rails (198.18.0.0/15), the actuator's ``run`` task in a child in
namespace A.  The child reads its commands from stdin synchronously, which blocks its event
loop: the ``run`` task gets no turn between "submit" and "wait", so whatever the kernel holds
in between was put there by ``submit`` itself."""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from .daemons import sh, veth_pair

ROOT = Path(__file__).resolve().parents[2]
DST = "198.19.244.2/32"

CHILD = textwrap.dedent("""
    import asyncio, json, sys, time
    from linkpass.adapters.routes import RouteActuator, RouteSettings
    from linkpass.core.model import ApplyRoutes, Nexthop, RouteSpec
    NH = {0: Nexthop("198.18.244.2", "r0", 0), 1: Nexthop("198.18.245.2", "r1", 1),
          9: Nexthop("198.18.246.2", "r0", 0)}  # 9: a gateway on no subnet of r0 (the kernel refuses it)
    async def main():
        q = asyncio.Queue()
        a = RouteActuator(q.put_nowait, RouteSettings(201, 254, sys.argv[1] == "1"))
        task = asyncio.create_task(a.run())
        gen = 0
        for line in sys.stdin:
            c = json.loads(line)
            if c["cmd"] == "submit":
                gen += 1
                routes = tuple(RouteSpec(DST, tuple(sorted(NH[k] for k in c["rails"])), "198.19.244.1", 254, 0, 201)
                               for DST in c["dsts"])
                a.submit(ApplyRoutes(gen, routes, resync=c.get("resync", False)), now=c["now"])
                print(json.dumps({"gen": gen, "early_total": a.early_total, "t_ns": time.monotonic_ns()}), flush=True)
            else:
                r = await asyncio.wait_for(q.get(), 10)
                print(json.dumps({"gen": r.generation, "t_ns": r.t_ns, "replaced": r.replaced, "deleted": r.deleted,
                                  "errors": list(r.errors)}), flush=True)
        task.cancel()
    asyncio.run(main())
""")


class Pair:
    def __init__(self, objects: bool):
        tag = secrets.token_hex(3)
        self.a, self.b = f"lpan{tag}a", f"lpan{tag}b"
        veth_pair(self.a, self.b, 244)
        self.child = subprocess.Popen(["ip", "netns", "exec", self.a, sys.executable, "-c", CHILD, "1" if objects else "0"],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)

    def _ask(self, c: dict) -> dict:
        self.child.stdin.write(json.dumps(c) + "\n")
        self.child.stdin.flush()
        line = self.child.stdout.readline()
        assert line, "the actuator child died"
        return json.loads(line)

    def submit(self, rails, now=True, dsts=(DST,), resync=False) -> dict:
        return self._ask({"cmd": "submit", "rails": list(rails), "now": now, "dsts": list(dsts), "resync": resync})

    def wait(self) -> dict:
        return self._ask({"cmd": "wait"})

    def devs(self, dst: str = DST) -> list[str]:
        """The netdevs the kernel's route to ``dst`` uses (inline nexthops or a group's members)."""
        out = json.loads(sh("ip", "-j", "-n", self.a, "route", "show", dst).stdout or "[]")
        if not out:
            return []
        r = out[0]
        if "nhid" in r:
            nhs = {o["id"]: o for o in json.loads(sh("ip", "-j", "-n", self.a, "nexthop", "show").stdout)}
            return sorted(nhs[m["id"]]["dev"] for m in nhs[r["nhid"]]["group"])
        return sorted(nh["dev"] for nh in r["nexthops"]) if "nexthops" in r else [r["dev"]]

    def close(self):
        self.child.stdin.close()
        self.child.wait(10)
        for ns in (self.a, self.b):
            sh("ip", "netns", "del", ns, check=False)


@pytest.fixture(params=[False, True], ids=["inline", "nexthop-objects"])
def pair(request):
    p = Pair(request.param)
    try:
        yield p
    finally:
        p.close()


def test_reroute_is_in_the_kernel_when_submit_returns(pair):
    s = pair.submit((0, 1))
    assert s["early_total"] == 0 and pair.devs() == []  # no picture yet: the first pass reads the kernel
    first = pair.wait()
    assert first["errors"] == [] and pair.devs() == ["r0", "r1"]
    s = pair.submit((1,))
    assert s["early_total"] == 1 and pair.devs() == ["r1"]  # before the run task had a turn
    r = pair.wait()
    assert r["gen"] == s["gen"] and r["errors"] == [] and r["replaced"] == 1
    assert r["t_ns"] <= s["t_ns"]  # RoutesApplied carries the ACK of the in-turn replace
    s = pair.submit((0, 1))  # failback
    assert s["early_total"] == 2 and pair.devs() == ["r0", "r1"]
    assert pair.wait()["replaced"] == 1


def test_without_now_the_pass_does_it(pair):
    pair.submit((0, 1))
    pair.wait()
    s = pair.submit((1,), now=False)
    assert s["early_total"] == 0 and pair.devs() == ["r0", "r1"]
    r = pair.wait()
    assert r["replaced"] == 1 and r["t_ns"] > s["t_ns"] and pair.devs() == ["r1"]


def test_a_resync_plan_replaces_first_then_the_pass_deletes_the_stale(pair):
    other = "198.19.244.3/32"
    pair.submit((0, 1), dsts=(DST, other))
    pair.wait()
    assert pair.devs(other) == ["r0", "r1"]
    s = pair.submit((1,), dsts=(DST,), resync=True)
    assert s["early_total"] == 1 and pair.devs() == ["r1"] and pair.devs(other) == ["r0", "r1"]  # deletions wait for the pass
    r = pair.wait()
    assert r["errors"] == [] and r["replaced"] == 1 and r["deleted"] >= 1
    assert pair.devs() == ["r1"] and pair.devs(other) == []


def test_a_refused_replace_is_redone_and_reported_by_the_pass(pair):
    pair.submit((0, 1))
    pair.wait()
    s = pair.submit((9,))  # the kernel refuses the gateway: nothing changes, no early ACK
    assert s["early_total"] == 0 and pair.devs() == ["r0", "r1"]
    r = pair.wait()
    assert r["errors"] and r["replaced"] == 0
    assert pair.devs() == ["r0", "r1"]
    s = pair.submit((1,))  # the failed pass dropped its picture: this one reads the kernel first
    r = pair.wait()
    assert r["errors"] == [] and pair.devs() == ["r1"]


def test_a_plan_superseded_before_its_pass_hands_its_ack_to_the_next(pair):
    pair.submit((0, 1))
    pair.wait()
    s1 = pair.submit((1,))
    s2 = pair.submit((1,))  # the same routes (say a notice-only change): nothing left to replace
    assert s1["early_total"] == 1 and s2["early_total"] == 1
    r = pair.wait()  # one pass, for the newest plan
    assert r["gen"] == s2["gen"] and r["replaced"] == 1 and r["t_ns"] <= s1["t_ns"]
