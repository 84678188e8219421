"""``nvidia-smi topo -m`` / ``topo -mp`` matrices -> :class:`topology.model.Topology`.

Pure: text in, topology out, no I/O.  What it understands:

* a header row ``GPU0 .. GPUn NIC0 .. NICm`` (or RDMA names such as ``mlx5_0`` directly),
  followed by ``CPU Affinity``, ``NUMA Affinity`` and, on newer drivers, ``GPU NUMA ID``;
* tab-separated and space-aligned layouts, anything before the header (a shell prompt, a
  comment) and after the matrix (the legends);
* cells that run together with a long row name (``mlx5_bond_0PIX``), and a header whose
  long names run together (``mlx5_bond_0mlx5_bond_1``), resolved against the row names;
* an empty field before the GPU NUMA ID value; ``X`` on the diagonal; ``NV#`` between GPUs;
  the pre-2019 name ``SOC`` for ``SYS``;
* the ``NIC Legend:`` section (``NIC0: mlx5_0``), which names the NICs.

It fills ``gpus`` (index, ``numa_node`` from NUMA Affinity when that is a single number),
``nics`` (named by the legend) and ``paths[(str(gpu index), nic name)]``.  Anything it
cannot read becomes a warning ``"<source>: line N: <what>"``; it never raises on bad input.
"""

from __future__ import annotations

import re

from topology.importers._bounds import WarningCap, cap_text
from topology.model import PATH_TYPES, Gpu, Topology

#: The most columns read from a header.  nvidia-smi prints one column per GPU and per NIC
#: (NVML's device count, at most 64 GPUs on any system it supports, plus the NICs beside them:
#: tens); a header far wider than this is not a topology matrix, and reading it whole would cost
#: time in proportion to its square (every row against every column).
MAX_COLUMNS = 512
#: The longest header token split into row names (``mlx5_bond_0mlx5_bond_1``): a few names run
#: together, never kilobytes.
_MAX_GLUED = 1024

_GPU = re.compile(r"^GPU(\d+)$")
_NIC = re.compile(r"^NIC(\d+)$")
#: what a matrix cell can say
_CELL = re.compile(r"^(?:X|PIX|PXB|PHB|NODE|SYS|SOC|NV\d+)$")
#: a row name that ran into its first cell: ``mlx5_bond_0PIX``, ``GPU10NV12``
_GLUED = re.compile(r"^(.+?)(X|PIX|PXB|PHB|NODE|SYS|SOC|NV\d+)$")
_TAIL = re.compile(r"CPU Affinity|NUMA Affinity|GPU NUMA ID")
_HEADER = re.compile(r"^[ \t]*GPU\d+(?:[ \t]|$)")
_LEGEND = re.compile(r"^\s*(NIC\d+)\s*:\s*(\S+)\s*$")
_RDMA_NAME = re.compile(r"^(?:mlx\d_|rocep|roceo|irdma|bnxt_re|efa_|hfi1_|qedr|erdma|ionic_|ibp|rxe)")


def looks_like(text: str) -> bool:
    """True when ``text`` holds an ``nvidia-smi topo -m`` matrix (a GPU header row and a
    GPU row starting with a matrix cell)."""
    if not isinstance(text, str):
        return False
    has_header = any(_header_cut(line) is not None for line in text.splitlines())
    has_row = re.search(r"(?m)^GPU\d+\s*(?:X|NV\d+|PIX|PXB|PHB|NODE|SYS|SOC)\b", text) is not None
    return has_header and has_row


def _header_cut(line: str) -> tuple[list[str], list[str]] | None:
    """(device column names, affinity column names) when ``line`` is a matrix header."""
    if not _HEADER.match(line):
        return None
    m = _TAIL.search(line)
    head, tail = (line[:m.start()], line[m.start():]) if m else (line, "")
    devices = head.split()
    # a header holds names only: a GPU row ("GPU0  X  NV8") is not one
    if any(_CELL.match(d) for d in devices):
        return None
    tails = [t for t in re.split(r"\t|\s{2,}", tail.strip()) if t]
    return devices, tails


def _split_label(tok: str, known: set[str]) -> tuple[str, str | None]:
    """Row name and, when the two ran together, the first cell."""
    if tok in known:
        return tok, None
    m = _GLUED.match(tok)
    if m:
        return m.group(1), m.group(2)
    return tok, None


