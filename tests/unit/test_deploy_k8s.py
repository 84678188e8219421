"""deploy/k8s: the DaemonSet manifest and the training-pod example, checked as data.

kubectl is not available here, so the YAML is loaded with pyyaml and its key fields are
checked: host network, capabilities, the mounts and their host paths, probes, scheduling; and
the ConfigMap's TOML passes `linkpass config check` once the node name and IP are put in, with
every path it names served by a mount of the container.
"""

from __future__ import annotations

import re
from pathlib import Path, PurePosixPath

import pytest
import yaml

from linkpass.adapters.hook_server import default_socket_path
from linkpass.autoconf import parse_peers_file
from linkpass.cli import main as cli_main
from linkpass.config import load_config

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"


def docs(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]


def one(kind: str, name: str = "daemonset.yaml") -> dict:
    (d,) = [d for d in docs(name) if d["kind"] == kind]
    return d


@pytest.fixture(scope="module")
def ds() -> dict:
    return one("DaemonSet")


@pytest.fixture(scope="module")
def pod(ds) -> dict:
    return ds["spec"]["template"]["spec"]


@pytest.fixture(scope="module")
def main(pod) -> dict:
    (c,) = [c for c in pod["containers"] if c["name"] == "linkpass"]
    return c


def mounts(container: dict, pod: dict) -> dict[str, tuple[dict, dict]]:
    """mountPath -> (volumeMount, volume)."""
    vols = {v["name"]: v for v in pod["volumes"]}
    out = {}
    for m in container["volumeMounts"]:
        assert m["name"] in vols, f"mount {m['name']} has no volume"
        out[m["mountPath"]] = (m, vols[m["name"]])
    return out


def mount_of(path: str, container: dict, pod: dict) -> tuple[str, dict, dict]:
    """The mount that serves ``path`` in the container (the longest mountPath above it)."""
    best = None
    for mp, (m, v) in mounts(container, pod).items():
        if PurePosixPath(path) == PurePosixPath(mp) or PurePosixPath(mp) in PurePosixPath(path).parents:
            if best is None or len(mp) > len(best[0]):
                best = (mp, m, v)
    assert best, f"{path} is not on any mount of {container['name']}"
    return best


def test_every_document_is_namespaced_and_known():
    kinds = [d["kind"] for d in docs("daemonset.yaml")]
    assert kinds == ["Namespace", "ResourceQuota", "ServiceAccount", "ConfigMap", "DaemonSet"]
    for d in docs("daemonset.yaml")[1:]:
        assert d["metadata"]["namespace"] == "linkpass", d["kind"]


def test_namespace_admits_privileged_pods():
    ns = one("Namespace")
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"


def test_daemonset_scheduling(ds, pod):
    assert ds["apiVersion"] == "apps/v1"
    assert ds["spec"]["selector"]["matchLabels"].items() <= ds["spec"]["template"]["metadata"]["labels"].items()
    assert pod["hostNetwork"] is True and pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert pod["priorityClassName"] == "system-node-critical"
    quota = one("ResourceQuota")["spec"]["scopeSelector"]["matchExpressions"][0]
    assert quota["scopeName"] == "PriorityClass" and "system-node-critical" in quota["values"]
    us = ds["spec"]["updateStrategy"]
    assert us["type"] == "RollingUpdate" and us["rollingUpdate"]["maxUnavailable"]
    assert any(t.get("key") == "nvidia.com/gpu" and t["operator"] == "Exists" for t in pod["tolerations"])
    assert pod["nodeSelector"]
    assert pod["serviceAccountName"] == one("ServiceAccount")["metadata"]["name"]


def test_container_capabilities(main):
    sc = main["securityContext"]
    assert set(sc["capabilities"]["add"]) == {"NET_ADMIN", "NET_RAW", "SYSLOG", "SYS_NICE"}
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert sc.get("privileged") is not True and sc["allowPrivilegeEscalation"] is False
    assert sc["readOnlyRootFilesystem"] is True


