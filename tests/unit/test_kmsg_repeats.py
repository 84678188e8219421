"""Repeats of a kernel-log incident, follower and engine together: the follower posts every
sighting, the engine's one dedup window (INCIDENT_DEDUP_NS of the previous sighting) makes the
repeats one incident; the same Xid on the same GPU after a quiet window is a new incident and is
acted on again; the same fault from kmsg and NVML close together still counts once."""

from __future__ import annotations

from linkpass.adapters.kmsg import KmsgFollower
from linkpass.config import policy_from_config
from linkpass.core.engine import INCIDENT_DEDUP_NS, Engine
from linkpass.core.model import NotifyDeviceFault
from linkpass.lab.inject import xid_line

from unit_helpers import S, decided, make_cfg, snapshot

XID119 = xid_line(6, 119)


def rec(seq: int, msg: str, prio: int = 3) -> str:
    return f"{prio},{seq},{seq * 1000},-;{msg}\n"


def follower(tmp_path, post) -> tuple[KmsgFollower, object]:
    (tmp_path / "boot_id").write_text("boot-a\n")
    log = tmp_path / "kmsg"
    log.write_text(rec(1, "Linux version 6.8.0", prio=6))
    f = KmsgFollower(str(log), post, str(tmp_path / "state"), "h0", boot_id_path=str(tmp_path / "boot_id"))
    assert f.open()
    f.classify(f.start_batch(f.read_available()), 0)
    return f, log


def feed(f: KmsgFollower, log, text: str, now_ns: int):
    with log.open("a") as fh:
        fh.write(text)
    return f.classify(f.accept(f.read_available()), now_ns)


def engine() -> Engine:
    cfg = make_cfg()
    e = Engine(policy_from_config(cfg))
    e.handle(snapshot(cfg), 0)
    return e


def acted(e: Engine, incidents, now_ns: int) -> list:
    """The NotifyDeviceFault actions the engine returns for what the follower posted."""
    return [a for i in incidents for a in e.handle(i, now_ns) if isinstance(a, NotifyDeviceFault)]


