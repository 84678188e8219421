"""linkpass/adapters/kmsg.py: record parsing, overrun (EPIPE), resume from the saved seq, the
reboot case, and following a FIFO with the asyncio loop."""

from __future__ import annotations

import asyncio
import json
import os

import pytest

from linkpass.adapters.kmsg import KmsgFollower, parse_record
from tests.wait import async_wait_until

XID79 = "NVRM: Xid (PCI:0000:91:00): 79, pid=1234, GPU has fallen off the bus."


def rec(seq: int, msg: str, prio: int = 3, usec: int | None = None) -> str:
    return f"{prio},{seq},{usec if usec is not None else seq * 1000},-;{msg}\n"


def filler(seq: int) -> str:
    return rec(seq, f"random: crng init step {seq}", prio=6)


def follower(tmp_path, path, post=None, boot="boot-a", **kw) -> KmsgFollower:
    (tmp_path / "boot_id").write_text(boot + "\n")
    f = KmsgFollower(str(path), post if post is not None else (lambda ev: None), str(tmp_path / "state"), "h0",
                     boot_id_path=str(tmp_path / "boot_id"), **kw)
    assert f.open()
    return f


def test_parse_record_fields_dictionary_and_bad_input():
    r = parse_record(b"6,1234,5678901,-;mlx5_core 0000:08:00.0: Port module event\n SUBSYSTEM=pci\n DEVICE=+pci:0000:08:00.0\n")
    assert (r.prio, r.seq, r.usec, r.flags, r.level, r.facility) == (6, 1234, 5678901, "-", 6, 0)
    assert r.message == "mlx5_core 0000:08:00.0: Port module event"
    assert r.dictionary == ("SUBSYSTEM=pci", "DEVICE=+pci:0000:08:00.0")
    assert r.line() == "6,1234,5678901,-;mlx5_core 0000:08:00.0: Port module event"
    assert parse_record("4,7,100,c;continued").flags == "c"
    assert parse_record("14,5,0,-;with; semicolons; inside").message == "with; semicolons; inside"
    for bad in (b"", b"garbage", b"6,x,1,-;m", b"\xff\xfe\x00", "6,1;no usec", None, 42, b"6,1,2"):
        assert parse_record(bad) is None


def test_file_fresh_start_is_backlog_then_live_record_is_acted_on(tmp_path):
    log = tmp_path / "kmsg"
    log.write_text(filler(1) + rec(2, XID79) + " SUBSYSTEM=pci\n" + filler(3))
    got = []
    f = follower(tmp_path, log, got.append)
    assert f.kind == "file"
    incs = f.classify(f.start_batch(f.read_available()), 1)
    assert [(i.code, i.device, i.backlog, i.seq) for i in incs] == [("xid:79", "0000:91:00.0", True, 2)]
    assert got == incs and f.last_seq == 3 and f.counters["records"] == 3
    f.save_state(force=True)
    assert json.loads((tmp_path / "state" / "kmsg-h0.state").read_text()) == {"seq": 3, "boot_id": "boot-a"}
    # a live record: not backlog; the old Xid 79 is not posted again
    with log.open("a") as fh:
        fh.write(rec(4, "NVRM: Xid (PCI:0000:3b:00): 48, pid=9, DBE (double bit error) ECC error") + filler(5))
    incs = f.classify(f.accept(f.read_available()), 2)
    assert [(i.code, i.device, i.backlog, i.action) for i in incs] == [("xid:48", "0000:3b:00.0", False, "migrate-rank")]
    # the same Xid 79 live: the backlog sighting was never acted on, so this one is posted
    with log.open("a") as fh:
        fh.write(rec(6, XID79))
    assert [(i.code, i.backlog, i.seq) for i in f.classify(f.accept(f.read_available()), 3)] == [("xid:79", False, 6)]
    # and again right after: the follower posts every sighting (whether it is the same incident
    # is the engine's dedup: tests/unit/test_kmsg_repeats.py)
    with log.open("a") as fh:
        fh.write(rec(7, XID79))
    assert [(i.code, i.backlog, i.seq) for i in f.classify(f.accept(f.read_available()), 4)] == [("xid:79", False, 7)]
    assert f.counters["incidents"] == 4
    f.close()


def test_plain_log_lines_and_garbage_never_crash(tmp_path):
    log = tmp_path / "dmesg.txt"
    log.write_bytes(b"[  12.5] " + XID79.encode() + b"\n\xff\xfe binary \x00\x01\n" + b"x" * 70000 + b"\n" + b"6,9,1;bad\n")
    f = follower(tmp_path, log)
    incs = f.classify(f.start_batch(f.read_available()), 1)
    assert [(i.code, i.backlog, i.seq) for i in incs] == [("xid:79", True, None)]
    assert f.counters["plain_lines"] >= 3 and f.last_seq is None
    f.close()