@pytest.mark.parametrize("path,host_path,read_only", [
    ("/run/linkpass", "/run/linkpass", False),
    ("/sys", "/sys", True),
    ("/dev/kmsg", "/dev/kmsg", True),
    ("/var/lib/linkpass", "/var/lib/linkpass", False),
])
def test_host_mounts(main, pod, path, host_path, read_only):
    m, v = mounts(main, pod)[path]
    assert v["hostPath"]["path"] == host_path
    assert bool(m.get("readOnly")) is read_only
    if path == "/dev/kmsg":
        assert v["hostPath"]["type"] == "CharDevice"


def test_probes_ask_the_daemon_on_its_control_socket(main):
    for probe in ("livenessProbe", "startupProbe"):
        cmd = main[probe]["exec"]["command"]
        assert cmd[:2] == ["linkpass", "status"] and cmd[cmd.index("--socket") + 1] == "/run/linkpass/linkpass.sock"
        assert main[probe]["timeoutSeconds"] > 5  # `linkpass status` waits up to 5 s for an answer


@pytest.fixture(scope="module")
def rendered(tmp_path_factory, pod) -> Path:
    """The ConfigMap's TOML with the init container's substitutions done, as a node would get it."""
    (init,) = pod["initContainers"]
    env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in init["env"]}
    assert env == {"NODE_NAME": "spec.nodeName", "HOST_IP": "status.hostIP"}
    script = " ".join(init["command"])
    values = {"NODE_NAME": "gpu-node-07", "HOST_IP": "198.19.0.7"}
    text = one("ConfigMap")["data"]["linkpass.toml"]
    for placeholder in set(re.findall(r"@(\w+)@", text)):
        assert f's/@{placeholder}@/${placeholder}/g' in script, f"@{placeholder}@ is never replaced"
        text = text.replace(f"@{placeholder}@", values[placeholder])
    assert "@" not in text
    path = tmp_path_factory.mktemp("k8s") / "linkpass.toml"
    path.write_text(text)
    return path


def test_configmap_toml_passes_config_check(rendered, capsys):
    rc = cli_main(["config", "check", "--no-files", str(rendered)])  # its files are the pod's
    out, err = capsys.readouterr()
    assert rc == 0 and err == "" and "OK (host gpu-node-07, mode per-rail-ip, rails from discovery" in out


def test_init_container_sees_the_files_config_check_reads(rendered, pod, main, tmp_path, capsys):
    """The init container's `config check` reads the notice key and peers.txt from the volumes the
    daemon reads them from, and /sys as the daemon does; with those files laid out as the pod has
    them, only discovery (a node without its NICs here) is left to fail."""
    (init,) = pod["initContainers"]
    cfg = load_config(rendered)
    for path in (cfg.daemon.notice_key_file, cfg.topology.peers_file, "/sys/class/infiniband"):
        _, _, v_init = mount_of(path, init, pod)
        assert v_init == mount_of(path, main, pod)[2], path
    assert cfg.topology.sysfs_root == "/"  # so the init container's discovery reads the /sys mounted above
    # the pod's files under tmp_path: peers.txt from the ConfigMap, the key as the Secret mounts it (0400)
    root = tmp_path / "etc-linkpass"
    peers = root / PurePosixPath(cfg.topology.peers_file).relative_to("/etc/linkpass")
    key = root / PurePosixPath(cfg.daemon.notice_key_file).relative_to("/etc/linkpass")
    peers.parent.mkdir(parents=True)
    key.parent.mkdir(parents=True)
    peers.write_text(one("ConfigMap")["data"][peers.name])
    key.write_text("0123456789abcdef0123456789abcdef\n")
    key.chmod(mount_of(cfg.daemon.notice_key_file, main, pod)[2]["secret"]["defaultMode"])
    here = tmp_path / "linkpass.toml"
    (tmp_path / "sys").mkdir()  # a node's /sys, here without its NICs: discovery finds no rail
    text = rendered.read_text().replace('"/etc/linkpass/', f'"{root}/')
    assert text.count('sysfs_root = "/"') == 1
    here.write_text(text.replace('sysfs_root = "/"', f'sysfs_root = "{tmp_path / "sys"}"'))
    rc = cli_main(["config", "check", str(here)])
    out, err = capsys.readouterr()
    # the key and peers.txt pass; what is left is discovery, which `linkpass run` would refuse too
    assert (rc, out, err) == (2, "", f'{here}: [topology] rails = "auto": discovery found no compute NIC with a '
                              "netdev; check `linkpass topology`, or list [[rails]] in the config\n")


