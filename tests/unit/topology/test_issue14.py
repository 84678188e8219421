"""Issue 14, item 6 (topology): dual-port NICs, role versus state, ibstat without indentation,
``column -t`` ibdev2netdev with notes, iWARP, matrices that cannot decide roles, and bad input
for every topology importer (bounded time and memory, never a traceback).

The inputs are written here from the producers' formats (rdma-core infiniband-diags/ibstat.c
``ca_dump``/``port_dump``; mlnx-tools ofed_scripts/ibdev2netdev; rdma-core
libibverbs/examples/devinfo.c; nvidia-smi's matrix layout), not copied from the corpus.
"""

from __future__ import annotations


import pytest

from topology.affinity import analyse, to_json
from topology.importers import _bounds, ibtools, nccl_xml, nvsmi, parse_text
from topology.model import merge

# ---------------------------------------------------------------- ibstat without indentation


def _ibstat(prefix_ca: str, prefix_port: str, node_type: str = "CA") -> str:
    out = []
    for dev, state, phys, ll in (("hcaA", "Active", "LinkUp", "InfiniBand"), ("hcaB", "Down", "Polling", "InfiniBand")):
        out += [f"{node_type} '{dev}'", f"{prefix_ca}{node_type} type: MT4129", f"{prefix_ca}Number of ports: 1",
                f"{prefix_ca}Firmware version: 28.1.1", f"{prefix_ca}Hardware version: 0",
                f"{prefix_ca}Node GUID: 0x0000000000000001", f"{prefix_ca}System image GUID: 0x0000000000000001",
                f"{prefix_ca}Port 1:", f"{prefix_port}State: {state}", f"{prefix_port}Physical state: {phys}",
                f"{prefix_port}Rate: 400", f"{prefix_port}Base lid: 7", f"{prefix_port}LMC: 0", f"{prefix_port}SM lid: 1",
                f"{prefix_port}Capability mask: 0x00010000", f"{prefix_port}Port GUID: 0x0000000000000002",
                f"{prefix_port}Link layer: {ll}"]
    return "\n".join(out) + "\n"


def _ports(topo):
    return {f"{n.name}/{p.port}": (p.state, p.phys_state, p.link_layer, p.rate_gbps) for n in topo.nics for p in n.ports}


def test_ibstat_without_indentation_reads_as_the_indented_output():
    tabbed = ibtools.parse(_ibstat("\t", "\t\t"), "tabbed")
    flat = ibtools.parse(_ibstat("", ""), "flat")
    assert tabbed.warnings == [] and flat.warnings == []
    assert _ports(flat) == _ports(tabbed) == {"hcaA/1": ("ACTIVE", "LinkUp", "InfiniBand", 400.0),
                                              "hcaB/1": ("POLLING", "Polling", "InfiniBand", 400.0)}


def test_flat_ibstat_block_still_ends_at_foreign_text():
    text = _ibstat("", "") + "Speed: fast\nCA type: MT1\n"
    topo = ibtools.parse(text, "s")
    assert [n.name for n in topo.nics] == ["hcaA", "hcaB"]
    assert len(_ports(topo)) == 2


def test_flat_ibv_devinfo_and_ibstatus():
    devinfo = ("hca_id: dev0\ntransport: InfiniBand (0)\nfw_ver: 1.0\nphys_port_cnt: 1\nport: 1\n"
               "state: PORT_INIT (2)\nmax_mtu: 4096 (5)\nlink_layer: InfiniBand\n")
    topo = ibtools.parse(devinfo, "d")
    assert topo.warnings == [] and _ports(topo) == {"dev0/1": ("INIT", None, "InfiniBand", None)}
    assert topo.nic("dev0").transport == "InfiniBand"
    status = ("Infiniband device 'dev1' port 1 status:\ndefault gid: fe80::1\nbase lid: 0x1\nsm lid: 0x1\n"
              "state: 1: DOWN\nphys state: 3: Disabled\nrate: 100 Gb/sec (4X EDR)\nlink_layer: InfiniBand\n")
    topo = ibtools.parse(status, "st")
    assert topo.warnings == [] and _ports(topo) == {"dev1/1": ("DISABLED", "Disabled", "InfiniBand", 100.0)}


# ---------------------------------------------------------------- ibdev2netdev


