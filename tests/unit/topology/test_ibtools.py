"""topology.importers.ibtools: ibstat / ibstatus / ibv_devinfo / ibdev2netdev / rdma link /
ibv_devices outputs from the corpus (ports and roles after ``topology.affinity.analyse``), each
format's variants, and bad input (never an exception; warnings name the source and the line).

Shapes: ``parse(text, source) -> Topology``; a port is compared as
``{"state", "link_layer", "rate_gbps", "netdev"}`` keyed ``"<nic>/<port>"`` as in
tests/fixtures/corpus/expected.json.
"""

from __future__ import annotations

import random

import pytest
from conftest import FIXTURES, corpus_file
from hypothesis import given, settings
from hypothesis import strategies as st

from topology.affinity import analyse
from topology.importers import ibtools

IB_DIR = FIXTURES / "corpus" / "ib_tools"
CORPUS = sorted(p.name for p in IB_DIR.iterdir())
#: the one corpus file whose correct reading carries a warning (ibstat's ibpanic)
WARNS = {"gpud_azure_a100_ibstat_ibpanic_exit255.ibstat.txt"}


def _read(rel: str) -> str:
    return corpus_file(rel).read_text()


def _ports(topo) -> dict[str, dict]:
    """``{"mlx5_0/1": {"state", "link_layer", "rate_gbps", "netdev"}}`` for every port read."""
    return {f"{n.name}/{p.port}": {"state": p.state, "link_layer": p.link_layer, "rate_gbps": p.rate_gbps,
                                   "netdev": p.netdev}
            for n in topo.nics for p in n.ports}


def _no_internal_errors(topo, source: str) -> None:
    assert all(w.startswith(f"{source}: ") for w in topo.warnings), topo.warnings
    assert not [w for w in topo.warnings if "internal error" in w], topo.warnings


# ---------------------------------------------------------------- the corpus

def test_every_corpus_file_is_covered(expected):
    listed = {k.split("/", 1)[1] for k in expected if k.startswith("ib_tools/")}
    assert CORPUS and set(CORPUS) == listed


@pytest.mark.parametrize("name", CORPUS)
def test_corpus_file(name, expected):
    rel = f"ib_tools/{name}"
    exp = expected[rel]
    text = _read(rel)
    assert ibtools.looks_like(text)
    topo = analyse(ibtools.parse(text, rel))
    _no_internal_errors(topo, rel)
    if name not in WARNS:
        assert topo.warnings == []
    assert topo.sources == [rel]
    # (a) every expected port, exactly; and no port the file does not have
    got = _ports(topo)
    for key, want in exp["ports"].items():
        assert got.get(key) == want, key
    assert set(got) == set(exp["ports"])
    # (b) roles
    assert {n.name for n in topo.nics if n.role == "compute"} == set(exp["compute_nics"])
    assert set(exp["non_compute_nics"]) <= {n.name for n in topo.nics if n.role != "compute"}
    assert all(n.kind == "rdma" for n in topo.nics)


def test_corpus_nic_order_is_the_order_of_the_text():
    topo = ibtools.parse(_read("ib_tools/dgxh100_like_ibdev2netdev_8ib_3eth.txt"), "t")
    assert [n.name for n in topo.nics] == ["mlx5_0", "mlx5_1", "mlx5_10", "mlx5_2", "mlx5_3", "mlx5_4", "mlx5_5",
                                          "mlx5_6", "mlx5_7", "mlx5_8", "mlx5_9"]
    assert topo.nic("mlx5_7").netdevs == ["enp170s0np0"]


def test_corpus_ibpanic_keeps_what_was_read():
    rel = "ib_tools/gpud_azure_a100_ibstat_ibpanic_exit255.ibstat.txt"
    topo = analyse(ibtools.parse(_read(rel), rel))
    gone = topo.nic("mlx5_8")
    assert gone is not None and gone.vanished and gone.ports == [] and gone.role == "unused"
    assert [n.name for n in topo.nics if not n.vanished] == [f"mlx5_{i}" for i in range(8)]
    assert len(topo.warnings) == 1
    w = topo.warnings[0]
    assert w.startswith(f"{rel}: line 138: ") and "'mlx5_8'" in w


