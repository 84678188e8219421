"""deploy/prometheus-rules.yml: promtool accepts it, its alerts fire (and stay quiet) on series
shaped like linkpass's own, and it names only metrics linkpass exports.

promtool comes from Debian's ``prometheus`` package; ``make test`` installs the binary alone into
.venv/bin (the package's server would be started by its init script on install).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from linkpass.adapters.metrics import METRIC_NAMES

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus-rules.yml"


def _promtool() -> str | None:
    here = Path(sys.executable).parent / "promtool"
    return str(here) if here.exists() else shutil.which("promtool")


PROMTOOL = _promtool()
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (`make test` puts it in .venv/bin "
                                    "from Debian's prometheus package)")


@needs_promtool
def test_promtool_accepts_the_rules():
    p = subprocess.run([PROMTOOL, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "SUCCESS" in p.stdout


@needs_promtool
def test_promtool_rejects_a_broken_rule(tmp_path):
    """The check above can fail: a rule with a bad expression is refused."""
    bad = tmp_path / "bad.yml"
    bad.write_text(RULES.read_text().replace("linkpass_rails_usable == 0 and", "linkpass_rails_usable == == 0 and", 1))
    p = subprocess.run([PROMTOOL, "check", "rules", str(bad)], capture_output=True, text=True, timeout=60)
    assert p.returncode != 0


def test_rules_name_only_exported_metrics():
    names = set(re.findall(r"\blinkpass_[a-z_]+", RULES.read_text()))
    hist = {"linkpass_reroute_latency_seconds_bucket", "linkpass_detection_latency_seconds_bucket"}
    assert names, "no linkpass metric in the rules"
    assert names - set(METRIC_NAMES) - hist == set()


N = 'instance="n1", job="linkpass"'

UNIT_TESTS = f"""
rule_files:
  - {RULES}