def test_ibdev2netdev_column_t_with_notes():
    text = ("devA  port  1  ==>  ibp1s0        (Down)  # rail 1, IPoIB not configured\n"
            "devB  port  1  ==>  enp2s0f0np0   (Up)    # front-end\n"
            "devC  port  1  ==>  enp2s0f1np1   (Down)\n"
            "devD  port  1  ==>  ibp3s0        (Up)    # rail 2\n")
    topo = ibtools.parse(text, "s")
    assert topo.warnings == []
    p = {k: v[0] for k, v in _ports(topo).items()}
    # IPoIB Down: the netdev's carrier, not the port: unknown; RoCE carrier: the port's link
    assert p == {"devA/1": "UNKNOWN", "devB/1": "ACTIVE", "devC/1": "DOWN", "devD/1": "ACTIVE"}
    assert [n.netdevs for n in topo.nics] == [["ibp1s0"], ["enp2s0f0np0"], ["enp2s0f1np1"], ["ibp3s0"]]
    assert topo.links["ibp1s0"] == {"carrier": False} and topo.links["enp2s0f0np0"] == {"carrier": True}
    roles = {n.name: n.role for n in analyse(topo).nics}
    assert roles == {"devA": "compute", "devB": "front-end", "devC": "front-end", "devD": "compute"}


def test_ibdev2netdev_text_after_the_fields_that_is_no_note_is_named():
    topo = ibtools.parse("devA port 1 ==> ib0 (Up) extra words\n", "s")
    assert len(topo.warnings) == 1 and "'extra words'" in topo.warnings[0] and topo.warnings[0].startswith("s: line 1: ")
    assert topo.nic("devA").ports[0].netdev == "ib0"


def test_ibdev2netdev_verbose_column_t_and_old_style():
    text = ("0000:17:00.0  devA  (MT4129  -  MT0000000001)  NIC  fw  28.1  port  1  (ACTIVE)  ==>  ibp23s0  (Down)"
            "  # note\n"
            "devB port 1 <===> ib1\n")
    topo = ibtools.parse(text, "s")
    assert topo.warnings == []
    a, b = topo.nic("devA"), topo.nic("devB")
    assert (a.pci_bus_id, a.ports[0].state, a.ports[0].netdev) == ("0000:17:00.0", "ACTIVE", "ibp23s0")
    assert (b.ports[0].state, b.ports[0].netdev) == ("UNKNOWN", "ib1")


# ---------------------------------------------------------------- role is not state

_MATRIX = ("\tGPU0\tGPU1\tNIC0\tNIC1\tCPU Affinity\tNUMA Affinity\n"
           "GPU0\t X \tNV18\t{a0}\t{b0}\t0-7\t0\n"
           "GPU1\tNV18\t X \t{a1}\t{b1}\t0-7\t0\n"
           "NIC0\t{a0}\t{a1}\t X \tSYS\n"
           "NIC1\t{b0}\t{b1}\tSYS\t X \n\n"
           "NIC Legend:\n\n  NIC0: hcaA\n  NIC1: hcaB\n")


def test_a_compute_nic_whose_port_is_down_stays_a_rail_without_gpu_information():
    topo = analyse(ibtools.parse(_ibstat("\t", "\t\t"), "s"))
    b = topo.nic("hcaB")
    assert b.role == "compute" and b.rail is not None and b.ports[0].state == "POLLING"
    assert "link fault" in b.role_reason


def test_a_compute_nic_whose_port_is_down_stays_a_rail_with_gpu_information():
    m = nvsmi.parse(_MATRIX.format(a0="PIX", a1="SYS", b0="SYS", b1="PIX"), "m")
    topo = analyse(merge([m, ibtools.parse(_ibstat("\t", "\t\t"), "s")]))
    assert {n.name: (n.role, n.rail) for n in topo.nics} == {"hcaA": ("compute", 0), "hcaB": ("compute", 1)}
    assert topo.nic("hcaB").ports[0].state == "POLLING"


def test_iwarp_device_is_no_rail_even_next_to_a_gpu():
    devinfo = ("hca_id:\tiwdev0\n\ttransport:\t\t\tiWARP (1)\n\tphys_port_cnt:\t\t\t1\n\t\tport:\t1\n"
               "\t\t\tstate:\t\t\tPORT_ACTIVE (4)\n\t\t\tlink_layer:\t\tEthernet\n")
    ib = ibtools.parse(devinfo, "d")
    assert ib.warnings == [] and ib.nic("iwdev0").transport == "iWARP"
    text = _MATRIX.format(a0="PIX", a1="SYS", b0="SYS", b1="PIX").replace("hcaB", "iwdev0")
    topo = analyse(merge([nvsmi.parse(text, "m"), ib]))
    iw = topo.nic("iwdev0")
    assert iw.role == "front-end" and iw.rail is None and "iWARP" in iw.role_reason
    assert topo.nic("hcaA").role == "compute"
    assert {n["name"]: n["transport"] for n in to_json(topo)["nics"]} == {"hcaA": None, "iwdev0": "iWARP"}


