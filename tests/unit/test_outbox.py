"""The durable outbox (linkpass.adapters.outbox): order, sequence numbers across restarts,
the overflow policy, malformed rows, unusable files."""

from __future__ import annotations

import json
import os
import sqlite3
import stat

import pytest

from linkpass.adapters.outbox import Outbox, OutboxError


def _ev(name: str):
    return lambda seq: json.dumps({"seq": seq, "name": name}).encode()


def _names(rows) -> list[str]:
    return [r.doc["name"] for r in rows]


def test_fifo_seq_and_ack(tmp_path):
    ob = Outbox(tmp_path / "o.sqlite", max_events=100)
    assert ob.depth() == 0 and ob.last_seq == 0
    seqs = [ob.put(_ev(f"e{i}")) for i in range(5)]
    assert seqs == [1, 2, 3, 4, 5]
    rows = ob.peek(3)
    assert _names(rows) == ["e0", "e1", "e2"] and [r.seq for r in rows] == [1, 2, 3]
    assert json.loads(rows[0].payload) == {"seq": 1, "name": "e0"}
    assert ob.ack([rows[0].rowid, rows[2].rowid]) == 2
    assert _names(ob.peek(10)) == ["e1", "e3", "e4"]
    assert ob.depth() == 3
    assert ob.ack([rows[0].rowid]) == 0  # already gone: nothing, no error
    assert _names(ob.peek(10, after=rows[1].rowid)) == ["e3", "e4"]
    ob.close()
    ob.close()  # idempotent


def test_file_is_wal_and_private(tmp_path):
    p = tmp_path / "sub" / "o.sqlite"
    ob = Outbox(p)
    ob.put(_ev("x"))
    assert stat.S_IMODE(p.stat().st_mode) == 0o600
    assert stat.S_IMODE(p.parent.stat().st_mode) == 0o700
    mode = sqlite3.connect(p).execute("PRAGMA journal_mode").fetchone()[0]
    assert mode == "wal"
    ob.close()


def test_restart_keeps_rows_and_sequence(tmp_path):
    p = tmp_path / "o.sqlite"
    ob = Outbox(p)
    for i in range(3):
        ob.put(_ev(f"a{i}"))
    ob.ack([ob.peek(1)[0].rowid])
    # no close(): as after kill -9 (the connection just goes away)
    del ob
    ob2 = Outbox(p)
    assert _names(ob2.peek(10)) == ["a1", "a2"]
    assert ob2.put(_ev("b")) == 4  # numbering goes on, never reused
    ob2.ack([r.rowid for r in ob2.peek(10)])
    ob2.close()
    ob3 = Outbox(p)
    assert ob3.depth() == 0 and ob3.put(_ev("c")) == 5  # even after the outbox was emptied
    ob3.close()


def test_overflow_drops_oldest_non_critical_first(tmp_path):
    ob = Outbox(tmp_path / "o.sqlite", max_events=3)
    ob.put(_ev("c1"), critical=True)
    ob.put(_ev("i1"), critical=False)
    ob.put(_ev("i2"), critical=False)
    ob.put(_ev("c2"), critical=True)  # full: i1 (oldest non-critical) goes
    assert _names(ob.peek(10)) == ["c1", "i2", "c2"]
    ob.put(_ev("c3"), critical=True)  # i2 goes
    assert _names(ob.peek(10)) == ["c1", "c2", "c3"]
    ob.put(_ev("i3"), critical=False)  # only critical ones left: the oldest of them goes
    assert _names(ob.peek(10)) == ["c2", "c3", "i3"]
    assert ob.depth() == 3 and ob.dropped_total == 3
    ob.close()
    again = Outbox(tmp_path / "o.sqlite", max_events=3)
    assert again.dropped_total == 3  # persisted: a counter that survives restarts
    again.close()


def test_smaller_limit_after_restart_trims_to_it(tmp_path):
    p = tmp_path / "o.sqlite"
    ob = Outbox(p, max_events=10)
    for i in range(6):
        ob.put(_ev(f"e{i}"))
    ob.close()
    ob = Outbox(p, max_events=3)
    ob.put(_ev("new"))
    assert _names(ob.peek(10)) == ["e4", "e5", "new"] and ob.dropped_total == 4
    ob.close()


def test_malformed_rows_are_removed_and_counted(tmp_path):
    p = tmp_path / "o.sqlite"
    ob = Outbox(p)
    ob.put(_ev("good1"))
    ob.close()
    db = sqlite3.connect(p)
    db.execute("INSERT INTO events (seq, critical, payload) VALUES (2, 1, ?)", (b"\xff\xfe not utf-8",))
    db.execute("INSERT INTO events (seq, critical, payload) VALUES (3, 1, ?)", (b"[1, 2]",))
    db.execute("INSERT INTO events (seq, critical, payload) VALUES ('x', 1, ?)", (b"{}",))
    db.execute("INSERT INTO events (seq, critical, payload) VALUES (4, 1, ?)", (b"{not json",))
    db.execute("INSERT INTO events (seq, critical, payload) VALUES (5, 1, ?)", (12345,))
    db.commit()
    db.close()
    ob = Outbox(p)
    ob.put(_ev("good2"))
    assert _names(ob.peek(100)) == ["good1", "good2"]
    assert ob.malformed == 5 and ob.depth() == 2
    assert _names(ob.peek(100)) == ["good1", "good2"]  # gone for good
    ob.close()