def test_corpus_mixed_file_takes_link_layer_and_netdev_from_different_tools():
    rel = "ib_tools/dgx_spark_gb10_cx7_ibdev2netdev_ibv_devinfo_2of4_down.txt"
    topo = ibtools.parse(_read(rel), rel)
    n = topo.nic("roceP2p1s0f1")
    assert n.netdevs == ["enP2p1s0f1np1"] and n.ports[0].link_layer == "Ethernet"
    # nothing from the netplan YAML in between became a NIC
    assert [x.name for x in topo.nics] == ["rocep1s0f0", "rocep1s0f1", "roceP2p1s0f0", "roceP2p1s0f1"]


# ---------------------------------------------------------------- looks_like

@pytest.mark.parametrize("rel", [f"{d}/{p.name}" for d in ("nccl_topo", "nvsmi_topo")
                                 for p in sorted((FIXTURES / "corpus" / d).iterdir())])
def test_looks_like_rejects_the_other_corpus_formats(rel):
    assert not ibtools.looks_like(corpus_file(rel).read_text(errors="replace"))


@pytest.mark.parametrize("text", [
    "CA 'mlx5_0'\n\tCA type: MT4129\n",
    "Infiniband device 'mlx5_0' port 1 status:\n",
    "hca_id:\tmlx5_0\n",
    "mlx5_0 port 1 ==> ib0 (Up)\n",
    "0000:17:00.0 mlx5_0 (MT4123 - MT0000000223) ConnectX-6 fw 20.28.1002 port 1 (ACTIVE) ==> ib0 (Up)\n",
    "link mlx5_0/1 state ACTIVE physical_state LINK_UP netdev ib0\n",
    "1/1: mlx5_0/1: state ACTIVE physical_state LINK_UP netdev ib0\n",
    "    device          \t   node GUID\n    ------          \t----------------\n",
    "ibpanic: [17] main: stat of IB device 'mlx5_0' failed: No such device\n",
])
def test_looks_like_each_format(text):
    assert ibtools.looks_like(text)


@pytest.mark.parametrize("text", [
    "", "   \n", "network:\n  version: 2\n  ethernets:\n    enp1s0f1np1:\n      mtu: 9000\n",
    "export NCCL_IB_HCA=mlx5_0,mlx5_3\n", "the link went down/up twice\n", "CA type: MT4129\n",
    "\x00\x01\x02\xff" * 20,
])
def test_looks_like_rejects_other_text(text):
    assert not ibtools.looks_like(text)


# ---------------------------------------------------------------- format variants

IBSTAT_PORT = ("\tPort {n}:\n\t\tState: {state}\n\t\tPhysical state: {phys}\n\t\tRate: {rate}\n\t\tBase lid: 0\n"
               "\t\tLMC: 0\n\t\tSM lid: 0\n\t\tCapability mask: 0x00010000\n\t\tPort GUID: 0x0c42a10300000001\n"
               "\t\tLink layer: {ll}\n")


def ibstat_ca(name: str, ports: list[tuple[str, str, str, str]]) -> str:
    """An ibstat CA block as ibstat.c prints it; ``ports`` = [(state, phys, rate, link layer)]."""
    head = (f"CA '{name}'\n\tCA type: MT4129\n\tNumber of ports: {len(ports)}\n\tFirmware version: 28.39.1002\n"
            "\tHardware version: 0\n\tNode GUID: 0x0c42a10300000001\n\tSystem image GUID: 0x0c42a10300000001\n")
    return head + "".join(IBSTAT_PORT.format(n=i, state=s, phys=p, rate=r, ll=ll)
                          for i, (s, p, r, ll) in enumerate(ports, start=1))


def test_ibstat_states_rates_and_two_ports():
    text = ibstat_ca("mlx4_0", [("Initializing", "LinkUp", "10 (FDR10)", "InfiniBand"),
                                ("Down", "Polling", "2.5", "InfiniBand")])
    text += ibstat_ca("mlx5_1", [("Down", "LinkUp", "100", "Ethernet")])
    text += ibstat_ca("mlx5_2", [("Armed", "LinkUp", "56", "InfiniBand")])
    topo = ibtools.parse(text, "s")
    assert topo.warnings == []
    p = _ports(topo)
    assert p["mlx4_0/1"] == {"state": "INIT", "link_layer": "InfiniBand", "rate_gbps": 10.0, "netdev": None}
    assert p["mlx4_0/2"]["state"] == "POLLING" and p["mlx4_0/2"]["rate_gbps"] == 2.5
    assert p["mlx5_1/1"]["state"] == "DOWN"        # Down with LinkUp stays DOWN
    assert p["mlx5_2/1"]["state"] == "ARMED"
    assert topo.nic("mlx4_0").ports[1].phys_state == "Polling"


