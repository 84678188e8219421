"""NCCL topology XML (``NCCL_TOPO_FILE`` / ``NCCL_TOPO_DUMP_FILE``) -> :class:`topology.model.Topology`.

Pure: text in, topology out, no I/O; stdlib only (``xml.etree`` pull parser).

The format: ``<system>`` holds one ``<cpu numaid=.. affinity=..>`` per NUMA node; under it
``<pci busid class vendor device link_speed link_width>`` elements nest (a ``<pci>`` holding other
``<pci>`` elements is a PCIe switch, upstream and downstream port in one element); a GPU's
``<pci>`` holds ``<gpu dev=..>`` (with ``<nvlink>`` children), a NIC's holds
``<nic><net name=mlx5_0 dev port guid speed gdr/></nic>``.  A ``<nic>`` holding several
``<net>`` elements with different names (a dual-port NIC: ``mlx5_18`` port 1 and ``mlx5_19``
port 2, one guid) gives one RDMA device per name, each a rail of its own where it serves a GPU,
whatever NCCL_IB_MERGE_NICS would fuse at run time (NCCL src/graph/xml.cc ``ncclTopoFillNet``
keys each ``<net>`` by its device name).  Cloud files (Azure, AWS) often give
only PCI classes and bus ids: class ``0x0302xx``/``0x0300xx`` is a GPU, ``0x0207xx`` an InfiniBand
HCA, ``0x0200xx`` an Ethernet function (vendor ``0x1d0f``: an AWS EFA).  A ``<nic>`` directly
under ``<cpu>`` (no PCI parent, e.g. Azure NCv4's ``eth0``) is a NIC with no bus id.

Robustness: only the first ``<system>`` block is read, up to its ``</system>`` or to the first
text that is not markup (a paste that goes on with other output); a cut-off block is read up to
where it stops, and so is one whose elements nest deeper than :data:`MAX_DEPTH` (64) or that
holds more than :data:`MAX_ELEMENTS` (4096) elements, with a warning.  The text is scanned once
and nothing recurses per level, so time is linear in the input (bounded by those caps).  A ``<pci>`` leaf with no class and no ``<gpu>``/``<nic>`` goes to
``Topology.unclassified`` with a warning.  Warnings read ``"<source>: line N: <what>"``; bad input
never raises.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field

from topology.importers._bounds import WarningCap, cap_text
from topology.model import Gpu, PciNode, Topology, norm_bus_id

_RDMA_NAME = re.compile(r"^(?:mlx\d_|rocep|roceo|irdma|bnxt_re|efa_|hfi1_|qedr|erdma|ionic_|ibp|rxe|siw)")
_NETDEV_NAME = re.compile(r"^(?:eth\d|en[a-z]|em\d|eno|bond\d|ib\d|lo$)")
#: VGA-class devices that are never compute GPUs (BMC graphics)
_NOT_GPU_VENDORS = {"0x1a03", "0x102b"}
_EFA_VENDOR = "0x1d0f"
_MELLANOX = "0x15b3"

#: The deepest element nesting read, ``<system>`` counted as 1.  NCCL's own dumps nest
#: system > cpu > pci (one level per PCIe switch port, rarely more than 4) > gpu/nic > nvlink/net:
#: under 10 on DGX/HGX and cloud files, and a PCIe hierarchy cannot be deeper than its 256 bus
#: numbers anyway.  Past this depth the file is not a topology dump; it is read up to there.
MAX_DEPTH = 64
#: The most elements read.  NCCL itself loads at most 256 (``NCCL_TOPO_XML_MAX_NODES``,
#: src/graph/topo.h; some sites patch it to 2048), so a bigger file is no NCCL topology; the cap
#: also bounds the work per NIC/GPU lookups below.
MAX_ELEMENTS = 4096
#: Characters fed to the XML parser at a time (so a huge one-line file stops soon after MAX_DEPTH).
_FEED_CHARS = 64 * 1024


def looks_like(text: str) -> bool:
    """True when ``text`` holds an NCCL topology ``<system>`` with ``<cpu>`` or ``<pci>`` elements."""
    if not isinstance(text, str):
        return False
    return re.search(r"<system\b", text) is not None and re.search(r"<(?:cpu|pci)\b", text) is not None


#: the inside of a tag after its '<': anything but quotes and angle brackets, or quoted strings
#: (which may hold '<' and '>'); unambiguous, so matching is linear
_TAG_BODY = re.compile(r"""[^"'<>]*(?:(?:"[^"]*"|'[^']*')[^"'<>]*)*""")
_SPACE = re.compile(r"\s*")


def _xml_prefix(text: str, start: int) -> tuple[int, str]:
    """End offset of the markup that starts at ``start`` and why it ends there:
    ``"closed"`` (after ``</system>``), ``"text"`` (non-markup text follows), ``"eof"``
    (the text ends inside the block), ``"open-tag"`` (it ends inside a tag or comment),
    ``"deep"`` (the tag at the offset would open element :data:`MAX_DEPTH` + 1 levels down) or
    ``"many"`` (it would be element :data:`MAX_ELEMENTS` + 1).  One pass, no recursion."""
    i, n = start, len(text)
    depth = elements = 0
    while True:
        i = _SPACE.match(text, i).end()
        if i >= n:
            return i, "eof"
        if text[i] != "<":
            return i, "text"
        if text.startswith("<!--", i):
            j = text.find("-->", i + 4)
            if j < 0:
                return i, "open-tag"
            i = j + 3
            continue
        # a tag: find its '>' outside quotes
        j = _TAG_BODY.match(text, i + 1).end()
        if j >= n or text[j] != ">":
            return i, "open-tag"
        if text[i + 1] == "/":
            depth -= 1
            i = j + 1
            if depth <= 0:
                return i, "closed"
            continue
        if text[i + 1] not in "?!":
            if elements >= MAX_ELEMENTS:
                return i, "many"
            elements += 1
            if text[j - 1] != "/":
                if depth >= MAX_DEPTH:
                    return i, "deep"
                depth += 1
        i = j + 1


@dataclass
class _Pci:
    bus: str
    attrs: dict
    line: int
    parent: str | None
    cpu: _Cpu | None
    children: int = 0
    gpus: list[dict] = field(default_factory=list)
    nets: list[dict] = field(default_factory=list)
    has_nic: bool = False


@dataclass
class _Cpu:
    numa: int | None
    root: str


def parse(text: str, source: str = "nccl-topo.xml") -> Topology:
    """Read the first ``<system>`` block of ``text``; see the module docstring."""
    topo = Topology(sources=[source])
    cap = WarningCap(topo.warnings, source)

    def warn(line: int | None, what: str) -> None:
        cap.add(f"{source}: {'line ' + str(line) if line else 'xml'}: {what}")

    if not isinstance(text, str):
        warn(None, f"expected text, got {type(text).__name__}")
        return topo
    text, too_big = cap_text(text, source)
    if too_big:
        topo.warnings.append(too_big)
    try:
        return _parse(text, source, topo, warn)
    finally:
        cap.close()


def _parse(text: str, source: str, topo: Topology, warn) -> Topology:
    m = re.search(r"<system\b", text)
    if m is None:
        warn(None, "no NCCL topology <system> element found")
        return topo
    start = m.start()
    base_line = text.count("\n", 0, start) + 1
    end, why = _xml_prefix(text, start)
    block = text[start:end]
    end_line = text.count("\n", 0, end) + 1

    parser = ET.XMLPullParser(events=("start", "end"))
    # (tag, _Pci | _Cpu | dict | None, nearest enclosing _Pci, nearest enclosing _Cpu): the
    # nearest ones ride along so that finding them is O(1), not a walk down the stack
    stack: list[tuple[str, object, _Pci | None, _Cpu | None]] = []
    pcis: list[_Pci] = []
    by_bus: dict[str, _Pci] = {}
    loose_nics: list[tuple[dict, _Cpu | None, int]] = []
    loose_gpus: list[tuple[dict, _Cpu | None, int]] = []
    cpu_count = 0
    elements = 0
    failed = False

    def current(kind):
        if not stack:
            return None
        return stack[-1][2] if kind is _Pci else stack[-1][3]

    def push(tag: str, obj: object) -> None:
        pci, cpu = (stack[-1][2], stack[-1][3]) if stack else (None, None)
        stack.append((tag, obj, obj if isinstance(obj, _Pci) else pci, obj if isinstance(obj, _Cpu) else cpu))

    def on_start(elem: ET.Element, line: int) -> None:
        nonlocal cpu_count
        tag, a = elem.tag, dict(elem.attrib)
        if tag == "cpu":
            numa = _int(a.get("numaid"))
            if a.get("numaid") is not None and numa is None:
                warn(line, f"<cpu> numaid {a.get('numaid')!r} is not a number")
            if numa is not None and numa < 0:
                numa = None
            root = f"cpu:{numa}" if numa is not None else f"cpu#{cpu_count}"
            cpu_count += 1
            push(tag, _Cpu(numa, root))
            return
        if tag == "pci":
            parent = current(_Pci)
            cpu = current(_Cpu)
            raw = (a.get("busid") or "").strip()
            bus = norm_bus_id(raw) if raw else None
            if not raw:
                warn(line, "<pci> without busid; its children are placed under its parent")
                push(tag, None)
                return
            if bus is None:
                warn(line, f"<pci> busid {raw!r} is not a PCI bus id; kept as written")
                bus = raw.lower()
            if bus in by_bus:
                warn(line, f"<pci> busid {bus} appears twice; the first (line {by_bus[bus].line}) is kept")
                push(tag, None)
                return
            if parent is not None:
                parent.children += 1
            node = _Pci(bus, a, line, parent.bus if parent else None, cpu)
            by_bus[bus] = node
            pcis.append(node)
            push(tag, node)
            return
        if tag == "gpu":
            pci = stack[-1][1] if stack and isinstance(stack[-1][1], _Pci) else None
            if pci is not None:
                pci.gpus.append(a)
            else:
                loose_gpus.append((a, current(_Cpu), line))
        elif tag == "nic":
            pci = stack[-1][1] if stack and isinstance(stack[-1][1], _Pci) else None
            if pci is not None:
                pci.has_nic = True
                push(tag, pci)
                return
            nic: dict = {"nets": [], "line": line}
            loose_nics.append((nic, current(_Cpu), line))
            push(tag, nic)
            return
        elif tag == "net":
            owner = stack[-1][1] if stack and stack[-1][0] == "nic" else None
            if isinstance(owner, _Pci):
                owner.nets.append(a)
            elif isinstance(owner, dict):
                owner["nets"].append(a)
            else:
                warn(line, f"<net name={a.get('name')!r}> outside a <nic>; ignored")
        push(tag, None)

    lines = block.splitlines(keepends=True)
    for k, line in enumerate(lines):
        line_no = base_line + k
        try:
            for at in range(0, len(line), _FEED_CHARS):
                parser.feed(line[at:at + _FEED_CHARS])
                for ev, elem in parser.read_events():
                    if ev != "start":
                        if stack:
                            stack.pop()
                        continue
                    if len(stack) >= MAX_DEPTH:  # _xml_prefix stops before both caps already: guards
                        warn(line_no, f"elements nested deeper than {MAX_DEPTH} (an NCCL topology is under 10 deep); "
                                      "read what came before it")
                        failed = True
                        break
                    if elements >= MAX_ELEMENTS:
                        warn(line_no, f"more than {MAX_ELEMENTS} elements (NCCL itself loads at most 256); "
                                      f"read the first {MAX_ELEMENTS}")
                        failed = True
                        break
                    elements += 1
                    on_start(elem, line_no)
                if failed:
                    break
        except ET.ParseError as e:
            pos = getattr(e, "position", None)
            at = base_line + pos[0] - 1 if pos else line_no
            warn(at, f"XML error ({_reason(e)}); read what came before it")
            failed = True
        if failed:
            break
    if not failed and why == "deep":
        warn(end_line, f"elements nested deeper than {MAX_DEPTH} (an NCCL topology is under 10 deep); "
                       "read what came before it")
    elif not failed and why == "many":
        warn(end_line, f"more than {MAX_ELEMENTS} elements (NCCL itself loads at most 256); "
                       f"read the first {MAX_ELEMENTS}")
    elif not failed and block.strip() == "":
        warn(base_line, "the <system> tag itself is cut off; nothing to read")
    elif not failed and stack:
        open_tags = "/".join(t for t, *_ in stack)
        if why == "text":
            snippet = text[end:end + 40].splitlines()[0] if text[end:end + 40].strip() else ""
            warn(end_line, f"the topology is cut off here ({snippet!r} follows); "
                           f"read what came before it, {len(stack)} element(s) left open ({open_tags})")
        else:
            warn(end_line, f"the topology is cut off (ends inside {open_tags}); read what came before it")
    after = max(end, start + 1)
    more = re.search(r"<system\b", text[after:])
    if more:
        warn(text.count("\n", 0, after + more.start()) + 1,
             "another <system> block follows (a second dump); only the first one is read")

    _build(topo, pcis, loose_nics, loose_gpus, warn)
    return topo


def _reason(e: ET.ParseError) -> str:
    msg = str(e)
    return msg.split(":", 1)[0] if msg else "not well-formed"


def _int(v: str | None) -> int | None:
    if v is None:
        return None
    try:
        return int(str(v).strip(), 0)
    except ValueError:
        return None


def _speed_gbps(v: str | None) -> float | None:
    n = _int(v)
    return n / 1000.0 if n and n > 0 else None


def _net_kind(name: str, pci_class: str | None, vendor: str | None) -> str | None:
    if vendor == _EFA_VENDOR:
        return "efa"
    if _RDMA_NAME.match(name) or (pci_class or "").startswith("0x0207"):
        return "rdma"
    if _NETDEV_NAME.match(name):
        return "ethernet"
    return None


def _build(topo: Topology, pcis: list[_Pci], loose_nics, loose_gpus, warn) -> None:
    unclassified: list[tuple[str, int]] = []
    for p in pcis:
        a = p.attrs
        cls = (a.get("class") or "").strip().lower() or None
        vendor = (a.get("vendor") or "").strip().lower() or None
        device = (a.get("device") or "").strip().lower() or None
        numa = p.cpu.numa if p.cpu else None
        topo.pci[p.bus] = PciNode(p.bus, p.parent, cls, numa, vendor, device,
                                  root=p.cpu.root if p.cpu else None, weight=2 if p.children else 1)
        if p.gpus or (cls and cls.startswith(("0x0302", "0x0300", "0x0380"))
                      and vendor not in _NOT_GPU_VENDORS and not p.children):
            if p.children:
                warn(p.line, f"GPU {p.bus} holds other <pci> elements")
            g = p.gpus[0] if p.gpus else {}
            if len(p.gpus) > 1:
                warn(p.line, f"{p.bus} holds {len(p.gpus)} <gpu> elements; the first is used")
            idx = _int(g.get("dev"))
            if g and g.get("dev") is not None and idx is None:
                warn(p.line, f"<gpu dev={g.get('dev')!r}> is not a number")
            if idx is not None and any(x.index == idx for x in topo.gpus):
                warn(p.line, f"GPU index {idx} is given twice; {p.bus} keeps no index")
                idx = None
            topo.gpus.append(Gpu(index=idx, pci_bus_id=p.bus if norm_bus_id(p.bus) else None, numa_node=numa))
            continue
        if p.nets or p.has_nic or (cls and cls.startswith("0x02") and not p.children):
            bus = p.bus if norm_bus_id(p.bus) else None
            names = []
            for net in p.nets:
                nm = (net.get("name") or "").strip()
                if not nm:
                    warn(p.line, f"<net> under {p.bus} has no name")
                    continue
                if nm not in names:
                    names.append(nm)
            if not names:
                names = [p.bus]
            for nm in names:
                if topo.nic(nm) is not None and topo.nic(nm).pci_bus_id != bus:
                    warn(p.line, f"NIC {nm} appears twice (at {topo.nic(nm).pci_bus_id} and {p.bus}); the first is kept")
                    continue
                kind = _net_kind(nm, cls, vendor)
                if kind is None and vendor == _MELLANOX:
                    kind = "rdma"
                nic = topo.add_nic(nm, pci_bus_id=bus, numa_node=numa, kind=kind)
                for net in p.nets:
                    if (net.get("name") or "").strip() != nm:
                        continue
                    port = _int(net.get("port"))
                    if port is not None and port >= 1:
                        nic.port(port).rate_gbps = nic.port(port).rate_gbps or _speed_gbps(net.get("speed"))
            continue
        if cls is None and not p.children:
            unclassified.append((p.bus, p.line))
    for nic, cpu, line in loose_nics:
        numa = cpu.numa if cpu else None
        names = [(n.get("name") or "").strip() for n in nic["nets"]]
        names = [n for n in dict.fromkeys(names) if n]
        if not names:
            warn(line, "<nic> with no PCI parent and no named <net>; ignored")
            continue
        for nm in names:
            kind = _net_kind(nm, None, None)
            n = topo.add_nic(nm, numa_node=numa, kind=kind)
            if kind == "ethernet" and nm not in n.netdevs:
                n.netdevs.append(nm)
    for g, cpu, line in loose_gpus:
        idx = _int(g.get("dev"))
        if g.get("dev") is not None and idx is None:
            warn(line, f"<gpu dev={g.get('dev')!r}> is not a number")
        if idx is not None and any(x.index == idx for x in topo.gpus):
            warn(line, f"GPU index {idx} is given twice")
            continue
        topo.gpus.append(Gpu(index=idx, numa_node=cpu.numa if cpu else None))
    if unclassified:
        topo.unclassified += [b for b, _ in unclassified if b not in topo.unclassified]
        shown = ", ".join(b for b, _ in unclassified[:4]) + (", ..." if len(unclassified) > 4 else "")
        warn(unclassified[0][1], f"{len(unclassified)} PCI device(s) with no class and no <gpu>/<nic> "
                                 f"element, so of unknown kind: {shown}")
