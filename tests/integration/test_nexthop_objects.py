"""Route actuator in nexthop-object mode against a real kernel: two namespaces joined by two
veth rails (198.18.0.0/15), the actuator driven step by step from a child in namespace A."""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from linkpass.adapters.routes import DEFAULT_NEXTHOP_ID_BASE as BASE

from .daemons import Cluster, sh, veth_pair, wait_for

ROOT = Path(__file__).resolve().parents[2]
DST = "198.19.242.2/32"

CHILD = textwrap.dedent("""
    import asyncio, json, sys
    from linkpass.adapters.routes import RouteActuator, RouteSettings
    from linkpass.core.model import ApplyRoutes, Nexthop, RouteSpec
    NH = {0: Nexthop("198.18.242.2", "r0", 0), 1: Nexthop("198.18.243.2", "r1", 1)}
    async def main():
        a = None
        for line in sys.stdin:
            c = json.loads(line)
            if a is None or c.get("new"):
                a = RouteActuator(lambda e: None, RouteSettings(201, 254, c.get("objects", True)))
            a.reconfigure(RouteSettings(201, 254, c.get("objects", True)))
            routes = tuple(RouteSpec(d, tuple(sorted(NH[k] for k in rails)), "198.19.242.1", 254, 0, 201) for d, rails in c["routes"])
            if c.get("close"):
                await a.close()
                print(json.dumps({}), flush=True)
                continue
            r = await a.reconcile(ApplyRoutes(c["gen"], routes), full=c.get("full", False))
            print(json.dumps({"replaced": r.replaced, "deleted": r.deleted, "errors": list(r.errors), "conflicts": list(r.conflicts)}), flush=True)
    asyncio.run(main())
""")


class Pair:
    def __init__(self):
        tag = secrets.token_hex(3)
        self.a, self.b = f"lpnh{tag}a", f"lpnh{tag}b"
        veth_pair(self.a, self.b, 242)
        self.gen = 0
        self.child = subprocess.Popen(["ip", "netns", "exec", self.a, sys.executable, "-c", CHILD], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True, cwd=ROOT)

    def apply(self, rails=(0, 1), dsts=(DST,), **kw) -> dict:
        self.gen += 1
        self.child.stdin.write(json.dumps({"gen": self.gen, "routes": [[d, list(rails)] for d in dsts], **kw}) + "\n")
        self.child.stdin.flush()
        return json.loads(self.child.stdout.readline())

    def nexthops(self) -> dict[int, dict]:
        return {o["id"]: o for o in json.loads(sh("ip", "-j", "-n", self.a, "nexthop", "show").stdout or "[]")}

    def routes(self) -> list[dict]:
        return [r for r in json.loads(sh("ip", "-j", "-n", self.a, "route", "show", "table", "254").stdout) if r.get("protocol") in (201, "201")]

    def ours(self) -> dict[int, dict]:
        return {i: o for i, o in self.nexthops().items() if i >= BASE}

    def members(self, nhid: int) -> set[str]:
        """The netdevs of group ``nhid``'s members."""
        nhs = self.nexthops()
        return {nhs[m["id"]]["dev"] for m in nhs[nhid]["group"]}

    def close(self):
        self.child.stdin.close()
        self.child.wait(10)
        for ns in (self.a, self.b):
            sh("ip", "netns", "del", ns, check=False)


@pytest.fixture
def pair():
    p = Pair()
    try:
        yield p
    finally:
        p.close()


def test_plan_change_is_one_group_replace_and_kernel_matches(pair):
    r = pair.apply((0, 1))
    assert r["errors"] == [] and r["replaced"] == 4  # two leaves, a group, the route
    (route,) = pair.routes()
    gid = route["nhid"]
    assert gid >= BASE and pair.members(gid) == {"r0", "r1"} and route["prefsrc"] == "198.19.242.1"
    r = pair.apply((1,))
    assert (r["replaced"], r["deleted"], r["errors"]) == (1, 0, [])  # one atomic group replace
    (route,) = pair.routes()
    assert route["nhid"] == gid and pair.members(gid) == {"r1"}
    r = pair.apply((0, 1))
    assert (r["replaced"], r["deleted"]) == (1, 0) and pair.members(gid) == {"r0", "r1"}
    assert pair.apply((0, 1)) == {"replaced": 0, "deleted": 0, "errors": [], "conflicts": []}