def _decompose(token: str, labels: list[str]) -> list[str] | None:
    """Split a header token that is several names run together, using the row names; the
    longest name first at each place.  No recursion: a table over the token's positions, so
    the work is len(token) x len(labels) at most (and the token is capped at :data:`_MAX_GLUED`)."""
    if token == "" or len(token) > _MAX_GLUED:
        return [] if token == "" else None
    labs = sorted({lab for lab in labels if lab}, key=len, reverse=True)
    n = len(token)
    # nxt[i]: the name to take at position i so that the rest also splits (None: no split)
    nxt: list[str | None] = [None] * (n + 1)
    ok = [False] * (n + 1)
    ok[n] = True
    for i in range(n - 1, -1, -1):
        for lab in labs:
            j = i + len(lab)
            if j <= n and ok[j] and token.startswith(lab, i):
                nxt[i], ok[i] = lab, True
                break
    if not ok[0]:
        return None
    out, i = [], 0
    while i < n:
        out.append(nxt[i])
        i += len(nxt[i])
    return out


def parse(text: str, source: str = "nvidia-smi topo") -> Topology:
    """Read the first matrix in ``text``; see the module docstring."""
    topo = Topology(sources=[source])
    cap = WarningCap(topo.warnings, source)

    def warn(line_no: int | None, what: str) -> None:
        where = f"line {line_no}" if line_no is not None else "matrix"
        cap.add(f"{source}: {where}: {what}")

    if not isinstance(text, str):
        warn(None, f"expected text, got {type(text).__name__}")
        return topo
    text, too_big = cap_text(text, source)
    if too_big:
        topo.warnings.append(too_big)
    try:
        return _parse(text, topo, warn)
    finally:
        cap.close()