def test_ibstat_single_port_form_and_indented_paste_and_crlf():
    alone = ("CA: 'mlx5_3'\nPort 1:\nState: Active\nPhysical state: LinkUp\nRate: 400\nBase lid: 7\nLMC: 0\n"
             "SM lid: 1\nCapability mask: 0xa751e848\nPort GUID: 0x0c42a10300000001\nLink layer: InfiniBand\n")
    topo = ibtools.parse(alone, "s")
    assert topo.warnings == [] and _ports(topo)["mlx5_3/1"]["rate_gbps"] == 400
    indented = "".join("    " + ln + "\n" for ln in ibstat_ca("mlx5_0", [("Active", "LinkUp", "200", "Ethernet")])
                       .splitlines())
    topo = ibtools.parse("$ ibstat\n" + indented + "$ exit\n", "s")
    assert topo.warnings == [] and _ports(topo)["mlx5_0/1"]["link_layer"] == "Ethernet"
    crlf = ibstat_ca("mlx5_0", [("Down", "Disabled", "40", "Ethernet")]).replace("\n", "\r\n")
    topo = ibtools.parse(crlf, "s")
    assert topo.warnings == [] and _ports(topo)["mlx5_0/1"]["state"] == "DISABLED"


def test_ibstatus_down_polling_and_sdr_rate():
    text = ("Infiniband device 'mlx4_0' port 2 status:\n\tdefault gid:\t fe80:0000:0000:0000:0002:c903:0000:0001\n"
            "\tbase lid:\t 0x0\n\tsm lid:\t\t 0x0\n\tstate:\t\t 1: DOWN\n\tphys state:\t 2: Polling\n"
            "\trate:\t\t 10 Gb/sec (4X)\n\tlink_layer:\t InfiniBand\n\n"
            "Infiniband device 'mlx4_0' port 1 status:\n\tdefault gid:\t fe80::1\n\tbase lid:\t 0x1\n\tsm lid:\t\t 0x1\n"
            "\tstate:\t\t 2: INIT\n\tphys state:\t 5: LinkUp\n\trate:\t\t 2.5 Gb/sec (1X SDR)\n\tlink_layer:\t InfiniBand\n")
    topo = ibtools.parse(text, "s")
    assert topo.warnings == []
    n = topo.nic("mlx4_0")
    assert [p.port for p in n.ports] == [1, 2]
    assert (n.ports[1].state, n.ports[1].rate_gbps) == ("POLLING", 10.0)
    assert (n.ports[0].state, n.ports[0].rate_gbps) == ("INIT", 2.5)


def test_ibv_devinfo_verbose_rate_and_phys_state():
    text = ("hca_id:\tmlx5_0\n\ttransport:\t\t\tInfiniBand (0)\n\tphys_port_cnt:\t\t\t2\n\tmax_qp:\t\t\t\t131072\n"
            "\tdevice_cap_flags:\t\t0x25e1361\n\t\t\t\t\tBAD_PKEY_CNTR\n"
            "\t\tport:\t1\n\t\t\tstate:\t\t\tPORT_ACTIVE (4)\n\t\t\tlink_layer:\t\tInfiniBand\n"
            "\t\t\tactive_width:\t\t4X (2)\n\t\t\tactive_speed:\t\t50.0 Gbps (64)\n\t\t\tphys_state:\t\tLINK_UP (5)\n"
            "\t\t\tGID[  0]:\t\tfe80:0000:0000:0000:0c42:a103:0000:0001\n"
            "\t\tport:\t2\n\t\t\tstate:\t\t\tPORT_DOWN (1)\n\t\t\tlink_layer:\t\tInfiniBand\n"
            "\t\t\tactive_width:\t\t4X (2)\n\t\t\tactive_speed:\t\t2.5 Gbps (1)\n\t\t\tphys_state:\t\tPOLLING (2)\n\n")
    topo = ibtools.parse(text, "s")
    assert topo.warnings == []
    p = _ports(topo)
    assert p["mlx5_0/1"] == {"state": "ACTIVE", "link_layer": "InfiniBand", "rate_gbps": 200.0, "netdev": None}
    assert p["mlx5_0/2"]["state"] == "POLLING" and p["mlx5_0/2"]["rate_gbps"] == 10.0