def test_carrier_loss_drops_the_leaf_in_the_kernel_and_failback_restores_it(pair):
    pair.apply((0, 1))
    gid = pair.routes()[0]["nhid"]
    sh("ip", "-n", pair.b, "link", "set", "r0", "down")  # carrier loss on A's r0, no actuator involved
    wait_for(lambda: pair.members(gid) == {"r1"}, what="kernel removing the dead rail's nexthop from the group")
    r = pair.apply((1,))  # the plan without rail 0, from a picture that still has the leaf
    assert r["errors"] == [] and pair.members(gid) == {"r1"}
    sh("ip", "-n", pair.b, "link", "set", "r0", "up")
    wait_for(lambda: "NO-CARRIER" not in sh("ip", "-n", pair.a, "link", "show", "r0").stdout, what="carrier back")
    r = pair.apply((0, 1), full=True)  # failback (the engine asks for a resync after hold-down)
    assert r["errors"] == [] and pair.members(gid) == {"r0", "r1"}


def test_failback_from_a_stale_picture_recovers_in_the_same_pass(pair):
    pair.apply((0, 1))
    gid = pair.routes()[0]["nhid"]
    pair.apply((0,))
    sh("ip", "-n", pair.b, "link", "set", "r1", "down")
    sh("ip", "-n", pair.b, "link", "set", "r0", "down")
    wait_for(lambda: not pair.routes(), what="the kernel deleting the emptied group and its route")
    for k in (0, 1):
        sh("ip", "-n", pair.b, "link", "set", f"r{k}", "up")
    r = pair.apply((0, 1))  # no resync asked: the failed group replace makes the pass re-read the kernel
    assert r["errors"] == []
    (route,) = pair.routes()
    assert pair.members(route["nhid"]) == {"r0", "r1"}
    assert route["nhid"] == gid or gid not in pair.nexthops()


def test_restart_adopts_existing_objects_without_any_kernel_change(pair):
    pair.apply((0, 1))
    before = (pair.nexthops(), pair.routes())
    r = pair.apply((0, 1), new=True)  # a new actuator (a restarted daemon) reads the kernel
    assert (r["replaced"], r["deleted"], r["errors"]) == (0, 0, [])
    assert (pair.nexthops(), pair.routes()) == before


def test_stop_keeps_routes_and_their_groups_and_deletes_unused_objects(pair):
    pair.apply((0, 1))
    gid = pair.routes()[0]["nhid"]
    pair.apply((1,))  # rail 0's leaf stays for the failback while the daemon runs
    assert {o.get("dev") for o in pair.ours().values()} == {"r0", "r1", None}
    sh("ip", "-n", pair.a, "nexthop", "add", "id", "7", "via", "198.18.242.2", "dev", "r0")  # not ours
    pair.apply(close=True)
    (route,) = pair.routes()
    assert route["nhid"] == gid and pair.members(gid) == {"r1"}
    assert {o.get("dev") for o in pair.ours().values()} == {"r1", None} and 7 in pair.nexthops()