def test_ibstat_iwarp_rnic_node_type():
    text = _ibstat("\t", "\t\t", node_type="iWARP RNIC")
    topo = analyse(ibtools.parse(text, "s"))
    assert topo.warnings == []
    assert {n.name: (n.transport, n.role) for n in topo.nics} == {"hcaA": ("iWARP", "front-end"),
                                                                   "hcaB": ("iWARP", "front-end")}


def test_all_sys_matrix_leaves_roles_undecided_with_a_warning():
    text = _MATRIX.format(a0="SYS", a1="SYS", b0="SYS", b1="SYS")
    topo = analyse(nvsmi.parse(text, "m"))
    assert {n.role for n in topo.nics} == {"undecided"} and all(n.rail is None for n in topo.nics)
    assert [g.nearest_nics for g in topo.gpus] == [[], []]
    assert len(topo.warnings) == 1
    w = topo.warnings[0]
    assert w.startswith("m: no GPU has a NIC at PIX, PXB or PHB") and "hcaA, hcaB are left undecided" in w
    analyse(topo)   # analysing again does not repeat the warning
    assert len(topo.warnings) == 1


def test_all_sys_matrix_with_link_layers_decides_by_link_layer():
    text = _MATRIX.format(a0="SYS", a1="SYS", b0="SYS", b1="SYS")
    topo = analyse(merge([nvsmi.parse(text, "m"), ibtools.parse(_ibstat("\t", "\t\t"), "s")]))
    assert {n.name: n.role for n in topo.nics} == {"hcaA": "compute", "hcaB": "compute"}
    assert not [w for w in topo.warnings if "undecided" in w]


# ---------------------------------------------------------------- bad input, every importer

IMPORTERS = [nccl_xml, nvsmi, ibtools]
_GOOD = {nccl_xml: "<system version='1'><cpu numaid='0'><pci busid='0000:01:00.0' class='0x030200'><gpu dev='0'/>"
                   "</pci></cpu></system>\n",
         nvsmi: _MATRIX.format(a0="PIX", a1="SYS", b0="SYS", b1="PIX"),
         ibtools: _ibstat("\t", "\t\t")}


def _parse_bounded(mod, text: str):
    """Parse hostile input: it must end (pytest-timeout catches a hang, no wall-clock limit here),
    name its source in every warning and keep the warnings bounded."""
    topo = mod.parse(text, "src")
    assert topo.sources == ["src"]
    assert all(w.startswith("src: ") for w in topo.warnings), topo.warnings[:3]
    assert len(topo.warnings) <= _bounds.MAX_WARNINGS + 2
    return topo


@pytest.mark.parametrize("mod", IMPORTERS, ids=lambda m: m.__name__.rsplit(".", 1)[1])
@pytest.mark.parametrize("text", ["", "\n\n  \n", "\x00\x01\x02\xff\xfe\x89PNG\r\n\x1a\n" * 50],
                         ids=["empty", "blank", "binary"])
def test_empty_and_binary_input_warn(mod, text):
    topo = _parse_bounded(mod, text)
    assert topo.warnings and topo.nics == [] and topo.gpus == []