evaluation_interval: 1m
tests:
  # rail 0 down (not suppressed) -> LinkpassRailDown; rail 1 down but suppressed -> only LinkpassRailSuppressed
  - interval: 1m
    input_series:
      - series: 'linkpass_rail_state{{{N}, rail="0", netdev="rail0", state="DOWN"}}'
        values: '0 1x10'
      - series: 'linkpass_rail_suppressed{{{N}, rail="0", netdev="rail0"}}'
        values: '0x10'
      - series: 'linkpass_rail_state{{{N}, rail="1", netdev="rail1", state="DOWN"}}'
        values: '0 1x10'
      - series: 'linkpass_rail_suppressed{{{N}, rail="1", netdev="rail1"}}'
        values: '0 1x10'
    alert_rule_test:
      - eval_time: 5m
        alertname: LinkpassRailDown
        exp_alerts:
          - exp_labels: {{severity: warning, instance: n1, job: linkpass, rail: "0", netdev: rail0, state: DOWN}}
            exp_annotations:
              summary: "rail 0 (rail0) is down on n1"
              description: "Traffic was moved to the other rails; the job runs with less bandwidth. Check the NIC, cable and switch port."
      - eval_time: 5m
        alertname: LinkpassRailSuppressed
        exp_alerts:
          - exp_labels: {{severity: warning, instance: n1, job: linkpass, rail: "1", netdev: rail1}}
            exp_annotations:
              summary: "rail 1 (rail1) on n1 is suppressed by flap damping"
              description: "The rail kept flapping; it stays out of use until its penalty decays below the reuse limit."

  # a rail at risk and a GPU at risk -> one warning each; a clean rail -> nothing
  - interval: 1m
    input_series:
      - series: 'linkpass_rail_at_risk{{{N}, rail="0", netdev="rail0"}}'
        values: '0 1x10'
      - series: 'linkpass_rail_at_risk{{{N}, rail="1", netdev="rail1"}}'
        values: '0x10'
      - series: 'linkpass_gpu_at_risk{{{N}, gpu="3"}}'
        values: '0 1x10'
    alert_rule_test:
      - eval_time: 3m
        alertname: LinkpassRailAtRisk
        exp_alerts:
          - exp_labels: {{severity: warning, instance: n1, job: linkpass, rail: "0", netdev: rail0}}
            exp_annotations:
              summary: "rail 0 (rail0) on n1 is at risk and drained"
              description: "Its error counters climb (linkpass status shows which, at what rate): traffic was moved off it before it fails. Check the optic, cable and switch port at a quiet moment; it is used again after its counters stay clean for the hold time."
      - eval_time: 3m
        alertname: LinkpassGpuAtRisk
        exp_alerts:
          - exp_labels: {{severity: warning, instance: n1, job: linkpass, gpu: "3"}}
            exp_annotations:
              summary: "GPU 3 on n1 is at risk"
              description: "Its counters say it may fail soon (linkpass status shows which): protected ranks on it move to spares at a step boundary. Drain the node at a quiet moment, then reset or replace the GPU."

  # every rail down on a ready daemon -> critical; the same on a daemon still starting -> nothing
  - interval: 1m
    input_series:
      - series: 'linkpass_rails_usable{{{N}}}'
        values: '2 0x10'
      - series: 'linkpass_rails_configured{{{N}}}'
        values: '2x10'
      - series: 'linkpass_ready{{{N}}}'
        values: '1x10'
      - series: 'linkpass_rails_usable{{instance="n2", job="linkpass"}}'
        values: '0x10'
      - series: 'linkpass_rails_configured{{instance="n2", job="linkpass"}}'
        values: '2x10'
      - series: 'linkpass_ready{{instance="n2", job="linkpass"}}'
        values: '0x10'
    alert_rule_test:
      - eval_time: 3m
        alertname: LinkpassAllRailsDown
        exp_alerts:
          - exp_labels: {{severity: critical, instance: n1, job: linkpass}}
            exp_annotations:
              summary: "no usable rail on n1"
              description: "Every rail is down, suppressed or drained: the node cannot reach its peers over the fabric."

  # three failovers in a few minutes -> flapping; one -> nothing
  - interval: 1m
    input_series:
      - series: 'linkpass_failovers_total{{{N}, rail="0"}}'
        values: '0 1 2 3 3 3 3 3 3 3 3'
      - series: 'linkpass_failovers_total{{{N}, rail="1"}}'
        values: '0 1x10'
    alert_rule_test:
      - eval_time: 10m
        alertname: LinkpassRailFlapping
        exp_alerts:
          - exp_labels: {{severity: warning, instance: n1, job: linkpass, rail: "0"}}
            exp_annotations:
              summary: "rail 0 on n1 failed over 3 times in 15 minutes"
              description: "A flapping link (optics, cable, switch port). Flap damping holds it out of use once its penalty passes the suppress limit."

  # a device fault that needs migration; outbox stuck for 10 minutes; the daemon stops answering
  - interval: 1m
    input_series:
      - series: 'linkpass_device_faults_total{{{N}, domain="gpu"}}'
        values: '0 0 1x10'
      - series: 'linkpass_mqtt_outbox_depth{{{N}}}'
        values: '0 5 7 9 12 15 20 25 30 35 40 45 50'
      - series: 'linkpass_mqtt_outbox_depth{{instance="n2", job="linkpass"}}'
        values: '0 5 0 5 0 5 0 5 0 5 0 5 0'
      - series: 'up{{{N}}}'
        values: '1 1 0x10'
    alert_rule_test:
      - eval_time: 4m
        alertname: LinkpassDeviceFaultNeedsMigration
        exp_alerts:
          - exp_labels: {{severity: critical, instance: n1, job: linkpass, domain: gpu}}
            exp_annotations:
              summary: "gpu fault on n1: the rank there must move to a spare"
              description: "A device fault that rerouting cannot fix (e.g. a GPU Xid). The torch hooks were told to migrate the rank; check the job and `linkpass status` (incidents) on the node."
      - eval_time: 12m
        alertname: LinkpassMqttOutboxBackingUp
        exp_alerts:
          - exp_labels: {{severity: warning, instance: n1, job: linkpass}}
            exp_annotations:
              summary: "linkpass alerts from n1 are not reaching the MQTT broker"
              description: "The durable outbox has not been empty for 10 minutes (never fewer than 7 events waiting); check the broker and the node's credentials."
      - eval_time: 5m
        alertname: LinkpassDaemonDown
        exp_alerts:
          - exp_labels: {{severity: critical, instance: n1, job: linkpass}}
            exp_annotations:
              summary: "linkpass on n1 does not answer scrapes"
              description: "Nothing watches this node's rails: faults are not rerouted and no alert is sent. Check `systemctl status linkpass` and `journalctl -u linkpass` on the node."
"""


@needs_promtool
def test_alerts_fire_on_linkpass_shaped_series(tmp_path):
    t = tmp_path / "rules_test.yml"
    t.write_text(UNIT_TESTS)
    p = subprocess.run([PROMTOOL, "test", "rules", str(t)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