def test_overrun_epipe_is_counted_logged_once_and_reading_continues(tmp_path, caplog):
    r, w = os.pipe()
    f = follower(tmp_path, tmp_path / "boot_id")  # any openable path; the reads are replaced below
    f.kind, f._fd = "kmsg", r
    script = [rec(10, "a").encode(), BrokenPipeError(), rec(14, XID79).encode(), BrokenPipeError(), BlockingIOError()]

    def fake_read(fd, n):
        x = script.pop(0)
        if isinstance(x, BaseException):
            raise x
        return x

    f._os_read = fake_read
    with caplog.at_level("DEBUG", logger="linkpass.kmsg"):
        items = f.read_available()
    assert [x.seq for x in items] == [10, 14]
    assert f.counters["overruns"] == 2
    assert sum("overrun" in m.getMessage() and m.levelname == "WARNING" for m in caplog.records) == 1
    f.last_seq = 9
    lines = f.accept(items)
    assert f.counters["seq_gaps"] == 3 and len(lines) == 2
    assert [i.code for i in f.classify(lines, 1)] == ["xid:79"]
    os.close(w)
    f.close()


def test_resume_skips_records_up_to_the_saved_seq(tmp_path):
    log = tmp_path / "kmsg"
    log.write_text(filler(1) + rec(2, XID79) + filler(3) + rec(4, "NVRM: Xid (PCI:0000:3b:00): 79, pid=1, GPU has fallen off the bus."))
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "kmsg-h0.state").write_text(json.dumps({"seq": 3, "boot_id": "boot-a"}))
    f = follower(tmp_path, log)
    incs = f.classify(f.start_batch(f.read_available()), 1)
    # seq 1..3 were read before the restart; seq 4 happened while the daemon was down: acted on
    assert [(i.device, i.backlog, i.seq) for i in incs] == [("0000:3b:00.0", False, 4)]
    assert f.counters["skipped_resume"] == 3 and f.last_seq == 4
    f.close()  # saves
    assert json.loads((tmp_path / "state" / "kmsg-h0.state").read_text())["seq"] == 4


@pytest.mark.parametrize("saved", [{"seq": 2, "boot_id": "boot-OLD"}, {"seq": 900, "boot_id": None}, {"seq": 900}])
def test_reboot_starts_over(tmp_path, saved):
    """A changed boot id, or a saved seq ahead of every record the kernel holds: start over."""
    log = tmp_path / "kmsg"
    log.write_text(filler(1) + rec(2, XID79) + filler(3))
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "kmsg-h0.state").write_text(json.dumps(saved))
    f = follower(tmp_path, log)
    incs = f.classify(f.start_batch(f.read_available()), 1)
    assert [(i.code, i.backlog) for i in incs] == [("xid:79", True)]
    assert f.counters["skipped_resume"] == 0 and f.last_seq == 3
    f.close()


def test_unreadable_state_and_unwritable_state_dir(tmp_path, caplog):
    log = tmp_path / "kmsg"
    log.write_text(rec(1, XID79))
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "kmsg-h0.state").write_text("{not json")
    f = follower(tmp_path, log)
    incs = f.classify(f.start_batch(f.read_available()), 1)
    assert incs[0].backlog
    f.state_file = tmp_path / "afile" / "x.state"
    (tmp_path / "afile").write_text("")  # a file where the directory should be
    f.save_state(force=True)
    assert f.counters["state_errors"] == 1
    f.close()


def test_missing_or_unreadable_kmsg_is_off(tmp_path, caplog):
    with caplog.at_level("WARNING", logger="linkpass.kmsg"):
        assert not KmsgFollower(str(tmp_path / "nope"), lambda e: None).open()
        assert not KmsgFollower(str(tmp_path), lambda e: None).open()  # a directory
    assert sum("kmsg source off" in r.getMessage() for r in caplog.records) == 2


def test_follow_fifo_with_the_loop(tmp_path):
    fifo = tmp_path / "kmsg.fifo"
    os.mkfifo(fifo)
    got = []
    f = follower(tmp_path, fifo, got.append, settle_s=0.01)
    assert f.kind == "fifo"

    async def main():
        state = tmp_path / "state" / "kmsg-h0.state"
        assert not state.exists()
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        os.write(fd, filler(1).encode())  # the backlog the follower finds when it starts
        os.close(fd)
        task = asyncio.create_task(f.run())
        # the start batch is read and saved (then the follower watches the fifo): what comes after is live
        await async_wait_until(lambda: state.exists() and json.loads(state.read_text())["seq"] == 1, 5,
                               "the follower's start batch (its state file at seq 1)")
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        os.write(fd, rec(2, XID79).encode())
        os.close(fd)  # the writer goes away: no EOF spin, the follower keeps waiting
        await async_wait_until(lambda: got, 5, "the first incident")
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        os.write(fd, rec(3, "mlx5_core 0000:08:00.0: mlx5_health_check: device's health compromised - reached miss count").encode())
        os.close(fd)
        await async_wait_until(lambda: len(got) > 1, 5, "the second incident")
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(main())
    assert [(i.code, i.backlog) for i in got] == [("xid:79", False), ("mlx5:health_compromised", False)]
    assert json.loads((tmp_path / "state" / "kmsg-h0.state").read_text())["seq"] == 3  # saved on stop