def test_ibdev2netdev_plain_and_verbose():
    text = ("mlx5_0 port 1 ==> ib0 (Up)\nmlx5_1 port 1 ==> ib1 (Down)\nmlx5_2 port 1 ==> enp1s0 (NA)\n"
            "0000:17:00.0 mlx5_3 (MT4123 - MT0000000223) ConnectX-6 VPI fw 20.28.1002 port 1 (DOWN  ) ==> ib3 (Down)\n")
    topo = ibtools.parse(text, "s")
    assert topo.warnings == []
    p = _ports(topo)
    assert p["mlx5_0/1"] == {"state": "ACTIVE", "link_layer": None, "rate_gbps": None, "netdev": "ib0"}
    # (Down) is the IPoIB netdev's carrier (ibdev2netdev's get_link_state), not the port's state
    assert p["mlx5_1/1"] == {"state": "UNKNOWN", "link_layer": None, "rate_gbps": None, "netdev": "ib1"}
    assert topo.links["ib1"] == {"carrier": False} and topo.links["ib0"] == {"carrier": True}
    assert p["mlx5_2/1"]["state"] == "UNKNOWN" and topo.nic("mlx5_2").netdevs == ["enp1s0"]
    assert "enp1s0" not in topo.links
    assert p["mlx5_3/1"]["state"] == "DOWN" and topo.nic("mlx5_3").pci_bus_id == "0000:17:00.0"


def test_rdma_link_old_and_new_formats():
    text = ("1/1: mlx5_0/1: state DOWN physical_state POLLING netdev ib0 \n"
            "link mlx5_1/1 subnet_prefix fe80:0000:0000:0000 lid 5 sm_lid 1 lmc 0 state ACTIVE physical_state LINK_UP "
            "netdev ib1\n    caps: <SM, CM>\n"
            "link rocep1s0f0/1 state DOWN physical_state DISABLED netdev enp1s0f0np0 netdev_index 4\n")
    topo = ibtools.parse(text, "s")
    assert topo.warnings == []
    p = _ports(topo)
    assert p["mlx5_0/1"]["state"] == "POLLING" and p["mlx5_0/1"]["netdev"] == "ib0"
    assert p["mlx5_1/1"]["state"] == "ACTIVE" and topo.nic("mlx5_1").ports[0].phys_state == "LinkUp"
    assert p["rocep1s0f0/1"]["state"] == "DISABLED"


def test_ibv_devices_only_registers_names():
    text = ("    device          \t   node GUID\n    ------          \t----------------\n"
            "    mlx5_0          \t0c42a10300000001\n    mlx5_1          \t0c42a10300000002\n\nuser@host:~$ \n")
    topo = ibtools.parse(text, "s")
    assert topo.warnings == []
    assert [(n.name, n.ports) for n in topo.nics] == [("mlx5_0", []), ("mlx5_1", [])]


@pytest.mark.parametrize("first", ["ibstat", "ibdev2netdev"])
def test_port_state_beats_netdev_carrier_in_either_order(first):
    ibstat = ibstat_ca("mlx5_0", [("Down", "Polling", "400", "InfiniBand")])
    i2n = "mlx5_0 port 1 ==> ib0 (Up)\n"
    text = ibstat + i2n if first == "ibstat" else i2n + ibstat
    topo = ibtools.parse(text, "s")
    assert _ports(topo)["mlx5_0/1"] == {"state": "POLLING", "link_layer": "InfiniBand", "rate_gbps": 400.0,
                                        "netdev": "ib0"}
    assert len(topo.warnings) == 1 and "mlx5_0 port 1" in topo.warnings[0]


# ---------------------------------------------------------------- bad input

@pytest.mark.parametrize("text", ["", " ", "\n\n\t\n"])
def test_empty_input(text):
    topo = ibtools.parse(text, "empty.txt")
    assert topo.nics == [] and topo.sources == ["empty.txt"]
    assert topo.warnings and all(w.startswith("empty.txt: ") for w in topo.warnings)


@pytest.mark.parametrize("text", [
    "lorem ipsum dolor sit amet\nconsectetur: adipiscing\n\telit: sed do\n",
    "network:\n  version: 2\n  ethernets:\n    enp1s0f1np1:\n      addresses: [192.0.2.11/24]\n",
    "State: Active\nPhysical state: LinkUp\nRate: 200\n",   # ibstat port lines with no CA
    "port: 1\n\tstate: PORT_ACTIVE (4)\n",
])
def test_only_garbage(text):
    topo = ibtools.parse(text, "junk.txt")
    assert topo.nics == []
    assert topo.warnings and all(w.startswith("junk.txt: ") for w in topo.warnings)


