"""A failure of the classifier itself is reported with its input line, never read as a clean log."""

from __future__ import annotations

import pytest

from linkpass.cli import main
from linkpass.core import classify as C
from linkpass.core.evidence import gpu

XID = "[ 100.000000] NVRM: Xid (PCI:0000:91:00): 79, pid=1, GPU has fallen off the bus.\n"
NOISE = "[ 99.000000] usb 1-1: new high-speed USB device number 2 using xhci_hcd\n"


@pytest.fixture
def broken_xid_rule(monkeypatch):
    def boom(self, ev):
        raise KeyError("a bug")
    monkeypatch.setattr(gpu.Rules, "ev_xid", boom)


def test_a_rule_that_fails_is_reported_with_the_line(broken_xid_rule):
    r = C.classify_report([NOISE, XID])
    assert r.incidents == [] and r.lines == 2
    assert r.error is not None and r.error.startswith("line 2: internal error: KeyError") and "\n" not in r.error
    with pytest.raises(C.ClassifierError, match="line 2"):
        C.classify([NOISE, XID])


def test_a_failing_field_reader_names_its_family_and_line(monkeypatch):
    def boom(kind, m, msg):
        raise ValueError("bad field")
    monkeypatch.setattr(gpu, "fields", boom)
    r = C.classify_report([NOISE, NOISE, XID])
    assert r.error == "line 3: gpu rule 'xid' failed: ValueError: bad field"


def test_the_cli_exits_1_with_one_line_instead_of_no_incidents(broken_xid_rule, tmp_path, capsys):
    f = tmp_path / "k.log"
    f.write_text(NOISE + XID)
    for argv in (["classify", str(f)], ["classify", "--json", str(f)]):
        assert main(argv) == 1
        out, err = capsys.readouterr()
        assert out == "" and "no incidents" not in out
        assert err.count("\n") == 1 and "classifier failed" in err and "line 2" in err


def test_the_kmsg_follower_counts_the_failure_and_goes_on(broken_xid_rule, tmp_path):
    from linkpass.adapters.kmsg import KmsgFollower

    (tmp_path / "boot_id").write_text("b\n")
    log = tmp_path / "kmsg"
    log.write_text("")
    posted = []
    f = KmsgFollower(str(log), posted.append, str(tmp_path / "state"), "h0", boot_id_path=str(tmp_path / "boot_id"))
    assert f.open()
    from linkpass.adapters.kmsg import _Line

    assert f.classify([_Line(0, XID.strip(), 1, False)], 0) == []
    assert f.counters["classify_errors"] == 1 and posted == []


def test_a_healthy_classifier_reports_no_error():
    r = C.classify_report([NOISE, XID])
    assert r.error is None and [i.code for i in r.incidents] == ["xid:79"]
