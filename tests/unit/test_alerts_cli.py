"""`linkpass alerts tail` without a broker: argument checks (one line, exit 2), broker
addresses, how the last will and connect failures are worded.  (With a real broker:
tests/integration/test_mqtt_publisher.py.)"""

from __future__ import annotations

import json

import pytest

from linkpass.cli import alerts as alerts_cli
from linkpass.adapters import mqtt
from linkpass.cli.alerts import ClosedBeforeConnack, connect_error_text, parse_broker, status_text

TS = "2026-11-29T21:50:16.266842Z"


def _status(status: str, reason: str) -> dict:
    return {"schema": "linkpass.host-status/v1", "id": "6f1c2d4e-8a8b-4c1e-9d7e-2b1f0c3a4d5e", "host": "h0", "seq": 3,
            "ts": TS, "status": status, "reason": reason, "pid": 42, "client_id": "linkpass-h0"}


def test_parse_broker_ipv6_and_ports():
    assert parse_broker("[::1]:8883") == ("::1", 8883)
    assert parse_broker("[fd00::5]") == ("fd00::5", 1883)
    assert parse_broker("mqtt.example.net") == ("mqtt.example.net", 1883)
    assert parse_broker("10.0.0.1:1884") == ("10.0.0.1", 1884)
    for bad in ("[::1", "[::1]x", ":1883", "h:0", "h:99999", "h:port"):
        with pytest.raises(ValueError):
            parse_broker(bad)


def test_last_will_is_not_shown_as_the_time_of_death():
    live_when, live = status_text(_status("offline", mqtt.WILL_REASON), retained=False, received_ts="2026-11-29T22:00:00.000000Z")
    assert live_when == "2026-11-29T22:00:00.000000Z"  # when it arrived, not the payload's ts
    assert "connection lost" in live and f"set at connect {TS}" in live and "when it noticed the loss" in live
    kept_when, kept = status_text(_status("offline", mqtt.WILL_REASON), retained=True, received_ts="2026-11-29T22:00:00.000000Z")
    assert kept_when == "-" and f"set at connect {TS}" in kept and "not known" in kept
    # a clean stop and a connect are what they say, at their own ts
    assert status_text(_status("offline", "daemon stopped"), False, "x") == (TS, "daemon stopped")
    assert status_text(_status("online", "connected"), True, "x") == (TS, "connected")


def test_status_lines_printed(capsys):
    from rich.console import Console
    console = Console(highlight=False, soft_wrap=True, width=300)
    alerts_cli._show_status(console, False, _status("online", "connected"))
    alerts_cli._show_status(console, False, _status("offline", mqtt.WILL_REASON), retained=True)
    alerts_cli._show_status(None, True, _status("offline", mqtt.WILL_REASON))
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(TS) and "ONLINE" in out[0] and out[0].endswith("connected")
    assert out[1].startswith("- ") and "OFFLINE" in out[1] and f"(last will, set at connect {TS};" in out[1]
    assert json.loads(out[2])["reason"] == mqtt.WILL_REASON  # --json: the payload as it is


def test_connect_failure_lines():
    import aiomqtt
    reset = aiomqtt.MqttError(ClosedBeforeConnack("failed to receive on socket: [Errno 104] Connection reset by peer"))
    text = connect_error_text(reset, tls=False)
    assert text.startswith("connection reset before the broker answered") and "a TLS port?" in text and "[mqtt] tls" in text
    closed = connect_error_text(aiomqtt.MqttError(ClosedBeforeConnack(None)), tls=False)
    assert closed.startswith("connection closed before the broker answered") and "a TLS port?" in closed
    assert "a TLS port?" not in connect_error_text(reset, tls=True)
    assert connect_error_text(aiomqtt.MqttError("Operation timed out"), tls=False) == "no answer within 5 s"
    assert "is a broker listening" in connect_error_text(aiomqtt.MqttError("[Errno 111] Connection refused"), tls=False)
    for t in (text, closed):
        assert "\n" not in t


@pytest.mark.parametrize("argv,expect", [
    (["--session", "bad name"], "--session 'bad name': use 1-128 letters"),
    (["--session", "-x"], "letters, digits"),
    (["--session", "n" * 129], "use 1-128"),
    (["--session", "linkpass-h0"], "the daemons' client ids"),
    (["--session-expiry-s", "60"], "--session-expiry-s needs --session NAME"),
    (["--session", "noc1", "--session-expiry-s", "0"], "--session-expiry-s 0: must be 1..4294967295"),
    (["--count", "0"], "--count must be at least 1"),
    (["--timeout", "0"], "--timeout must be more than 0"),
    (["--broker", "[::1"], "missing ']'"),
])
def test_bad_arguments_are_one_line_exit_2(capsys, argv, expect):
    if argv[0] == "--session" and argv[1].startswith("-"):
        argv = ["--session=" + argv[1]]
    assert alerts_cli.main(["tail", "--broker", "127.0.0.1:1", *argv] if "--broker" not in argv else ["tail", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("linkpass: alerts: ") and err.count("\n") == 1 and expect in err, err


def test_session_equal_to_the_configs_client_id_is_refused(tmp_path, capsys):
    cfg = tmp_path / "lp.toml"
    cfg.write_text('[daemon]\nhost = "h9"\nhost_ip = "198.19.0.9"\n[[rails]]\nid = 0\nnetdev = "rail0"\n'
                   '[mqtt]\nenabled = true\nclient_id = "noc1"\n')
    assert alerts_cli.main(["tail", "--config", str(cfg), "--session", "noc1"]) == 2
    err = capsys.readouterr().err
    assert "mqtt.client_id" in err and err.count("\n") == 1


def test_deeply_nested_or_garbage_payloads_are_skipped_with_one_line(capsys):
    from types import SimpleNamespace

    class Topic(str):
        def matches(self, t):
            return True

    for payload in (b"[" * 200_000 + b"]" * 200_000, b"\xff\xfe", b"{"):
        msg = SimpleNamespace(topic=Topic("linkpass/h0/events"), payload=payload, retain=False)
        assert alerts_cli._handle(msg, ["linkpass/#"], SimpleNamespace(json=True), None, {}) is False
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 3 and all("skipped" in line for line in err)
