"""topology.importers.nccl_xml: NCCL topology XML files from the corpus (dumps, cloud files,
skeletons, a cut-off paste), the PCI tree it builds, and bad input (never an exception)."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import FIXTURES, corpus_file
from hypothesis import given, settings
from hypothesis import strategies as st

from topology.affinity import analyse, path_type
from topology.importers import nccl_xml

CORPUS = sorted(p.name for p in (FIXTURES / "corpus" / "nccl_topo").iterdir())


def _read(rel: str) -> str:
    return corpus_file(rel).read_text()


# ---------------------------------------------------------------- the corpus

def test_every_corpus_file_is_covered(expected):
    assert CORPUS and all(f"nccl_topo/{name}" in expected for name in CORPUS)


@pytest.mark.parametrize("name", CORPUS)
def test_corpus_file(name, expected):
    rel = f"nccl_topo/{name}"
    exp = expected[rel]
    text = _read(rel)
    assert nccl_xml.looks_like(text)
    topo = analyse(nccl_xml.parse(text, rel))
    assert topo.sources == [rel]
    assert all(w.startswith(f"{rel}: ") for w in topo.warnings)
    # gpu_count null: the file names no GPU, so none is claimed
    assert len(topo.gpus) == (exp["gpu_count"] or 0)
    if "gpu_nearest_nics" in exp:
        assert {g.key: g.nearest_nics for g in topo.gpus} == exp["gpu_nearest_nics"]
    roles = {n.name: n.role for n in topo.nics}
    assert {n for n, r in roles.items() if r == "compute"} == set(exp["compute_nics"] or [])
    non_compute = {n for n, r in roles.items() if r != "compute"}
    assert set(exp["non_compute_nics"]) <= non_compute
    assert non_compute == set(exp["non_compute_nics"])
    if "unclassified_devices" in exp:
        assert topo.unclassified == exp["unclassified_devices"]
        assert any("unknown kind" in w for w in topo.warnings)
    else:
        assert topo.unclassified == []


@pytest.mark.parametrize("name", ["alibaba_8xA100_mlx5bond_topo.xml", "aws_p4d-24xl-topo.xml", "azure_ncv4-topo.xml",
                                  "azure_ndv2-topo.xml", "azure_ndv4-topo.xml"])
def test_complete_files_read_without_warnings(name):
    assert nccl_xml.parse(_read(f"nccl_topo/{name}"), name).warnings == []


def test_pci_tree_of_a_dump():
    topo = nccl_xml.parse(_read("nccl_topo/alibaba_8xA100_mlx5bond_topo.xml"), "t")
    pci = topo.pci
    # three levels of switch above GPU 0; each switch element counts as two bridge levels
    assert [pci[b].parent for b in ("0000:13:00.0", "0000:11:00.0", "0000:0e:00.0", "0000:0c:00.0")] == \
        ["0000:11:00.0", "0000:0e:00.0", "0000:0c:00.0", None]
    assert [pci[b].weight for b in ("0000:13:00.0", "0000:11:00.0", "0000:0c:00.0", "0000:06:00.0")] == [1, 2, 2, 1]
    assert pci["0000:13:00.0"].root == "cpu:0" and pci["0000:89:00.0"].root == "cpu:1"
    assert pci["0000:89:00.0"].numa_node == 1
    assert pci["0000:13:00.0"].pci_class == "0x030200" and pci["0000:13:00.0"].vendor == "0x10de"
    assert path_type(pci, "0000:13:00.0", "0000:1a:00.0") == "PXB"
    assert path_type(pci, "0000:13:00.0", "0000:06:00.0") == "PHB"
    assert path_type(pci, "0000:13:00.0", "0000:90:00.0") == "SYS"
    gpus = {g.pci_bus_id: (g.index, g.numa_node) for g in topo.gpus}
    assert gpus["0000:13:00.0"] == (0, 0) and gpus["0000:b3:00.0"] == (7, 1)
    nic = topo.nic("mlx5_bond_1")
    assert (nic.pci_bus_id, nic.numa_node, nic.kind) == ("0000:1a:00.0", 0, "rdma")
    assert nic.ports[0].port == 1 and nic.ports[0].rate_gbps == 200.0


def test_front_end_bond_hanging_off_the_cpu_has_no_rail():
    topo = analyse(nccl_xml.parse(_read("nccl_topo/alibaba_8xA100_mlx5bond_topo.xml"), "t"))
    fe = topo.nic("mlx5_bond_0")
    assert fe.role == "front-end" and fe.rail is None and "nearer NIC" in fe.role_reason
    assert {n.name: n.rail for n in topo.nics if n.rail is not None} == \
        {"mlx5_bond_1": 0, "mlx5_bond_2": 1, "mlx5_bond_3": 2, "mlx5_bond_4": 3}


def test_cloud_files_classify_by_pci_class():
    p4d = nccl_xml.parse(_read("nccl_topo/aws_p4d-24xl-topo.xml"), "t")
    efa = p4d.nic("0000:10:1b.0")
    assert efa.kind == "efa" and efa.pci_bus_id == "0000:10:1b.0" and efa.numa_node == 0
    assert all(g.index is None for g in p4d.gpus)
    assert p4d.pci["ffff:ff:01.0"].weight == 2
    ndv2 = nccl_xml.parse(_read("nccl_topo/azure_ndv2-topo.xml"), "t")
    assert ndv2.nic("0101:00:00.0").kind == "rdma"
    assert [g.numa_node for g in ndv2.gpus] == [0, 0, 0, 0, 1, 1, 1, 1]


def test_nic_without_pci_parent():
    topo = analyse(nccl_xml.parse(_read("nccl_topo/azure_ncv4-topo.xml"), "t"))
    eth = topo.nic("eth0")
    assert (eth.pci_bus_id, eth.numa_node, eth.kind, eth.netdevs) == (None, 0, "ethernet", ["eth0"])
    assert eth.role == "front-end" and eth.rail is None
    assert [g.index for g in topo.gpus] == [0, 1, 2, 3]


def test_skeleton_builds_the_tree_but_no_devices():
    topo = nccl_xml.parse(_read("nccl_topo/aws_p5-48xl-topo.xml"), "p5")
    assert topo.gpus == [] and topo.nics == []
    assert topo.pci["0000:4f:00.0"].parent == "0000:45:00.0" and topo.pci["0000:45:00.0"].weight == 2
    assert len(topo.unclassified) == 32
    assert len(topo.warnings) == 1 and topo.warnings[0].startswith("p5: line 19: 32 PCI device(s)")


def test_paste_reads_only_the_first_block():
    rel = "nccl_topo/nccltests256_h200_baremetal_vs_kvm_vm_partial_dumps.txt"
    topo = analyse(nccl_xml.parse(_read(rel), "paste"))
    assert [(g.index, g.pci_bus_id) for g in topo.gpus] == [(0, "0000:18:00.0"), (1, "0000:2a:00.0"), (2, "0000:3a:00.0")]
    # nothing from the KVM guest block (flat tree, 0000:05:00.0 GPU, numaid -1)
    assert "0000:05:00.0" not in topo.pci and "0000:0d:00.0" not in topo.pci
    cut = next(w for w in topo.warnings if "cut off" in w)
    assert cut.startswith("paste: line 56: ")
    assert any("another <system> block follows" in w and w.startswith("paste: line 58: ") for w in topo.warnings)
    lost = topo.nic("0000:5c:00.0")
    assert lost.numa_node == 1 and lost.kind == "rdma" and lost.role == "compute"
    assert "missing from the source" in lost.role_reason
    assert {n.name: n.rail for n in topo.nics} == {"mlx5_0": 0, "mlx5_1": 1, "mlx5_2": 2, "0000:5c:00.0": 3}


def test_bus_ids_are_normalised():
    text = ('<system version="1"><cpu numaid="0">'
            '<pci busid="1A:00.0" class="0x030200"><gpu dev="0"/></pci>'
            '<pci busid="00000000:1B:00.0" class="0x020700"/>'
            '</cpu></system>')
    topo = nccl_xml.parse(text, "t")
    assert [g.pci_bus_id for g in topo.gpus] == ["0000:1a:00.0"]
    assert [n.name for n in topo.nics] == ["0000:1b:00.0"]
    assert topo.warnings == []


def test_file_without_gpus():
    text = ('<system version="1"><cpu numaid="0">'
            '<pci busid="0000:19:00.0" class="0x020000" vendor="0x15b3">'
            '<nic><net name="mlx5_0" dev="0" port="1" speed="400000" gdr="1"/></nic></pci>'
            '<pci busid="0000:29:00.0" class="0x020000" vendor="0x15b3">'
            '<nic><net name="mlx5_1" dev="1" port="1" speed="400000" gdr="1"/></nic></pci>'
            '</cpu></system>')
    topo = analyse(nccl_xml.parse(text, "t"))
    assert topo.gpus == [] and topo.warnings == []
    assert {n.name: n.role for n in topo.nics} == {"mlx5_0": "compute", "mlx5_1": "compute"}


# ---------------------------------------------------------------- bad input

@pytest.mark.parametrize("text", ["", "   \n", "not xml at all", "\x00\x01\x02\xff\xfe binary \x89PNG\r\n\x1a\n",
                                  "<system", "<system>", "<system version='1'><cpu numaid='x'><pci busid='zz'>",
                                  "<system><cpu></pci></cpu></system>", "<system><cpu numaid='0'>\x00</cpu></system>",
                                  "<system><!-- never closed", "<system><pci busid='0000:01:00.0' class=\"0x0302",
                                  "<?xml version='1.0'?><system><cpu numaid='0'><nic/></cpu></system>",
                                  "<system><net name='mlx5_0'/></system>",
                                  "<system><cpu><pci class='0x030200'><gpu dev='zero'/></pci></cpu></system>"])
def test_garbage_gives_a_warning_never_an_exception(text):
    topo = nccl_xml.parse(text, "junk.xml")
    assert topo.warnings and all(w.startswith("junk.xml: ") for w in topo.warnings)
    analyse(topo)


def test_looks_like_rejects_other_text():
    assert not nccl_xml.looks_like("")
    assert not nccl_xml.looks_like("\tGPU0\tGPU1\tNIC0\tCPU Affinity\n")
    assert not nccl_xml.looks_like("<html><body>system</body></html>")
    assert not nccl_xml.looks_like(None)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["alibaba_8xA100_mlx5bond_topo.xml", "azure_ncv4-topo.xml"])
def test_every_line_truncation_parses(name):
    lines = _read(f"nccl_topo/{name}").splitlines(keepends=True)
    start = next(i for i, ln in enumerate(lines) if "<system" in ln)
    for k in range(len(lines) + 1):
        cut = "".join(lines[:k])
        topo = analyse(nccl_xml.parse(cut, "cut"))
        if start < k < len(lines) - 1:
            assert any("cut off" in w for w in topo.warnings), k
        if k < len(lines):  # and in the middle of the next line
            analyse(nccl_xml.parse(cut + lines[k][: len(lines[k]) // 2], "cut"))
    # a cut right after GPU 0's <pci> still yields GPU 0 and the switches above it
    full = "".join(lines)
    if "0000:13:00.0" in full:
        at = full.index('<gpu dev="0"')
        topo = nccl_xml.parse(full[:at], "cut")
        assert [g.pci_bus_id for g in topo.gpus] == ["0000:13:00.0"]
        assert topo.pci["0000:0c:00.0"].weight == 2


def test_duplicate_nic_name_warns_and_keeps_the_first():
    text = ('<system version="1"><cpu numaid="0">'
            '<pci busid="0000:19:00.0" class="0x020000"><nic><net name="mlx5_0" port="1"/></nic></pci>\n'
            '<pci busid="0000:29:00.0" class="0x020000"><nic><net name="mlx5_0" port="1"/></nic></pci>'
            '</cpu></system>')
    topo = nccl_xml.parse(text, "dup.xml")
    assert [(n.name, n.pci_bus_id) for n in topo.nics] == [("mlx5_0", "0000:19:00.0")]
    assert any("mlx5_0 appears twice" in w and w.startswith("dup.xml: line 2: ") for w in topo.warnings)


def test_duplicate_bus_id_and_gpu_index_warn():
    text = ('<system version="1"><cpu numaid="0">\n'
            '<pci busid="0000:18:00.0" class="0x030200"><gpu dev="0"/></pci>\n'
            '<pci busid="0000:18:00.0" class="0x030200"><gpu dev="0"/></pci>\n'
            '<pci busid="0000:28:00.0" class="0x030200"><gpu dev="0"/></pci>\n'
            '</cpu></system>')
    topo = nccl_xml.parse(text, "dup.xml")
    assert [(g.index, g.pci_bus_id) for g in topo.gpus] == [(0, "0000:18:00.0"), (None, "0000:28:00.0")]
    assert any("0000:18:00.0 appears twice" in w and "line 3" in w for w in topo.warnings)
    assert any("GPU index 0 is given twice" in w for w in topo.warnings)


def test_mismatched_tags_keep_what_came_before():
    text = ('<system version="1"><cpu numaid="0">\n'
            '<pci busid="0000:18:00.0" class="0x030200"><gpu dev="0"/></pci>\n'
            '<pci busid="0000:19:00.0" class="0x020700"></cpu>\n'
            '<pci busid="0000:28:00.0" class="0x030200"><gpu dev="1"/></pci>\n'
            '</system>')
    topo = nccl_xml.parse(text, "bad.xml")
    assert [g.pci_bus_id for g in topo.gpus] == ["0000:18:00.0"]
    assert any(w.startswith("bad.xml: line 3: XML error") for w in topo.warnings)


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=st.sampled_from(list('<>/="\' systemcpupcigpunicnetbusid0123456789abcdef:.x-!?\n')), max_size=400))
def test_fuzzed_xml_like_text_never_raises(text):
    analyse(nccl_xml.parse(text, "fuzz"))
    nccl_xml.looks_like(text)


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_mutated_corpus_file_never_raises(data):
    text = _read("nccl_topo/alibaba_8xA100_mlx5bond_topo.xml")
    n = data.draw(st.integers(1, 8))
    for _ in range(n):
        i = data.draw(st.integers(0, max(0, len(text) - 1)))
        j = data.draw(st.integers(i, min(len(text), i + 200)))
        op = data.draw(st.sampled_from(["drop", "dup", "junk"]))
        if op == "drop":
            text = text[:i] + text[j:]
        elif op == "dup":
            text = text[:j] + text[i:j] + text[j:]
        else:
            text = text[:i] + data.draw(st.text(max_size=20)) + text[j:]
    analyse(nccl_xml.parse(text, "mut"))


def test_module_is_pure():
    src = Path(nccl_xml.__file__).read_text()
    for bad in ("import os", "import subprocess", "open(", "import socket"):
        assert bad not in src


def test_lone_nic_in_a_switch_of_another_model_is_not_a_rail():
    rel = "nccl_topo/nccltests256_h200_baremetal_vs_kvm_vm_partial_dumps.txt"
    text = _read(rel).replace('busid="0000:5a:00.0" class="0x060400" vendor="0x1000" device="0xc030"',
                              'busid="0000:5a:00.0" class="0x060400" vendor="0x1000" device="0xc010"')
    topo = analyse(nccl_xml.parse(text, "t"))
    assert topo.nic("0000:5c:00.0").role == "storage"
    assert [n.name for n in topo.nics if n.role == "compute"] == ["mlx5_0", "mlx5_1", "mlx5_2"]


# ---------------------------------------------------------------- hostile sizes (one pass, caps)

def _chain(n: int, per_line: bool = False, leaf: str = "") -> str:
    """``<system><cpu>`` holding ``n`` nested ``<pci>`` (distinct bus ids), ``leaf`` in the innermost."""
    sep = "\n" if per_line else ""
    opens = sep.join(f'<pci busid="{i >> 16:04x}:{(i >> 8) & 0xff:02x}:{i & 0xff:02x}.0">' for i in range(n))
    return f'<system version="1"><cpu numaid="0">{sep}{opens}{leaf}{"</pci>" * n}</cpu></system>\n'


@pytest.mark.parametrize("per_line", [False, True], ids=["one-line", "line-per-element"])
def test_100k_nested_elements_stop_at_the_depth_cap_in_one_pass(per_line):
    text = _chain(100_000, per_line)
    assert len(text) > 3_000_000
    topo = analyse(nccl_xml.parse(text, "deep.xml"))
    deep = [w for w in topo.warnings if "nested deeper than 64" in w]
    assert len(deep) == 1 and deep[0].startswith("deep.xml: line ")
    assert len(topo.pci) == nccl_xml.MAX_DEPTH - 2  # <system> and <cpu> are two of the 64 levels
    if per_line:
        assert deep[0].startswith(f"deep.xml: line {nccl_xml.MAX_DEPTH}: ")  # the 65th level's line


def test_nesting_up_to_the_cap_is_read_whole_with_its_parent_chain():
    n = nccl_xml.MAX_DEPTH - 3  # system, cpu, n pci, gpu: exactly MAX_DEPTH levels
    text = _chain(n, leaf='<gpu dev="0"/>')
    topo = analyse(nccl_xml.parse(text, "ok.xml"))
    assert not any("deeper" in w or "cut off" in w for w in topo.warnings), topo.warnings
    (g,) = topo.gpus
    assert g.index == 0 and g.numa_node == 0
    hops, bus = 0, g.pci_bus_id
    while topo.pci[bus].parent is not None:
        bus, hops = topo.pci[bus].parent, hops + 1
    assert hops == n - 1 and topo.pci[bus].root == "cpu:0"
    text = _chain(n + 1, leaf='<gpu dev="0"/>')  # one level more: the gpu is the 65th
    assert any("nested deeper than 64" in w for w in nccl_xml.parse(text, "x").warnings)


def test_100k_sibling_elements_stop_at_the_element_cap():
    body = "".join(f'<pci busid="{i >> 16:04x}:{(i >> 8) & 0xff:02x}:{i & 0xff:02x}.0" class="0x030200"><gpu dev="{i}"/></pci>'
                   for i in range(100_000))
    topo = nccl_xml.parse(f'<system version="1"><cpu numaid="0">{body}</cpu></system>', "wide.xml")
    assert [w for w in topo.warnings if "elements" in w] == [
        f"wide.xml: line 1: more than {nccl_xml.MAX_ELEMENTS} elements (NCCL itself loads at most 256); "
        f"read the first {nccl_xml.MAX_ELEMENTS}"]
    assert len(topo.gpus) == (nccl_xml.MAX_ELEMENTS - 2) // 2  # each GPU is a <pci> and a <gpu>
    assert [g.index for g in topo.gpus[:3]] == [0, 1, 2]


def test_a_quoted_angle_bracket_does_not_end_a_tag_and_an_unclosed_quote_is_a_cut_off_tag():
    text = '<system version="1"><cpu numaid="0" note="a > b"><pci busid="0000:18:00.0" class="0x030200"><gpu dev="0"/></pci></cpu></system>'
    assert [g.pci_bus_id for g in nccl_xml.parse(text, "q.xml").gpus] == ["0000:18:00.0"]
    assert nccl_xml._xml_prefix('<system a="x><cpu>', 0) == (0, "open-tag")


# ---------------------------------------------------------------- dual-port NICs (issue 14)

#: one PCIe switch (two sub-switches) holding a GPU and a dual-port NIC whose two ports are two
#: RDMA devices: two <net> elements in one <nic>, as ncclTopoFillNet (NCCL src/graph/xml.cc)
#: writes them, one per network device, keyed by name
_DUAL = """<system version="1">
  <cpu numaid="0" affinity="ff" arch="x86_64" vendor="GenuineIntel">
    <pci busid="0000:10:00.0" class="0x060400" vendor="0x1000" device="0xc030">
      <pci busid="0000:11:00.0" class="0x060400" vendor="0x1000" device="0xc030">
        <pci busid="0000:12:00.0" class="0x030200" vendor="0x10de" device="0x2330"><gpu dev="0" sm="90"/></pci>
      </pci>
      <pci busid="0000:13:00.0" class="0x060400" vendor="0x1000" device="0xc030">
        <pci busid="0000:14:00.0" class="0x020000" vendor="0x15b3" device="0x1021">
          <nic>
            <net name="rdmaA" dev="0" speed="200000" port="1" guid="0x1"/>
            <net name="rdmaB" dev="1" speed="100000" port="2" guid="0x1"/>
          </nic>
        </pci>
      </pci>
    </pci>
  </cpu>
