"""linkpass.lab.ports (not linkpass.adapters.ports): a port for a child's server, outside the kernel's ephemeral range."""

from __future__ import annotations

import random
import socket

from linkpass.lab import ports


def test_the_port_is_outside_the_ephemeral_range_and_free(tmp_path, monkeypatch):
    f = tmp_path / "range"
    f.write_text("20000\t60999\n")
    monkeypatch.setattr(ports, "_RANGE", str(f))
    assert ports.ephemeral_range() == (20000, 60999)
    rng = random.Random(5)
    for _ in range(50):
        p = ports.listen_port(rng=rng)
        assert not 20000 <= p <= 60999 and p >= 10000
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))  # free: a child can take it


def test_an_unreadable_or_malformed_range_falls_back_to_the_kernel_default(tmp_path, monkeypatch):
    for text in ("", "garbage", "70000 80000", "5"):
        f = tmp_path / "range"
        f.write_text(text)
        monkeypatch.setattr(ports, "_RANGE", str(f))
        assert ports.ephemeral_range() == (32768, 60999)
    monkeypatch.setattr(ports, "_RANGE", str(tmp_path / "missing"))
    assert ports.ephemeral_range() == (32768, 60999)


def test_a_range_covering_every_port_leaves_the_kernel_to_choose(tmp_path, monkeypatch):
    f = tmp_path / "range"
    f.write_text("1024 65535")
    monkeypatch.setattr(ports, "_RANGE", str(f))
    p = ports.listen_port()
    assert 0 < p <= 65535