def test_same_xid_again_after_the_window_is_acted_on_again(tmp_path):
    got = []
    f, log = follower(tmp_path, got.append)
    e = engine()
    t0 = 100 * S
    (a,) = feed(f, log, rec(2, XID119), t0)
    assert (a.code, a.device, a.action, a.seq) == ("xid:119", "0000:1e:00.0", "migrate-rank", 2)
    assert acted(e, [a], t0) == [NotifyDeviceFault(a)]
    # the same Xid 1.5 s later: the follower posts the sighting, the engine takes it for a repeat
    # of the same incident (the driver repeats its lines)
    (r,) = feed(f, log, rec(3, XID119), t0 + 3 * S // 2)
    assert r.seq == 3 and acted(e, [r], r.t_ns) == []
    assert e.status(r.t_ns)["totals"]["incident_duplicates"] == 1
    # each sighting restarts the window: 9 s after the repeat is still the same incident
    (r2,) = feed(f, log, rec(4, XID119), t0 + 21 * S // 2)
    assert acted(e, [r2], r2.t_ns) == []
    # quiet for longer than the window: a new incident (a second fault, a new job on the GPU)
    (b,) = feed(f, log, rec(5, XID119), t0 + 21 * S // 2 + INCIDENT_DEDUP_NS)
    assert (b.code, b.device, b.seq, b.follows, b.backlog) == ("xid:119", "0000:1e:00.0", 5, None, False)
    assert acted(e, [b], b.t_ns) == [NotifyDeviceFault(b)]
    assert got == [a, r, r2, b]
    st = e.status(b.t_ns)
    assert st["incident_counts"] == {"gpu": 2} and st["totals"]["incident_duplicates"] == 2
    assert [d["count"] for d in st["incidents"]] == [3, 1]
    f.close()


def test_xid79_for_a_new_job_after_an_earlier_one_is_posted(tmp_path):
    got = []
    f, log = follower(tmp_path, got.append)
    e = engine()
    x79 = xid_line(4, 79)
    (a,) = feed(f, log, rec(2, x79), 10 * S)
    assert a.seq == 2 and acted(e, [a], a.t_ns) == [NotifyDeviceFault(a)]
    for seq in range(3, 40):  # the rest of the old job's log, then a new job on the spare GPU 4
        assert acted(e, feed(f, log, rec(seq, f"random: entropy {seq}", prio=6), (10 + seq) * S), (10 + seq) * S) == []
    (b,) = feed(f, log, rec(40, x79), 300 * S)
    assert b.seq == 40 and acted(e, [b], b.t_ns) == [NotifyDeviceFault(b)]


def test_a_link_coming_back_is_not_a_new_link_down(tmp_path):
    got = []
    f, log = follower(tmp_path, got.append)
    down = "mlx5_core 0000:53:00.0 mlx5_3: Port: 1 Link DOWN"
    up = "mlx5_core 0000:53:00.0 mlx5_3: Port: 1 Link ACTIVE"
    feed(f, log, rec(2, up, prio=6), 1 * S)
    assert [i.code for i in feed(f, log, rec(3, down), 2 * S)] == ["mlx5:link_down"]
    assert feed(f, log, rec(4, up, prio=6), 60 * S) == []   # back up: not a new incident
    assert [i.code for i in feed(f, log, rec(5, down), 120 * S)] == ["mlx5:link_down"]  # down again later: new


def test_engine_keeps_the_recurrence_and_still_merges_two_sources(tmp_path):
    e = engine()
    f, log = follower(tmp_path, lambda ev: None)
    t0 = 100 * S
    (a,) = feed(f, log, rec(2, XID119), t0)
    assert decided(e.handle(a, t0 + 1000)) == [NotifyDeviceFault(a)]
    # the same Xid through NVML 50 ms later (its event handled late, the loop was busy): one
    # incident, two sources
    nv = type(a)("nvml", a.domain, a.device, a.code, a.action, a.remedy, t0 + 50_000_000, gpu=6)
    assert decided(e.handle(nv, t0 + 2 * S)) == []
    st = e.status(t0 + S)
    assert st["totals"]["incident_duplicates"] == 1 and st["incidents"][-1]["sources"] == ["kmsg", "nvml"]
    # a recurrence one window after the last sighting (by the sources' clocks): less than a window
    # after the engine handled the late NVML event, and still a new incident
    (b,) = feed(f, log, rec(3, XID119), t0 + 50_000_000 + INCIDENT_DEDUP_NS)
    assert decided(e.handle(b, b.t_ns + 1000)) == [NotifyDeviceFault(b)]
    assert e.status(b.t_ns + S)["incident_counts"] == {"gpu": 2}


def test_backlog_sighting_does_not_swallow_a_live_fault(tmp_path):
    """A first start reads an old Xid 79 from the log (backlog: recorded, never acted on); the
    same Xid live a few seconds later is acted on, by the follower and by the engine."""
    (tmp_path / "boot_id").write_text("boot-a\n")
    log = tmp_path / "kmsg"
    x79 = xid_line(4, 79)
    log.write_text(rec(1, "Linux version 6.8.0", prio=6) + rec(2, x79))
    cfg = make_cfg()
    e = Engine(policy_from_config(cfg))
    e.handle(snapshot(cfg), 0)
    f = KmsgFollower(str(log), lambda ev: None, str(tmp_path / "state"), "h0", boot_id_path=str(tmp_path / "boot_id"))
    assert f.open()
    (old,) = f.classify(f.start_batch(f.read_available()), 100 * S)
    assert old.backlog and decided(e.handle(old, 100 * S)) == []
    (live,) = feed(f, log, rec(3, x79), 102 * S)
    assert not live.backlog and live.seq == 3
    assert decided(e.handle(live, 102 * S)) == [NotifyDeviceFault(live)]