</system>
"""


def _dual_checks(topo):
    names = sorted(n.name for n in topo.nics)
    assert names == ["rdmaA", "rdmaB"]
    a, b = topo.nic("rdmaA"), topo.nic("rdmaB")
    assert a.pci_bus_id == b.pci_bus_id == "0000:14:00.0"
    assert [(p.port, p.rate_gbps) for p in a.ports] == [(1, 200.0)]
    assert [(p.port, p.rate_gbps) for p in b.ports] == [(2, 100.0)]
    assert (a.role, b.role) == ("compute", "compute")
    assert {a.rail, b.rail} == {0, 1}
    assert topo.gpus[0].nearest_nics == ["rdmaA", "rdmaB"]


def test_two_nets_in_one_nic_are_two_rdma_devices():
    _dual_checks(analyse(nccl_xml.parse(_DUAL, "dual")))


def test_two_nets_in_one_nic_survive_the_merge_of_parse_text():
    # parse_text/parse_file (and the CLI) merge what the importers read: the merge matched NICs
    # by bus id and folded the second port's device into the first
    from topology.importers import parse_text
    _dual_checks(analyse(parse_text(_DUAL, "dual")))


def test_corpus_dualport_file_through_parse_file():
    from topology.importers import parse_file
    topo = analyse(parse_file(corpus_file("nccl_topo/oci_bm_gpu_h100_8_dualport_cx7_roce_16nets_mlx5_18_33_topo.xml")))
    assert len(topo.nics) == 16 and len({n.rail for n in topo.nics}) == 16
    assert {n.name for n in topo.nics if n.pci_bus_id == "0000:0c:00.0"} == {"mlx5_18", "mlx5_19"}