@pytest.mark.parametrize("mod", IMPORTERS, ids=lambda m: m.__name__.rsplit(".", 1)[1])
def test_truncated_good_input_keeps_what_was_read_and_warns(mod):
    good = _GOOD[mod]
    full = mod.parse(good, "src")
    cut = _parse_bounded(mod, good[: len(good) * 2 // 3])
    assert cut.warnings and len(cut.nics) + len(cut.gpus) <= len(full.nics) + len(full.gpus)


@pytest.mark.parametrize("mod", IMPORTERS, ids=lambda m: m.__name__.rsplit(".", 1)[1])
@pytest.mark.parametrize("line", ["a" * 10_000_000, "<" * 10_000_000, "GPU0 " * 2_000_000,
                                  "devA port 1 ==> ib0 (Up) # " + "n" * 10_000_000,
                                  "CA '" + "m" * 10_000_000 + "'"],
                         ids=["letters", "angles", "gpu-words", "ibdev2netdev-note", "ca-name"])
def test_one_ten_megabyte_line(mod, line):
    full = mod.parse(_GOOD[mod], "src")
    topo = _parse_bounded(mod, _GOOD[mod] + line + "\n" + _GOOD[mod])
    # what came before the line is read whole; the line itself makes no device of a 10-MB name
    names = [n.name for n in topo.nics]
    assert names[:len(full.nics)] == [n.name for n in full.nics]
    assert all(len(n) <= 64 for n in names) and all(len(d) <= 64 for n in topo.nics for d in n.netdevs)
    assert [g.key for g in topo.gpus] == [g.key for g in full.gpus]


def test_overlong_device_and_netdev_names_are_warned_not_taken():
    # IB_DEVICE_NAME_MAX (64, include/rdma/ib_verbs.h) and IFNAMSIZ (16 with its NUL, include/uapi/linux/if.h)
    topo = _parse_bounded(ibtools, "CA '" + "m" * 65 + "'\n" + "devA port 1 ==> " + "e" * 16 + " (Up)\n")
    assert topo.nics == [] and len(topo.warnings) >= 2
    assert "line 1: unreadable ibstat CA header" in topo.warnings[0]
    assert "line 2: unreadable ibdev2netdev line" in topo.warnings[1]


def test_ten_megabyte_ibdev2netdev_note_is_still_read():
    topo = _parse_bounded(ibtools, "devA port 1 ==> ib0 (Up) # " + "n" * 10_000_000 + "\n")
    assert topo.warnings == [] and topo.nic("devA").ports[0].netdev == "ib0"


@pytest.mark.parametrize("mod", IMPORTERS, ids=lambda m: m.__name__.rsplit(".", 1)[1])
def test_huge_input_is_cut_at_the_cap_with_a_warning(mod):
    text = _GOOD[mod] + ("filler line\n" * (_bounds.MAX_CHARS // 12 + 10))
    topo = _parse_bounded(mod, text)
    assert any("more than 16 Mi" in w and "were read" in w for w in topo.warnings)


@pytest.mark.parametrize("mod", IMPORTERS, ids=lambda m: m.__name__.rsplit(".", 1)[1])
def test_100k_nested_xml_levels(mod):
    text = "<system version='1'><cpu numaid='0'>" + "<pci busid='0000:00:00.0'>" * 100_000
    topo = _parse_bounded(mod, text)
    assert topo.warnings


@pytest.mark.parametrize("mod", IMPORTERS, ids=lambda m: m.__name__.rsplit(".", 1)[1])
def test_a_million_bad_lines_keep_a_bounded_number_of_warnings(mod):
    bad = {nccl_xml: "<system><cpu numaid='x'>" + "<pci busid='zz'/>" * 5000 + "</cpu></system>",
           nvsmi: "\tGPU0\tNIC0\n" + "GPU0\t X \tPIX\n" * 200_000,
           ibtools: "CA 'devA'\n\tNumber of ports: 1\n\tPort 1:\n" + "\t\tState: Sideways\n" * 200_000}[mod]
    topo = _parse_bounded(mod, bad)
    assert len(topo.warnings) >= _bounds.MAX_WARNINGS
    assert "more warning(s) not listed" in topo.warnings[-1]


def test_very_wide_matrix_header_is_bounded():
    n = 100_000
    text = "\t" + "\t".join(f"GPU{i}" for i in range(n)) + "\nGPU0\t" + "\t".join(["X"] * n) + "\n"
    topo = _parse_bounded(nvsmi, text)
    assert any(f"names {n} columns" in w for w in topo.warnings)
    assert len(topo.gpus) == nvsmi.MAX_COLUMNS


def test_long_glued_header_token_does_not_recurse():
    tok = "ab" * 20_000
    text = f"\tGPU0\t{tok}\nGPU0\t X \tPIX\nab\tPIX\t X \n"
    topo = _parse_bounded(nvsmi, text)
    assert topo.warnings
    # a short glued token still splits by the row names
    short = nvsmi.parse("\tGPU0\tnicAnicB\nGPU0\t X \tPIX\tSYS\nnicA\tPIX\t X \tSYS\nnicB\tSYS\tSYS\t X \n", "s")
    assert [n.name for n in short.nics] == ["nicA", "nicB"] and short.warnings == []


def test_parse_text_runs_every_importer_on_bad_input_without_a_traceback():
    for text in ("", "\x00" * 100, "<system>" + "<pci>" * 100_000, "ab" * 20_000 + "\nGPU0\n"):
        topo = parse_text(text, "src")
        assert topo.warnings and not [w for w in topo.warnings if "importer failed" in w]
