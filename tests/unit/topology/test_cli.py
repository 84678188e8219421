"""`linkpass topology` on captured files: JSON shape, matrix, table, bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from topology.importers import parse_file

CORPUS = Path(__file__).resolve().parents[2] / "fixtures" / "corpus"


def corpus_file(rel: str) -> Path:
    return CORPUS / rel


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "linkpass.cli", "topology", *args], capture_output=True, text=True, timeout=60)


def test_json_document_shape_from_an_nvsmi_matrix():
    p = run("--from", str(corpus_file("nvsmi_topo/hgx_h100_8gpu_8nic_1to1_pix.nvsmi_topo.txt")), "--json")
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["schema"] == "linkpass.topology/v1"
    assert len(doc["gpus"]) == 8 and doc["gpus"][0]["nearest_nics"] == ["mlx5_0"] and doc["gpus"][0]["path"] == "PIX"
    for g in doc["gpus"]:
        assert set(g) >= {"index", "pci_bus_id", "numa_node", "nearest_nics", "path"}
    for n in doc["nics"]:
        assert set(n) >= {"name", "pci_bus_id", "role", "role_reason", "rail", "ports"}
    assert [r["id"] for r in doc["rails"]] == list(range(8))
    assert doc["rails"][0]["nics"] == ["mlx5_0"] and doc["rails"][7]["nics"] == ["mlx5_7"]
    assert isinstance(doc["warnings"], list)


def test_several_files_combine_for_one_host():
    p = run("--from", str(corpus_file("ib_tools/gpud_h100_ib400_mixed_eth_some_down.ibstat.txt")),
            str(corpus_file("nvsmi_topo/hgx_h100_8gpu_8nic_1to1_pix.nvsmi_topo.txt")), "--json")
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    names = {n["name"] for n in doc["nics"]}
    assert {"mlx5_0", "mlx5_11"} <= names
    assert any(n["ports"] for n in doc["nics"] if n["name"] == "mlx5_0")


def test_from_given_twice_adds_the_files():
    a = run("--from", str(corpus_file("ib_tools/gpud_h100_ib400_mixed_eth_some_down.ibstat.txt")),
            "--from", str(corpus_file("nvsmi_topo/hgx_h100_8gpu_8nic_1to1_pix.nvsmi_topo.txt")), "--json")
    assert a.returncode == 0, a.stderr
    doc = json.loads(a.stdout)
    assert len(doc["gpus"]) == 8 and any(n["ports"] for n in doc["nics"] if n["name"] == "mlx5_0")


def test_bus_ids_are_printed_as_they_are():
    # rich would turn ":ab:" into an emoji shortcode
    xml = ('<system version="1"><cpu numaid="0" arch="x86_64"><pci busid="0000:ab:00.0" class="0x030200" '
           'vendor="0x10de" device="0x2330"/><pci busid="0000:cd:00.0" class="0x020700"><nic><net name="mlx5_0" '
           'dev="0" port="1" speed="400000" gdr="1"/></nic></pci></cpu></system>')
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".xml", delete=False) as f:
        f.write(xml)
    try:
        t = run("--from", f.name)
    finally:
        os.unlink(f.name)
    assert t.returncode == 0, t.stderr
    assert "0000:ab:00.0" in t.stdout and "\U0001f18e" not in t.stdout


def test_matrix_and_table_render():
    f = str(corpus_file("nvsmi_topo/dgxa100_style_8xA100_10nic_amd_8numa.nvsmi_topo.txt"))
    m = run("--from", f, "--matrix")
    assert m.returncode == 0 and "GPU0" in m.stdout and "NIC Legend" in m.stdout and "PXB" in m.stdout
    t = run("--from", f)
    assert t.returncode == 0 and "compute" in t.stdout and "mlx5_8" in t.stdout


@pytest.mark.parametrize("content,needle", [
    (b"", "empty file"),
    (b"\x00\x01\x02binary\x00", "binary data"),
    (b"hello world\nnothing to see\n", "not a format linkpass reads"),
])
def test_bad_files_give_warnings_not_tracebacks(tmp_path, content, needle):
    f = tmp_path / "in.txt"
    f.write_bytes(content)
    t = parse_file(f)
    assert any(needle in w and str(f) in w for w in t.warnings), t.warnings
    p = run("--from", str(f))
    assert p.returncode == 2 and needle in p.stderr and "Traceback" not in p.stderr


def test_missing_file_and_directory(tmp_path):
    assert any("no such file" in w for w in parse_file(tmp_path / "nope").warnings)
    assert any("is a directory" in w for w in parse_file(tmp_path).warnings)
    p = run("--from", str(tmp_path / "nope"), str(corpus_file("nvsmi_topo/hgx_h100_8gpu_8nic_1to1_pix.nvsmi_topo.txt")), "--json")
    assert p.returncode == 0 and any("no such file" in w for w in json.loads(p.stdout)["warnings"])


def test_sysfs_root_that_is_not_a_tree_is_exit_2(tmp_path):
    for root, needle in ((tmp_path / "nope", "no such directory"), (tmp_path, "not a captured sysfs tree")):
        p = run("--sysfs-root", str(root))
        assert p.returncode == 2 and needle in p.stderr and str(root) in p.stderr


def test_sources_that_disagree_are_warned():
    a = str(corpus_file("ib_tools/dgx_spark_gb10_cx7_ibdev2netdev_ibv_devinfo_2of4_down.txt"))
    b = str(corpus_file("ib_tools/dgx_spark_gx10_rdma_link_ibv_devices_all_active.txt"))
    doc = json.loads(run("--from", a, b, "--json").stdout)
    assert any("rocep1s0f0/1: state DOWN" in w and "ACTIVE" in w for w in doc["warnings"])
    x = str(corpus_file("nccl_topo/azure_ndv4-topo.xml"))
    y = str(corpus_file("nvsmi_topo/hgx_h100_8gpu_8nic_1to1_pix.nvsmi_topo.txt"))
    doc = json.loads(run("--from", x, y, "--json").stdout)
    assert any("no GPU in common" in w for w in doc["warnings"])


def test_capture_records_the_host_and_reads_back(tmp_path):
    import socket

    out = tmp_path / "cap"
    p = run("capture", "--out", str(out))
    assert p.returncode == 0, p.stderr
    doc = json.loads(run("--sysfs-root", str(out), "--json").stdout)
    assert doc["host"] == socket.gethostname()
    assert json.loads(run("--sysfs-root", str(out), "--json", "--host", "node-a").stdout)["host"] == "node-a"


# ----------------------------------------------------------------------------- bounded reads


def test_an_oversized_file_is_refused_after_reading_only_the_cap(tmp_path, monkeypatch):
    import topology.importers as imp

    f = tmp_path / "big.txt"
    f.write_bytes(b"GPU0\tX\n" * 1000)  # 7000 bytes
    assert len(imp.read_capped(f, 100)) == 101  # never the whole file
    monkeypatch.setattr(imp, "MAX_BYTES", 100)
    t = parse_file(f)
    assert t.warnings == [f"{f}: larger than 100 bytes; not read (a captured tool output is far smaller: is it the right file?)"]
    assert not (t.gpus or t.nics)


def test_dev_zero_is_refused_unread():
    t = parse_file("/dev/zero")
    assert t.warnings == ["/dev/zero: not a regular file (a character device)"]
    p = run("--from", "/dev/zero")
    assert p.returncode == 2 and "/dev/zero: not a regular file (a character device)" in p.stderr and "Traceback" not in p.stderr


def test_fifo_without_a_writer_reads_as_empty_and_does_not_block(tmp_path):
    fifo = tmp_path / "topo.fifo"
    os.mkfifo(fifo)
    assert parse_file(fifo).warnings == [f"{fifo}: empty file"]


def test_fifo_whose_writer_sends_nothing_is_given_up_on(tmp_path):
    import topology.importers as imp

    fifo = tmp_path / "topo.fifo"
    os.mkfifo(fifo)
    held = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)  # a writer that never writes
    try:
        with pytest.raises(imp.Refused, match=r"no data for 0\.01 s"):
            imp.read_capped(fifo, pipe_idle_s=0.01)
    finally:
        os.close(held)


def test_a_pipe_is_read_to_its_end_or_the_cap(tmp_path):
    """`--from <(cmd)`: the shell hands over /dev/fd/N, a pipe."""
    import topology.importers as imp

    text = corpus_file("nvsmi_topo/hgx_h100_8gpu_8nic_1to1_pix.nvsmi_topo.txt").read_bytes()
    r, w = os.pipe()
    try:
        os.write(w, text)
        os.close(w)
        w = None
        t = parse_file(f"/dev/fd/{r}")
        assert len(t.gpus) == 8 and t.warnings == []
    finally:
        os.close(r)
        if w is not None:
            os.close(w)
    r, w = os.pipe()
    try:
        os.write(w, b"x" * 5000)  # the writer keeps the pipe open: the cap ends the read, not EOF
        assert len(imp.read_capped(f"/dev/fd/{r}", 1000)) == 1001
    finally:
        os.close(r)
        os.close(w)


def test_capture_metadata_that_is_huge_or_deep_gives_no_host(tmp_path, monkeypatch):
    from topology import cli as tcli

    meta = tmp_path / tcli.CAPTURE_META
    meta.parent.mkdir(parents=True, exist_ok=True)
    meta.write_text('{"host": "h7"}')
    assert tcli._captured_host(str(tmp_path)) == "h7"
    meta.write_text('{"host": "h7", "pad": "' + "x" * tcli.MAX_META_BYTES + '"}')
    assert tcli._captured_host(str(tmp_path)) == ""
    meta.write_text("[" * 30_000 + "]" * 30_000)  # under the size cap: the parser's recursion limit
    assert tcli._captured_host(str(tmp_path)) == ""


@pytest.mark.parametrize("machine", ["hgx_h100_ib", "dual_port", "roce_bonds"])
@pytest.mark.parametrize("columns", ["80", "200"])
def test_table_shows_every_pci_bus_id_the_json_has(tmp_path, machine, columns):
    """The table names each NIC and GPU by its whole PCI bus id, also a NIC whose name is that id
    (a plain netdev), and also in a pipe's 80 columns: nothing the JSON has is left out or cut."""
    import sysfs_trees as st

    m, _ = st.MACHINES[machine]()
    st.build(tmp_path / "sys", m)
    doc = json.loads(run("--sysfs-root", str(tmp_path / "sys"), "--no-live", "--json").stdout)
    t = subprocess.run([sys.executable, "-m", "linkpass.cli", "topology", "--sysfs-root", str(tmp_path / "sys"), "--no-live"],
                       capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": columns})
    assert t.returncode == 0, t.stderr
    rows = [ln.split("│")[1:3] for ln in t.stdout.splitlines() if ln.startswith("│")]  # first two cells
    cells = {c.strip() for r in rows for c in r}
    ids = [n["pci_bus_id"] for n in doc["nics"]] + [g["pci_bus_id"] for g in doc["gpus"]]
    assert any(n["pci_bus_id"] == n["name"] for n in doc["nics"]) or machine != "hgx_h100_ib"  # the case that was blank
    for pci in filter(None, ids):
        assert pci in cells, (pci, t.stdout)
    for n in doc["nics"]:
        assert n["name"] in cells and [n["name"], n["pci_bus_id"] or "-"] in [[c.strip() for c in r] for r in rows]