def test_init_container_checks_what_the_daemon_reads(pod, main):
    (init,) = pod["initContainers"]
    script = " ".join(init["command"])
    cfg_path = main["command"][main["command"].index("--config") + 1]
    assert main["command"][:2] == ["linkpass", "run"]
    assert f"> {cfg_path}" in script and f"linkpass config check {cfg_path}" in script
    # the init container writes the file into the volume the daemon reads it from
    _, _, v_main = mount_of(cfg_path, main, pod)
    _, _, v_init = mount_of(cfg_path, init, pod)
    assert v_main is v_init or v_main == v_init


def test_every_path_of_the_config_is_mounted(rendered, pod, main):
    cfg = load_config(rendered)
    cm = one("ConfigMap")
    # the notice key: a Secret file, mode 0400 (read_key_file refuses group/other access)
    mp, m, v = mount_of(cfg.daemon.notice_key_file, main, pod)
    assert v["secret"]["defaultMode"] == 0o400 and m["readOnly"] is True
    assert [i["path"] for i in v["secret"]["items"]] == [PurePosixPath(cfg.daemon.notice_key_file).name]
    # peers_file comes from the ConfigMap and is a valid peers file
    mp, _, v = mount_of(cfg.topology.peers_file, main, pod)
    assert v["configMap"]["name"] == cm["metadata"]["name"]
    peers, warnings = parse_peers_file(cm["data"][PurePosixPath(cfg.topology.peers_file).name], "peers.txt")
    assert warnings == [] and len(peers) >= 2
    # the sockets, the NCCL env file and the state live on the host paths that are shared or kept
    run = "/run/linkpass"
    for p in (cfg.daemon.control_socket, default_socket_path(cfg.daemon.control_socket), cfg.nccl.env_file):
        assert mount_of(p, main, pod)[2]["hostPath"]["path"] == run, p
    assert mount_of(cfg.device.state_dir, main, pod)[2]["hostPath"]["path"] == "/var/lib/linkpass"
    assert cfg.device.kmsg_path == "/dev/kmsg" and cfg.topology.sysfs_root == "/"
    # metrics on the node's own address, announced to Prometheus on the same port
    assert str(cfg.metrics.address) == "198.19.0.7"
    ann = pod_annotations = one("DaemonSet")["spec"]["template"]["metadata"]["annotations"]
    assert ann["prometheus.io/port"] == str(cfg.metrics.port) and pod_annotations["prometheus.io/scrape"] == "true"
    assert {p["containerPort"] for p in main["ports"]} >= {cfg.metrics.port, cfg.daemon.notice_port, cfg.probe.port}


def test_training_pod_mounts_run_linkpass_read_only(rendered):
    (p,) = docs("training-pod-example.yaml")
    spec = p["spec"]
    # nccl.env names the node's rail netdevs, and the routes linkpass changes are the node's
    assert spec["hostNetwork"] is True
    (c,) = spec["containers"]
    m, v = mounts(c, spec)["/run/linkpass"]
    assert m["readOnly"] is True and v["hostPath"]["path"] == "/run/linkpass"
    cfg = load_config(rendered)
    script = "\n".join(c["args"])
    assert f". {cfg.nccl.env_file}" in script  # sources the env file the daemon writes
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env["LINKPASS_HOOKS_SOCKET"] == default_socket_path(cfg.daemon.control_socket)
    header = (K8S / "training-pod-example.yaml").read_text()
    assert "linkpass exec" in header