def test_foreign_objects_and_ids_are_left_alone(pair):
    sh("ip", "-n", pair.a, "nexthop", "add", "id", str(BASE), "via", "198.18.242.2", "dev", "r0", "proto", "3")
    sh("ip", "-n", pair.a, "nexthop", "add", "id", str(BASE + 1), "blackhole", "proto", "3")
    sh("ip", "-n", pair.a, "nexthop", "add", "id", "7", "via", "198.18.243.2", "dev", "r1")
    sh("ip", "-n", pair.a, "nexthop", "add", "id", "8", "group", f"7/{BASE}")
    r = pair.apply((0, 1))
    assert r["errors"] == []
    nhs = pair.nexthops()
    assert nhs[BASE]["protocol"] in (3, "boot") and "blackhole" in nhs[BASE + 1]
    assert {m["id"] for m in nhs[8]["group"]} == {7, BASE}
    gid = pair.routes()[0]["nhid"]
    assert gid not in (7, 8, BASE, BASE + 1) and pair.members(gid) == {"r0", "r1"}
    assert pair.apply(dsts=(), full=True)["errors"] == []  # nothing planned (a pass that reads the kernel): our objects go, the foreign ones stay
    assert set(pair.nexthops()) == {7, 8, BASE, BASE + 1} and pair.routes() == []


def test_changes_by_another_process_are_repaired_on_resync(pair):
    pair.apply((0, 1))
    gid = pair.routes()[0]["nhid"]
    leaf = next(i for i, o in pair.ours().items() if o.get("dev") == "r0")
    sh("ip", "-n", pair.a, "nexthop", "replace", "id", str(gid), "group", str(leaf), "proto", "201")
    r = pair.apply((0, 1), full=True)
    assert r["errors"] == [] and pair.members(gid) == {"r0", "r1"}
    sh("ip", "-n", pair.a, "nexthop", "del", "id", str(gid))  # takes our route with it
    assert pair.routes() == []
    r = pair.apply((0, 1), full=True)
    assert r["errors"] == []
    (route,) = pair.routes()
    assert pair.members(route["nhid"]) == {"r0", "r1"}


def test_foreign_route_on_our_destination_is_a_conflict(pair):
    sh("ip", "-n", pair.a, "route", "add", DST, "via", "198.18.243.2", "dev", "r1", "proto", "static")
    r = pair.apply((0, 1))
    assert r["errors"] == [] and "held by a route of proto 4" in r["conflicts"][0]
    assert pair.ours() == {}


def test_switching_back_to_inline_routes_removes_our_objects(pair):
    pair.apply((0, 1), dsts=(DST, "198.19.242.3/32"))
    assert len(pair.ours()) == 4
    r = pair.apply((0, 1), dsts=(DST, "198.19.242.3/32"), objects=False)
    assert r["errors"] == [] and pair.ours() == {}
    assert all("nhid" not in x and len(x["nexthops"]) == 2 for x in pair.routes())


def test_daemon_with_nexthop_objects_reroutes_and_fails_back(tmp_path):
    """The default demo fabric with ``nexthop_objects = true``: a carrier loss takes the rail out
    of the group, the hold-down brings it back."""
    c = Cluster(tmp=tmp_path)
    try:
        c.up()
        for i in range(2):
            path = c.host(i)["config"]
            text = Path(path).read_text()
            Path(path).write_text(text.replace("[daemon]\n", "[daemon]\nnexthop_objects = true\n", 1))
        c.start_all()
        ns = c.ns(0)
        dst = c.host(1)["host_ip"]

        def group_devs():
            out = json.loads(sh("ip", "-j", "-n", ns, "route", "show", f"{dst}/32").stdout)
            if not out or "nhid" not in out[0]:
                return None
            nhs = {o["id"]: o for o in json.loads(sh("ip", "-j", "-n", ns, "nexthop", "show").stdout)}
            return sorted(nhs[m["id"]]["dev"] for m in nhs[out[0]["nhid"]]["group"])

        wait_for(lambda: group_devs() == ["rail0", "rail1"], timeout=10, what="route via a group over both rails")
        from linkpass.lab import fabric as fab
        fab.cut(c.name, 0, 0, "carrier-loss")
        wait_for(lambda: group_devs() == ["rail1"], what="rail 0 out of the group")
        fab.heal(c.name)
        wait_for(lambda: group_devs() == ["rail0", "rail1"], timeout=10, what="failback after hold-down")
    finally:
        c.close()
