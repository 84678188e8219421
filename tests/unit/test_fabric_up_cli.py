"""`linkpass fabric up` on a fabric that is already up says so, and what it is (no namespaces
are made here: the state functions are replaced by an in-memory fabric.json)."""

from __future__ import annotations

import contextlib
import copy

import pytest

from linkpass.cli import app as cli
from linkpass.lab.fabric import fabric as F


@pytest.fixture
def existing(monkeypatch):
    """A ready 2 x 1 fabric ``zz`` recorded in a fake fabric.json; returns the stored dict."""
    desc = F._plan("zz", 2, 1, "host-ip", 2000)
    desc["status"] = "ready"
    store = {"zz": desc}
    written = []
    monkeypatch.setattr(F, "_check_root", lambda: None)
    monkeypatch.setattr(F, "_lock", contextlib.nullcontext)
    monkeypatch.setattr(F, "_read_state", lambda name: copy.deepcopy(store.get(name)))
    monkeypatch.setattr(F, "_write_state", lambda d: written.append(copy.deepcopy(d)))
    monkeypatch.setattr(F, "netns_exists", lambda ns: True)
    monkeypatch.setattr(F, "_prune_faults", lambda d: None)
    return store, written


def test_up_on_an_existing_fabric_says_it_exists_and_what_it_is(existing, capsys):
    store, written = existing
    assert cli.main(["fabric", "up", "--hosts", "2", "--rails", "1", "--name", "zz"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("fabric zz exists already, nothing built (`linkpass fabric down --name zz` removes it): "
                          "2 host(s) x 1 rail(s), mode host-ip; namespaces zz-fab, zz-h0..zz-h1; ")
    assert all("existed" not in d for d in written)  # fabric.json keeps its fields
    assert F.up(2, 1, "zz") == store["zz"]  # and up() returns the description as before


def test_up_json_on_an_existing_fabric_has_existed_true(existing, capsys):
    import json

    assert cli.main(["fabric", "up", "--hosts", "2", "--rails", "1", "--name", "zz", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["existed"] is True and doc["name"] == "zz" and doc["hosts_count"] == 2


def test_up_line_of_a_new_fabric_and_of_one_with_cuts_left():
    desc = F._plan("zz", 3, 2, "per-rail-ip", 2000)
    new = cli_line(desc, False)
    assert new.startswith("fabric zz: 3 host(s) x 2 rail(s), mode per-rail-ip; namespaces zz-fab, zz-h0..zz-h2; ")
    cut = cli_line({**desc, "faults": [{"host": 1, "rail": 0, "mode": "admin-down"}]}, True)
    assert "exists already" in cut and cut.endswith("; 1 cut link(s) still in place (`linkpass fabric show --name zz`)")


def cli_line(desc: dict, existed: bool) -> str:
    from linkpass.lab.fabric.cli import up_line

    return up_line(desc, existed)