def _sample() -> str:
    return _read("ib_tools/gpud_h100_ib400_mixed_eth_some_down.ibstat.txt")


def _block_spans(text: str) -> list[tuple[int, int]]:
    """(offset just after ``CA '``, offset where the block's last value ends) of every CA
    block, found independently of the parser: a cut at k is mid-block when a <= k < b."""
    spans, pos = [], 0
    for line in text.splitlines(keepends=True):
        if line.startswith("CA '"):
            spans.append([pos + len("CA '"), None])
        elif line.strip().startswith("Link layer:"):
            spans[-1][1] = pos + len(line.rstrip("\n"))
        pos += len(line)
    return [tuple(s) for s in spans]


def _check_cut(full, text: str, k: int, spans) -> None:
    cut = text[:k]
    topo = ibtools.parse(cut, "cut.txt")
    _no_internal_errors(topo, "cut.txt")
    mid = any(a <= k < b for a, b in spans)
    if k >= spans[0][0]:
        # once the first CA header has begun: warnings exactly when a block is cut mid-way
        # (before it, the text holds nothing recognisable, which is itself warned)
        assert bool(topo.warnings) == mid, (k, cut[-40:], topo.warnings)
    # what was read is a prefix of the whole reading, and every value read is the true one
    names = [n.name for n in topo.nics]
    assert names == [n.name for n in full.nics][: len(names)]
    whole = _ports(full)
    for key, got in _ports(topo).items():
        for attr, v in got.items():
            if v is None or (attr == "state" and v == "UNKNOWN"):
                continue
            if attr == "state" and v == "DOWN" and whole[key][attr] in ("POLLING", "DISABLED"):
                continue   # cut before the Physical state line: DOWN is all that was printed
            assert v == whole[key][attr], (k, key, attr, v)


def test_every_truncation_at_line_boundaries():
    text = _sample()
    full = ibtools.parse(text, "full")
    spans = _block_spans(text)
    assert len(spans) == 12 and all(b is not None for _, b in spans)
    bounds = [i + 1 for i, c in enumerate(text) if c == "\n"] + [len(text)]
    for k in [0] + bounds:
        _check_cut(full, text, k, spans)


def test_every_truncation_at_any_offset():
    text = _sample()
    full = ibtools.parse(text, "full")
    spans = _block_spans(text)
    for k in range(len(text) + 1):
        _check_cut(full, text, k, spans)


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=0), st.sampled_from(["gpud_azure_a100_ibstat_ibpanic_exit255.ibstat.txt",
                                                  "gpud_a100_all_active.ibstat.txt"]))
def test_truncation_at_random_byte_offsets(k, name):
    """Cut the UTF-8 bytes anywhere (a non-ASCII comment makes some cuts split a character),
    decode as the caller would (errors="replace")."""
    data = ("# captured on höst «b» — ok\n" + _read(f"ib_tools/{name}")).encode()
    k %= len(data) + 1
    cut = data[:k].decode("utf-8", errors="replace")
    topo = ibtools.parse(cut, "cut.txt")
    _no_internal_errors(topo, "cut.txt")
    text = data.decode()
    spans = _block_spans(text)
    if any(a <= len(cut) < b for a, b in spans):
        assert topo.warnings


def test_ibpanic_file_cut_before_and_after_the_panic_line():
    text = _read("ib_tools/gpud_azure_a100_ibstat_ibpanic_exit255.ibstat.txt")
    at = text.index("ibpanic:")
    before = ibtools.parse(text[:at], "b")
    assert before.nic("mlx5_8") is None and before.warnings == []
    partial = ibtools.parse(text[: at + len("ibpanic: [1400444] main: stat of IB dev")], "p")
    assert partial.nic("mlx5_8") is None and partial.warnings   # no device named: a warning only


@pytest.mark.parametrize("data", [
    bytes(range(256)),
    random.Random(7).randbytes(4096),
    b"\x7fELF\x02\x01\x01\x00" + bytes(56) + b"CA 'mlx5_0'\x00\x00",
])
def test_binary_looking_text(data):
    for text in (data.decode("latin-1"), data.decode("utf-8", errors="replace")):
        topo = ibtools.parse(text, "bin")
        _no_internal_errors(topo, "bin")
        assert topo.warnings and topo.nics == []