def test_seq_never_below_a_stored_row(tmp_path):
    p = tmp_path / "o.sqlite"
    Outbox(p).close()
    db = sqlite3.connect(p)
    db.execute("INSERT INTO events (seq, critical, payload) VALUES (41, 1, ?)", (b'{"name": "restored"}',))
    db.commit()
    db.close()
    ob = Outbox(p)
    assert ob.put(_ev("next")) == 42
    ob.close()


@pytest.mark.parametrize("content", [b"this is not an sqlite database, just text " * 20, b"\0" * 4096])
def test_a_file_that_is_not_an_outbox_is_moved_aside(tmp_path, content):
    p = tmp_path / "o.sqlite"
    p.write_bytes(content)
    ob = Outbox(p)
    assert ob.moved_aside and os.path.exists(ob.moved_aside)
    with open(ob.moved_aside, "rb") as f:
        assert f.read() == content  # kept for a post-mortem, not deleted
    assert ob.put(_ev("x")) == 1 and ob.depth() == 1
    ob.close()


def test_another_programs_database_is_moved_aside(tmp_path):
    p = tmp_path / "o.sqlite"
    db = sqlite3.connect(p)
    db.execute("CREATE TABLE events (when_ TEXT, what TEXT)")
    db.commit()
    db.close()
    ob = Outbox(p)
    assert ob.moved_aside
    assert ob.put(_ev("x")) == 1
    ob.close()


def test_newer_schema_is_not_touched_in_place(tmp_path):
    p = tmp_path / "o.sqlite"
    db = sqlite3.connect(p)
    db.execute("PRAGMA user_version=7")
    db.commit()
    db.close()
    ob = Outbox(p)
    assert ob.moved_aside
    assert sqlite3.connect(ob.moved_aside).execute("PRAGMA user_version").fetchone()[0] == 7
    ob.close()


def test_unusable_directory_is_one_clear_error(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(OutboxError) as e:
        Outbox(f / "o.sqlite")
    assert str(f / "o.sqlite") in str(e.value) and "\n" not in str(e.value)


def test_bad_arguments():
    with pytest.raises(ValueError):
        Outbox(":memory:", max_events=0)
    with pytest.raises(ValueError):
        Outbox(":memory:", sync="sometimes")


def test_full_sync_and_memory(tmp_path):
    ob = Outbox(tmp_path / "o.sqlite", sync="full")
    assert ob.put(_ev("x")) == 1
    ob.close()
    m = Outbox(":memory:", max_events=2)
    for i in range(4):
        m.put(_ev(f"m{i}"))
    assert _names(m.peek(5)) == ["m2", "m3"] and m.dropped_total == 2
    m.close()


def test_a_failing_builder_stores_nothing(tmp_path):
    ob = Outbox(tmp_path / "o.sqlite")

    def boom(seq):
        raise TypeError("not serialisable")
    with pytest.raises(TypeError):
        ob.put(boom)
    assert ob.depth() == 0 and ob.put(_ev("x")) == 1
    ob.close()


def test_one_process_per_outbox_file(tmp_path):
    p = tmp_path / "o.sqlite"
    first = Outbox(p)
    with pytest.raises(OutboxError, match="in use by another process"):
        Outbox(p)
    first.close()
    again = Outbox(p)  # free once the first one is closed
    again.close()


def _mode(p) -> int:
    return stat.S_IMODE(os.stat(p).st_mode)


def test_wal_and_shm_files_are_private_whatever_the_umask(tmp_path):
    """sqlite creates -wal and -shm with the database file's mode: the database is created
    0600 before sqlite opens it, so all three are 0600 even under umask 022."""
    p = tmp_path / "o.sqlite"
    old = os.umask(0o022)
    try:
        ob = Outbox(p)
        ob.put(_ev("x"))
        for f in (p, f"{p}-wal", f"{p}-shm", f"{p}.lock"):
            assert os.path.exists(f), f
            assert _mode(f) == 0o600, (f, oct(_mode(f)))
        ob.close()
    finally:
        os.umask(old)


def test_wider_files_of_an_older_outbox_are_narrowed(tmp_path):
    p = tmp_path / "o.sqlite"
    old = os.umask(0o022)
    try:
        db = sqlite3.connect(p)  # as an older linkpass (or sqlite3 by hand) left it: 0644
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("CREATE TABLE t (x)")
        db.commit()
        assert _mode(p) == 0o644 and _mode(f"{p}-wal") == 0o644 and _mode(f"{p}-shm") == 0o644
        ob = Outbox(p)  # while the other connection still holds -wal and -shm open
        ob.put(_ev("x"))
        for f in (p, f"{p}-wal", f"{p}-shm"):
            assert _mode(f) == 0o600, (f, oct(_mode(f)))
        db.close()
        ob.close()
    finally:
        os.umask(old)


def test_last_ts_is_kept_with_the_row_and_never_goes_down(tmp_path):
    p = tmp_path / "o.sqlite"
    ob = Outbox(p)
    assert ob.last_ts_us == 0
    ob.put(_ev("a"), ts_us=2_000_000)
    ob.put(_ev("b"), ts_us=1_000_000)  # an earlier time does not lower it
    ob.put(_ev("c"))  # nor does no time
    assert ob.last_ts_us == 2_000_000
    del ob  # as after kill -9
    ob = Outbox(p)
    assert ob.last_ts_us == 2_000_000
    ob.put(_ev("d"), ts_us=3_000_000)
    ob.close()
    assert Outbox(p).last_ts_us == 3_000_000

    def boom(seq):
        raise TypeError("not serialisable")
    ob = Outbox(tmp_path / "o2.sqlite")
    with pytest.raises(TypeError):
        ob.put(boom, ts_us=9)
    assert ob.last_ts_us == 0  # nothing stored, no time either
    ob.close()