def _parse(text: str, topo: Topology, warn) -> Topology:
    lines = text.splitlines()

    # ---- header
    h_idx = None
    devices: list[str] = []
    tails: list[str] = []
    for i, line in enumerate(lines):
        cut = _header_cut(line)
        if cut is not None:
            h_idx, (devices, tails) = i, cut
            break
    if h_idx is None:
        warn(None, "no nvidia-smi topo matrix header (a row naming GPU0, GPU1, ...) found")
        return topo
    if len(devices) > MAX_COLUMNS:
        warn(h_idx + 1, f"the header names {len(devices)} columns; nvidia-smi prints one per GPU and NIC (tens), "
                        f"so this is no topology matrix: only the first {MAX_COLUMNS} are read")
        devices = devices[:MAX_COLUMNS]

    # ---- rows: up to a blank line or the legend
    raw_rows: list[tuple[int, list[str]]] = []
    end = len(lines)
    for i in range(h_idx + 1, len(lines)):
        line = lines[i]
        s = line.strip()
        if not s:
            if raw_rows:
                end = i
                break
            continue
        if s.startswith(("Legend", "NIC Legend")):
            end = i
            break
        if _header_cut(line) is not None:
            warn(i + 1, "a second matrix header; only the first matrix is read")
            end = i
            break
        raw_rows.append((i + 1, line.split()))

    known = set(devices)
    labelled: list[tuple[int, str, str | None, list[str]]] = []
    for ln, toks in raw_rows:
        label, glued = _split_label(toks[0], known)
        labelled.append((ln, label, glued, toks[1:]))

    # ---- resolve header names that ran together, against the row names
    row_labels = [lab for _, lab, _, _ in labelled]
    row_set = set(row_labels)
    glued_candidates = [lab for lab in dict.fromkeys(row_labels) if lab not in known]
    columns: list[str] = []
    for d in devices:
        if d in row_set or _GPU.match(d) or _NIC.match(d):
            columns.append(d)
            continue
        parts = _decompose(d, glued_candidates)
        if parts and len(parts) > 1:
            columns.extend(parts)
        else:
            columns.append(d)
    seen_cols: set[str] = set()
    for c in columns:
        if c in seen_cols:
            warn(h_idx + 1, f"column {c} appears twice in the header; the first one is used")
        seen_cols.add(c)
    if len(columns) > MAX_COLUMNS:
        warn(h_idx + 1, f"the header splits into {len(columns)} columns; only the first {MAX_COLUMNS} are read")
        columns = columns[:MAX_COLUMNS]
    ncols = len(columns)
    column_set = set(columns)

    # ---- NIC legend
    legend: dict[str, str] = {}
    in_legend = False
    for i in range(end, len(lines)):
        s = lines[i].strip()
        if s.startswith("NIC Legend"):
            in_legend = True
            continue
        if not in_legend:
            continue
        m = _LEGEND.match(lines[i])
        if m:
            key, name = m.group(1), m.group(2)
            if key in legend and legend[key] != name:
                warn(i + 1, f"{key} named twice in the NIC Legend ({legend[key]}, {name}); the first is used")
                continue
            if name in legend.values() and legend.get(key) != name:
                warn(i + 1, f"NIC Legend names {name} twice; {key} is kept as {key}")
                continue
            legend[key] = name
        elif s and not s.startswith("#"):
            in_legend = False

    def nic_name(col: str) -> str:
        return legend.get(col, col)

    unnamed = [c for c in columns if _NIC.match(c) and c not in legend]
    if unnamed:
        warn(None, f"no NIC Legend entry for {', '.join(unnamed)}; the NIC keeps its column name")

    numa_col = next((k for k, t in enumerate(tails) if t == "NUMA Affinity"), None)

    # ---- cells
    gpu_rows: dict[int, tuple[int, list[str]]] = {}
    nic_rows: dict[str, tuple[int, list[str]]] = {}
    gpu_numa: dict[int, int] = {}
    for ln, label, glued, rest in labelled:
        cells = [glued] if glued is not None else []
        k = 0
        while k < len(rest) and len(cells) < ncols and _CELL.match(rest[k]):
            cells.append(rest[k])
            k += 1
        extras = rest[k:]
        if len(cells) < ncols:
            warn(ln, f"row {label} has {len(cells)} of {ncols} entries")
        if any(_CELL.match(e) for e in extras) and len(cells) == ncols:
            warn(ln, f"row {label} has more entries than the header has columns")
        gm = _GPU.match(label)
        if gm:
            idx = int(gm.group(1))
            if idx in gpu_rows:
                warn(ln, f"GPU{idx} has a second row; the first one (line {gpu_rows[idx][0]}) is kept")
                continue
            gpu_rows[idx] = (ln, cells)
            if numa_col is not None and numa_col < len(extras):
                v = extras[numa_col]
                if re.fullmatch(r"\d+", v):
                    gpu_numa[idx] = int(v)
        elif label in column_set:
            name = nic_name(label)
            if name in nic_rows:
                warn(ln, f"NIC {name} has a second row; the first one (line {nic_rows[name][0]}) is kept")
                continue
            nic_rows[name] = (ln, cells)
        else:
            warn(ln, f"row {label!r} names no column of the header; skipped")

    have_rows = {f"GPU{i}" for i in gpu_rows} | {c for c in columns if nic_name(c) in nic_rows}
    missing = [c for c in columns if c not in have_rows]
    if missing:
        shown = ", ".join(missing[:16]) + (f", ... ({len(missing)} in all)" if len(missing) > 16 else "")
        warn(None, f"no row for {shown} (the matrix looks cut off)")

    # ---- build
    gpu_cols = {j: int(_GPU.match(c).group(1)) for j, c in enumerate(columns) if _GPU.match(c)}
    nic_cols = {j: nic_name(c) for j, c in enumerate(columns) if not _GPU.match(c)}
    indices = sorted(set(gpu_cols.values()) | set(gpu_rows))
    topo.gpus = [Gpu(index=i, numa_node=gpu_numa.get(i)) for i in indices]
    names_seen: set[str] = set()
    for j, name in nic_cols.items():
        if name in names_seen:
            continue
        names_seen.add(name)
        topo.add_nic(name, kind="rdma" if _RDMA_NAME.match(name) else None)

    def cell_path(v: str | None) -> str | None:
        if v == "SOC":
            return "SYS"
        return v if v in PATH_TYPES else None

    for idx, (ln, cells) in gpu_rows.items():
        for j, v in enumerate(cells):
            if j in nic_cols:
                p = cell_path(v)
                if p is not None:
                    topo.paths.setdefault((str(idx), nic_cols[j]), p)
                elif v == "X":
                    warn(ln, f"GPU{idx} row says X (self) under {nic_cols[j]}")
    for name, (ln, cells) in nic_rows.items():
        for j, v in enumerate(cells):
            if j in gpu_cols:
                p = cell_path(v)
                if p is None:
                    continue
                key = (str(gpu_cols[j]), name)
                have = topo.paths.get(key)
                if have is None:
                    topo.paths[key] = p
                elif have != p:
                    warn(ln, f"{name} row says {p} to GPU{gpu_cols[j]} but the GPU row says {have}; the GPU row is kept")
    return topo