def test_binary_noise_around_good_output_keeps_the_output():
    good = ibstat_ca("mlx5_0", [("Active", "LinkUp", "400", "InfiniBand")])
    topo = ibtools.parse("\x00\x01garbage\ufffd\n" + good + "\x00\x00\n", "bin")
    assert _ports(topo)["mlx5_0/1"]["state"] == "ACTIVE"
    assert any("binary" in w for w in topo.warnings)


def test_duplicated_ca_block_is_merged_with_warnings():
    text = (ibstat_ca("mlx5_0", [("Active", "LinkUp", "400", "InfiniBand")])
            + ibstat_ca("mlx5_1", [("Active", "LinkUp", "400", "InfiniBand")])
            + ibstat_ca("mlx5_0", [("Down", "Polling", "400", "InfiniBand")]))
    topo = ibtools.parse(text, "dup.txt")
    assert [n.name for n in topo.nics] == ["mlx5_0", "mlx5_1"]
    assert len(topo.nic("mlx5_0").ports) == 1
    assert _ports(topo)["mlx5_0/1"]["state"] == "ACTIVE"          # the first reading wins
    dup = [w for w in topo.warnings if "appears again" in w]
    assert dup == ["dup.txt: line 35: CA 'mlx5_0' appears again (first at line 1); the two are merged"]
    assert any("keeping ACTIVE" in w for w in topo.warnings)
    same = ibtools.parse(ibstat_ca("mlx5_0", [("Active", "LinkUp", "400", "InfiniBand")]) * 2, "dup.txt")
    assert len(same.warnings) == 1 and "appears again" in same.warnings[0]


def test_duplicated_ibv_devinfo_block_fills_in_what_the_first_lacked():
    a = "hca_id:\tmlx5_0\n\tphys_port_cnt:\t\t\t1\n\t\tport:\t1\n\t\t\tstate:\t\t\tPORT_ACTIVE (4)\n\t\t\tlink_layer:\t\tEthernet\n"
    topo = ibtools.parse(a + "\n" + a.replace("Ethernet", "InfiniBand"), "d")
    assert _ports(topo)["mlx5_0/1"]["link_layer"] == "Ethernet"
    assert any("appears again" in w for w in topo.warnings) and any("keeping Ethernet" in w for w in topo.warnings)


def test_ibpanic_line_marks_the_device_vanished():
    text = (ibstat_ca("mlx5_0", [("Active", "LinkUp", "200", "InfiniBand")])
            + "ibpanic: [99] main: stat of IB device 'mlx5_1' failed: No such file or directory\n")
    topo = analyse(ibtools.parse(text, "panic.txt"))
    assert [(n.name, n.vanished, n.role) for n in topo.nics] == [("mlx5_0", False, "compute"),
                                                                   ("mlx5_1", True, "unused")]
    assert _ports(topo)["mlx5_0/1"]["state"] == "ACTIVE"
    assert len(topo.warnings) == 1
    assert topo.warnings[0].startswith("panic.txt: line 18: ") and "'mlx5_1'" in topo.warnings[0]


@pytest.mark.parametrize("line,what", [
    ("\t\tState: Activ", "ibstat State"),
    ("\t\tRate: fast", "ibstat Rate"),
    ("\t\tLink layer: Infini", "ibstat Link layer"),
    ("\t\tPhysical state: Linkup?!", None),
])
def test_unreadable_values_are_warned_with_their_line(line, what):
    good = ibstat_ca("mlx5_0", [("Active", "LinkUp", "200", "InfiniBand")]).splitlines()
    key = line.strip().split(":")[0]
    i = next(j for j, ln in enumerate(good) if ln.strip().startswith(key + ":"))
    good[i] = line
    topo = ibtools.parse("\n".join(good) + "\n", "v")
    if what is None:   # punctuation is not part of a physical state's name: still LinkUp
        assert topo.warnings == []
        return
    assert any(w.startswith(f"v: line {i + 1}: unreadable {what}") for w in topo.warnings), topo.warnings


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=400))
def test_arbitrary_text_never_raises(text):
    topo = ibtools.parse(text, "h")
    _no_internal_errors(topo, "h")
    ibtools.looks_like(text)


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=0), st.text(max_size=40))
def test_noise_spliced_into_a_sample_never_raises(at, noise):
    text = _read("ib_tools/dgx_spark_gb10_cx7_ibdev2netdev_ibv_devinfo_2of4_down.txt")
    at %= len(text) + 1
    topo = ibtools.parse(text[:at] + noise + text[at:], "h")
    _no_internal_errors(topo, "h")
