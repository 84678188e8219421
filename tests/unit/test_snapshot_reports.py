"""Snapshot reports of the torch hooks in the daemon (linkpass/core/snapshots.py): each field
checked, bad reports dropped whole and counted, per job the newest report and counts (bounded),
and what status, the MQTT ``snapshot`` event and the Prometheus series show of them."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from linkpass.adapters.metrics import METRIC_NAMES, snapshot_families
from linkpass.adapters.mqtt_payloads import dumps, event_doc
from linkpass.core.alerts import EVENT_TYPES, AlertMapper
from linkpass.core.engine import Engine
from linkpass.core.model import HookReport, PublishHookReport
from linkpass.core.snapshots import (
    MAX_REASON_CHARS,
    ReportError,
    SnapshotBook,
    parse_report,
    snapshots_json,
)

S = 1_000_000_000


def rep(**kw) -> dict:
    """A report as the hook server keeps it (server fields filled in) for a complete snapshot."""
    r = {"event": "snapshot", "t_ns": 5 * S, "client_id": 3, "job": "llm7", "rank": 0, "pid": 4242, "id": "g1", "step": 12,
         "ok": True, "bytes": 457678, "stall_ms": 12.5, "write_ms": 180.25, "path": "/snaps/step-000000012", "reason": None,
         "scope": "snapshot"}
    r.update(kw)
    return r


def test_a_good_report_is_taken_with_every_field():
    r = parse_report(rep())
    assert (r.job, r.rank, r.pid, r.scope, r.id, r.step, r.ok) == ("llm7", 0, 4242, "snapshot", "g1", 12, True)
    assert (r.path, r.bytes, r.stall_ms, r.write_ms, r.reason, r.t_ns) == ("/snaps/step-000000012", 457678, 12.5, 180.25, None, 5 * S)
    assert r.fields()["snapshot_id"] == "g1" and parse_report(r.to_report()) == r  # round trip through PublishHookReport


@pytest.mark.parametrize("field,value,match", [
    ("step", "12", "'step' must be an integer"),
    ("step", True, "'step' must be an integer"),
    ("step", -1, "'step' must be an integer >= 0"),
    ("step", None, "'step'"),
    ("ok", "yes", "'ok' must be true or false"),
    ("ok", 1, "'ok' must be true or false"),
    ("bytes", -5, "'bytes'"),
    ("bytes", 1.5, "'bytes'"),
    ("bytes", "big", "'bytes'"),
    ("stall_ms", math.nan, "'stall_ms' must be a finite number"),
    ("stall_ms", math.inf, "'stall_ms'"),
    ("stall_ms", -0.5, "'stall_ms'"),
    ("write_ms", "fast", "'write_ms'"),
    ("write_ms", [1], "'write_ms'"),
    ("path", 7, "'path' must be a string"),
    ("path", "/x" * 3000, "'path' is 6000 characters long"),
    ("id", {"a": 1}, "'id' must be a string"),
    ("scope", "everything", "'scope' must be one of snapshot, part"),
    ("reason", 42, "'reason' must be a string"),
    ("job", "", "'job'"),
    ("rank", "0", "'rank'"),
    ("t_ns", None, "'t_ns'"),
], ids=lambda v: str(v)[:20])
def test_a_field_of_the_wrong_type_or_range_refuses_the_report_in_one_line_naming_it(field, value, match):
    with pytest.raises(ReportError, match=match) as ei:
        parse_report(rep(**{field: value}))
    assert "\n" not in str(ei.value)


def test_not_a_mapping_or_not_a_snapshot_report_is_refused():
    for bad in ([1, 2], "snapshot", None):
        with pytest.raises(ReportError, match="must be an object"):
            parse_report(bad)
    with pytest.raises(ReportError, match="not a snapshot report"):
        parse_report(rep(event="rebuilt"))


def test_scope_defaults_by_rank_a_long_reason_is_cut_and_an_ok_one_has_none():
    assert parse_report(rep(scope=None)).scope == "snapshot"
    assert parse_report(rep(scope=None, rank=3)).scope == "part"
    r = parse_report(rep(ok=False, reason="x" * 5000, path=None))
    assert len(r.reason) == MAX_REASON_CHARS and r.reason.endswith("...")
    assert parse_report(rep(ok=True, reason="stale text")).reason is None
    r = parse_report(rep(bytes=None, stall_ms=None, write_ms=None, id=None, stall=1))  # unknowns stay unknown
    assert (r.bytes, r.stall_ms, r.write_ms, r.id) == (None, None, None, None)


def test_the_book_counts_snapshots_and_parts_per_job_and_keeps_the_newest():
    b = SnapshotBook()
    b.record(rep(rank=1, scope="part", path=None, bytes=200, t_ns=1 * S))
    b.record(rep(t_ns=2 * S))
    b.record(rep(step=24, id="p24", ok=False, reason="rank 1: No space left on device: /snaps", path=None, t_ns=3 * S))
    b.record(rep(rank=1, scope="part", ok=False, reason="No space left on device", step=24, path=None, t_ns=4 * S))
    b.record(rep(job="other", t_ns=5 * S))
    with pytest.raises(ReportError):
        b.record(rep(step="x"))
    v = b.view()
    assert [j.job for j in v.jobs] == ["llm7", "other"] and v.rejected == 1 and v.jobs_forgotten == 0
    j = v.jobs[0]
    assert (j.ok, j.failed, j.parts_ok, j.parts_failed) == (1, 1, 1, 1)
    assert j.last.rank == 1 and j.last.scope == "part" and j.last.step == 24 and not j.last.ok
    doc = snapshots_json(v, 6 * S)
    assert doc["reports_rejected"] == 1 and doc["jobs_forgotten"] == 0
    last = doc["jobs"]["llm7"]["last"]
    assert last == {"rank": 1, "scope": "part", "snapshot_id": "g1", "step": 24, "ok": False, "path": None, "bytes": 457678,
                    "stall_ms": 12.5, "write_ms": 180.25, "reason": "No space left on device", "t_ns": 4 * S, "age_s": 2.0}
    assert doc["jobs"]["llm7"]["ok"] == 1 and doc["jobs"]["llm7"]["parts_failed"] == 1


def test_the_book_keeps_a_bounded_number_of_jobs_forgetting_the_least_recently_reported():
    b = SnapshotBook(jobs_kept=3)
    for i in range(5):
        b.record(rep(job=f"j{i}", t_ns=i))
    b.record(rep(job="j2", t_ns=9))  # j2 reported again: now the newest
    b.record(rep(job="j5", t_ns=10))
    v = b.view()
    assert [j.job for j in v.jobs] == ["j2", "j4", "j5"] and v.jobs_forgotten == 3


def test_the_engine_keeps_checked_reports_passes_them_on_and_drops_bad_ones_with_a_counted_warning(caplog):
    from unit_helpers import make_toml
    from linkpass.config import parse_config, policy_from_config

    eng = Engine(policy_from_config(parse_config(make_toml(), "t.toml")))
    acts = eng.handle(HookReport(rep(extra_field="kept out"), 1), 1)
    assert acts == [PublishHookReport(parse_report(rep()).to_report())]
    assert "extra_field" not in acts[0].report
    caplog.set_level(logging.WARNING, "linkpass.engine")
    for i in range(8):
        assert eng.handle(HookReport(rep(step=f"bad{i}"), 2), 2) == []
    assert eng.snapshots.rejected == 8
    said = [r.getMessage() for r in caplog.records if "snapshot report" in r.getMessage()]
    assert len(said) == 5 and "'llm7'" in said[0] and "'step' must be an integer" in said[0] and "(1 dropped so far)" in said[0]
    # other hook reports go on as before
    assert eng.handle(HookReport({"event": "rebuilt", "job": "j"}, 3), 3) == [PublishHookReport({"event": "rebuilt", "job": "j"})]
    assert [j.job for j in eng.snapshots.view().jobs] == ["llm7"]


_junk = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
                     lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c, max_size=3), max_leaves=6)


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from(["id", "step", "ok", "bytes", "stall_ms", "write_ms", "path", "reason", "scope",
                                        "job", "rank", "pid", "t_ns"]), _junk, max_size=8))
def test_whatever_a_client_sends_the_engine_status_metrics_and_mqtt_never_break(over):
    from unit_helpers import make_toml
    from linkpass.config import parse_config, policy_from_config

    eng = Engine(policy_from_config(parse_config(make_toml(), "t.toml")))
    acts = eng.handle(HookReport(rep(**over), 1), 1)
    v = eng.snapshots.view()
    assert len(acts) + v.rejected == 1
    dumps(snapshots_json(v, 2))  # JSON-ready: no NaN, nothing unserialisable
    for fam in snapshot_families(v):
        for s in fam.samples:
            assert isinstance(s.value, (int, float)) and math.isfinite(s.value)
    for a in acts:
        alert = AlertMapper({0: "rail0"}).from_report(a.report, 3)
        dumps(event_doc(alert, host="h0", seq=1, ts="2026-12-02T00:00:00.000000Z", generation=1, event_id="x"))


def test_the_mqtt_snapshot_event_has_the_fields_and_is_critical_only_when_not_ok():
    m = AlertMapper({0: "rail0"})
    a = m.from_report(parse_report(rep()).to_report(), 99)
    assert a.event == "snapshot" and "snapshot" in EVENT_TYPES and not a.critical and a.t_mono_ns == 5 * S
    doc = event_doc(a, host="h0", seq=7, ts="2026-12-02T10:00:00.000000Z", generation=3, event_id="u-1")
    assert doc == {"schema": "linkpass.event/v1", "id": "u-1", "host": "h0", "seq": 7, "ts": "2026-12-02T10:00:00.000000Z",
                   "event": "snapshot", "severity": "info", "generation": 3, "t_mono_ns": 5 * S, "job": "llm7", "rank": 0,
                   "pid": 4242, "scope": "snapshot", "snapshot_id": "g1", "step": 12, "ok": True,
                   "path": "/snaps/step-000000012", "bytes": 457678, "stall_ms": 12.5, "write_ms": 180.25, "reason": None}
    bad = m.from_report(parse_report(rep(ok=False, path=None, reason="rank 1: No space left on device")).to_report(), 99)
    assert bad.critical and bad.fields["reason"] == "rank 1: No space left on device"
    assert m.from_report(rep(step="x"), 99) is None  # an unchecked bad one never becomes an event


def test_the_mqtt_snapshot_event_matches_the_asyncapi_schema():
    yaml = pytest.importorskip("yaml")
    jsonschema = pytest.importorskip("jsonschema")
    doc = yaml.safe_load((Path(__file__).resolve().parents[2] / "deploy" / "asyncapi.yaml").read_text())
    schema = {"$ref": "#/components/schemas/Event", "components": doc["components"]}
    v = jsonschema.Draft7Validator(schema)
    m = AlertMapper({0: "rail0"})
    for r in (rep(), rep(ok=False, path=None, reason="rank 1: not enough space"), rep(rank=2, scope="part", path=None,
                                                                                       bytes=None, stall_ms=None)):
        a = m.from_report(parse_report(r).to_report(), 1)
        ev = event_doc(a, host="h0", seq=1, ts="2026-12-02T10:00:00.000000Z", generation=0,
                       event_id="123e4567-e89b-42d3-a456-426614174000")
        errs = list(v.iter_errors(ev))
        assert not errs, errs[0].message
    # a rail event keeps a string reason
    rail = event_doc(m.from_entry("rail", 1, {"rail": 0, "old": "UP", "new": "DOWN", "reason": None}), host="h0", seq=2,
                     ts="2026-12-02T10:00:00.000000Z", generation=0, event_id="123e4567-e89b-42d3-a456-426614174000")
    assert list(v.iter_errors(rail))


def test_metrics_of_the_jobs_snapshots_in_seconds_and_named_in_the_contract():
    b = SnapshotBook()
    b.record(rep())
    b.record(rep(job="j2", rank=1, scope="part", bytes=None, ok=False, reason="boom", path=None))
    fams = snapshot_families(b.view())
    got = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in fams for s in f.samples}
    assert got[("linkpass_snapshots_total", (("job", "llm7"), ("result", "ok")))] == 1
    assert got[("linkpass_snapshots_total", (("job", "llm7"), ("result", "failed")))] == 0
    assert got[("linkpass_snapshot_parts_total", (("job", "j2"), ("result", "failed")))] == 1
    assert got[("linkpass_snapshot_last_step", (("job", "llm7"),))] == 12
    assert got[("linkpass_snapshot_last_bytes", (("job", "llm7"),))] == 457678
    assert ("linkpass_snapshot_last_bytes", (("job", "j2"),)) not in got  # unknown: no series, not 0
    assert got[("linkpass_snapshot_last_stall_seconds", (("job", "llm7"),))] == pytest.approx(0.0125)
    assert got[("linkpass_snapshot_last_write_seconds", (("job", "llm7"),))] == pytest.approx(0.18025)
    assert got[("linkpass_snapshot_last_ok", (("job", "j2"),))] == 0
    assert got[("linkpass_snapshot_reports_rejected_total", ())] == 0
    names = {f.name + ("_total" if f.type == "counter" else "") for f in fams}
    assert names <= set(METRIC_NAMES)


def test_plain_status_prints_one_line_per_job():
    from linkpass.cli.app import _status_lines

    b = SnapshotBook()
    b.record(rep())
    b.record(rep(job="j2", rank=3, scope="part", ok=False, reason="no space left in /s: 10 bytes free", path=None))
    lines = _status_lines({"hooks": {}, "snapshots": snapshots_json(b.view(), 8 * S)})
    assert "snapshots of job j2: 0 ok, 0 failed; last rank 3's part at step 12 (FAILED: no space left in /s: 10 bytes free), 3.0 s ago" in lines
    assert ("snapshots of job llm7: 1 ok, 0 failed; last snapshot at step 12 (ok, 457678 bytes, stall 12.5 ms, write 180.25 ms), "
            "3.0 s ago") in lines
