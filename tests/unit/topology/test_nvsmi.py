"""topology.importers.nvsmi: ``nvidia-smi topo -m`` matrices from the corpus, layout variants,
and bad input (never an exception; warnings name the source and the line)."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import FIXTURES, corpus_file
from hypothesis import given, settings
from hypothesis import strategies as st

from topology.affinity import analyse
from topology.importers import nvsmi

CORPUS = sorted(p.name for p in (FIXTURES / "corpus" / "nvsmi_topo").iterdir())


def _read(rel: str) -> str:
    return corpus_file(rel).read_text()


def _analysed(text: str, source: str = "t"):
    return analyse(nvsmi.parse(text, source))


# ---------------------------------------------------------------- the corpus

def test_every_corpus_file_is_covered(expected):
    assert CORPUS and all(f"nvsmi_topo/{name}" in expected for name in CORPUS)


@pytest.mark.parametrize("name", CORPUS)
def test_corpus_file(name, expected):
    rel = f"nvsmi_topo/{name}"
    exp = expected[rel]
    text = _read(rel)
    assert nvsmi.looks_like(text)
    topo = _analysed(text, rel)
    assert topo.sources == [rel]
    if exp.get("ambiguous"):
        # the matrix cannot decide the roles: one warning says why, and no NIC is guessed a rail
        assert len(topo.warnings) == 1 and topo.warnings[0].startswith(f"{rel}: no GPU has a NIC at PIX, PXB or PHB")
        assert {n.role for n in topo.nics} == {"undecided"} and all(n.rail is None for n in topo.nics)
        assert {g.key: g.nearest_nics for g in topo.gpus} == exp["gpu_nearest_nics"]
        return
    assert topo.warnings == []
    if exp.get("gpu_count") is not None:
        assert len(topo.gpus) == exp["gpu_count"]
    if "gpu_nearest_nics" in exp:
        assert {g.key: g.nearest_nics for g in topo.gpus} == exp["gpu_nearest_nics"]
    roles = {n.name: n.role for n in topo.nics}
    if exp.get("compute_nics") is not None:
        assert {n for n, r in roles.items() if r == "compute"} == set(exp["compute_nics"])
    non_compute = {n for n, r in roles.items() if r != "compute"}
    assert set(exp.get("non_compute_nics") or []) <= non_compute
    assert non_compute == set(exp.get("non_compute_nics") or [])


def test_gpu_numa_from_numa_affinity():
    topo = nvsmi.parse(_read("nvsmi_topo/dgxa100_style_8xA100_10nic_amd_8numa.nvsmi_topo.txt"), "t")
    assert [g.numa_node for g in topo.gpus] == [3, 3, 1, 1, 7, 7, 5, 5]
    # tab layout with an empty field before the GPU NUMA ID value
    topo = nvsmi.parse(_read("nvsmi_topo/a800_8gpu_8bond_2per_gpu_pair_pix.nvsmi_topo.txt"), "t")
    assert [g.numa_node for g in topo.gpus] == [0, 0, 0, 0, 1, 1, 1, 1]


def test_paths_are_keyed_by_gpu_index_and_legend_name():
    topo = nvsmi.parse(_read("nvsmi_topo/hgx_h100_8gpu_8nic_1to1_pix.nvsmi_topo.txt"), "t")
    assert topo.paths[("0", "mlx5_0")] == "PIX"
    assert topo.paths[("0", "mlx5_1")] == "NODE"
    assert topo.paths[("7", "mlx5_0")] == "SYS"
    assert len(topo.paths) == 64
    assert [n.name for n in topo.nics] == [f"mlx5_{i}" for i in range(8)]


def test_storage_and_front_end_nics_get_no_rail():
    topo = _analysed(_read("nvsmi_topo/oci_bm_a100_8gpu_18nic_4rails_per_gpu_pair.nvsmi_topo.txt"))
    rails = {n.name: n.rail for n in topo.nics}
    assert rails["mlx5_0"] is None and rails["mlx5_13"] is None
    # rail k follows the GPU order: GPU0's NICs first
    assert [rails[f"mlx5_{i}"] for i in (5, 6, 7, 8)] == [0, 1, 2, 3]


# ---------------------------------------------------------------- layout variants

GLUED = """user@node:~$ nvidia-smi topo -m
        GPU0    GPU1    mlx5_bond_0     mlx5_bond_1     CPU Affinity    NUMA Affinity   GPU NUMA ID
GPU0     X      NV8     PIX     SYS     0-31    0               N/A
GPU1    NV8      X      SYS     PIX     32-63   1               N/A
mlx5_bond_0PIX  SYS      X      SYS
mlx5_bond_1SYS  PIX     SYS      X

Legend:

  X    = Self
"""


def test_row_names_run_together_with_the_first_cell():
    topo = _analysed(GLUED)
    assert topo.warnings == []
    assert [n.name for n in topo.nics] == ["mlx5_bond_0", "mlx5_bond_1"]
    assert {g.key: g.nearest_nics for g in topo.gpus} == {"0": ["mlx5_bond_0"], "1": ["mlx5_bond_1"]}


def test_header_names_run_together_are_split_by_the_row_names():
    text = GLUED.replace("mlx5_bond_0     mlx5_bond_1     CPU Affinity", "mlx5_bond_0mlx5_bond_1CPU Affinity")
    topo = _analysed(text)
    assert topo.warnings == []
    assert topo.paths == {("0", "mlx5_bond_0"): "PIX", ("0", "mlx5_bond_1"): "SYS",
                          ("1", "mlx5_bond_0"): "SYS", ("1", "mlx5_bond_1"): "PIX"}
    assert [g.numa_node for g in topo.gpus] == [0, 1]


def test_old_layout_names_nics_in_the_header_and_says_soc():
    text = ("\tGPU0\tGPU1\tmlx5_0\tmlx5_1\tCPU Affinity\n"
            "GPU0\t X \tNV1\tPIX\tSOC\t0-9\n"
            "GPU1\tNV1\t X \tSOC\tPIX\t10-19\n"
            "mlx5_0\tPIX\tSOC\t X \tSOC\t\n"
            "mlx5_1\tSOC\tPIX\tSOC\t X \t\n")
    topo = _analysed(text)
    assert topo.warnings == []
    assert topo.paths[("0", "mlx5_1")] == "SYS"
    assert [g.numa_node for g in topo.gpus] == [None, None]
    assert {g.key: g.nearest_nics for g in topo.gpus} == {"0": ["mlx5_0"], "1": ["mlx5_1"]}


def test_mp_matrix_has_pcie_paths_between_gpus():
    text = ("\tGPU0\tGPU1\tNIC0\tCPU Affinity\tNUMA Affinity\n"
            "GPU0\t X \tPXB\tPXB\t0-7\t0\n"
            "GPU1\tPXB\t X \tPXB\t0-7\t0\n"
            "NIC0\tPXB\tPXB\t X \t\t\n\n"
            "NIC Legend:\n\n  NIC0: mlx5_0\n")
    topo = _analysed(text)
    assert topo.warnings == []
    assert {g.key: g.nearest_nics for g in topo.gpus} == {"0": ["mlx5_0"], "1": ["mlx5_0"]}


def test_multi_digit_gpu_running_into_nvlink_cell():
    def row(label: str, cells: list[str]) -> str:
        return f"{label:<8}" + "".join(f"{c:<8}" for c in cells) + "0-7     0"
    header = "        " + "".join(f"GPU{i:<5}" for i in range(11)) + "CPU Affinity    NUMA Affinity"
    rows = [row(f"GPU{i}", ["X" if j == i else "NV12" for j in range(11)]) for i in range(10)]
    rows.append("GPU10NV12    " + "".join(f"{c:<8}" for c in ["NV12"] * 9 + ["X"]) + "0-7     0")
    topo = nvsmi.parse("\n".join([header, *rows]), "t")
    assert topo.warnings == []
    assert [g.index for g in topo.gpus] == list(range(11))
    assert [g.numa_node for g in topo.gpus] == [0] * 11


# ---------------------------------------------------------------- bad input

@pytest.mark.parametrize("text", ["", "   \n\n", "hello world\nthis is not a matrix\n",
                                  "\x00\x01\x02\xff\xfe binary \x89PNG\r\n\x1a\n",
                                  "GPU0\n", "\tGPU0\n", "GPU0 X\n"])
def test_garbage_gives_a_warning_never_an_exception(text):
    topo = nvsmi.parse(text, "junk.txt")
    assert topo.warnings and all(w.startswith("junk.txt: ") for w in topo.warnings)
    analyse(topo)


def test_looks_like_rejects_other_text():
    assert not nvsmi.looks_like("")
    assert not nvsmi.looks_like("<system version=\"1\"></system>")
    assert not nvsmi.looks_like("CA 'mlx5_0'\n\tPort 1:\n")
    assert not nvsmi.looks_like(b"GPU0")  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["a800_8gpu_8bond_2per_gpu_pair_pix.nvsmi_topo.txt",
                                  "b300_cx8_8gpu_8bond_pxb.nvsmi_topo.txt"])
def test_every_line_truncation_parses(name):
    lines = _read(f"nvsmi_topo/{name}").splitlines(keepends=True)
    header_at = next(i for i, ln in enumerate(lines) if ln.lstrip().startswith("GPU0"))
    last_row = next(i for i, ln in enumerate(lines) if ln.startswith("NIC7"))
    for k in range(len(lines) + 1):
        cut = "".join(lines[:k])
        topo = analyse(nvsmi.parse(cut, "cut"))
        if header_at < k <= last_row:
            # cut inside the matrix: says so
            assert any("cut off" in w for w in topo.warnings), k
        if k <= header_at:
            assert topo.gpus == [] and topo.warnings
        # and in the middle of a line too
        if k < len(lines):
            half = cut + lines[k][: len(lines[k]) // 2]
            analyse(nvsmi.parse(half, "cut"))


def test_duplicate_gpu_row_warns_and_keeps_the_first():
    text = _read("nvsmi_topo/hgx_h100_8gpu_8nic_1to1_pix.nvsmi_topo.txt").splitlines()
    row = next(i for i, ln in enumerate(text) if ln.startswith("GPU1 "))
    dup = text[row].replace("PIX     NODE", "NODE    PIX ", 1)
    topo = nvsmi.parse("\n".join(text[: row + 1] + [dup] + text[row + 1:]), "dup.txt")
    assert any("GPU1 has a second row" in w and w.startswith("dup.txt: line ") for w in topo.warnings)
    assert topo.paths[("1", "mlx5_1")] == "PIX"
    assert len(topo.gpus) == 8


def test_duplicate_nic_name_in_the_legend_warns():
    text = _read("nvsmi_topo/hgx_h100_8gpu_8nic_1to1_pix.nvsmi_topo.txt").replace("NIC1: mlx5_1", "NIC1: mlx5_0")
    topo = nvsmi.parse(text, "dup.txt")
    assert any("names mlx5_0 twice" in w for w in topo.warnings)
    assert sorted(n.name for n in topo.nics) == sorted(["NIC1"] + [f"mlx5_{i}" for i in (0, 2, 3, 4, 5, 6, 7)])
    assert topo.paths[("0", "mlx5_0")] == "PIX"


def test_duplicate_header_column_warns():
    text = ("\tGPU0\tNIC0\tNIC0\tCPU Affinity\n"
            "GPU0\t X \tPIX\tSYS\t0-3\n"
            "NIC0\tPIX\t X \tSYS\t\n\nNIC Legend:\n\n  NIC0: mlx5_0\n")
    topo = analyse(nvsmi.parse(text, "d"))
    assert any("appears twice" in w for w in topo.warnings)
    assert [n.name for n in topo.nics] == ["mlx5_0"] and topo.paths[("0", "mlx5_0")] == "PIX"


def test_only_the_first_matrix_is_read():
    one = _read("nvsmi_topo/hgx_h100_8gpu_8nic_1to1_pix.nvsmi_topo.txt")
    topo = nvsmi.parse(one + "\n" + one, "twice")
    assert len(topo.gpus) == 8 and len(topo.nics) == 8


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("GPUNIC0123456789 \tX\nPIXSYNODEVmlx5_bond:-,/A")), max_size=400))
def test_fuzzed_matrix_like_text_never_raises(text):
    analyse(nvsmi.parse(text, "fuzz"))
    nvsmi.looks_like(text)


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_mutated_corpus_file_never_raises(data):
    text = _read("nvsmi_topo/oci_bm_a100_8gpu_18nic_4rails_per_gpu_pair.nvsmi_topo.txt")
    lines = text.splitlines()
    for _ in range(data.draw(st.integers(1, 6))):
        i = data.draw(st.integers(0, len(lines) - 1))
        op = data.draw(st.sampled_from(["drop", "dup", "cut", "junk"]))
        if op == "drop":
            del lines[i]
        elif op == "dup":
            lines.insert(i, lines[i])
        elif op == "cut":
            lines[i] = lines[i][: data.draw(st.integers(0, max(0, len(lines[i]))))]
        else:
            lines[i] = data.draw(st.text(max_size=30))
        if not lines:
            break
    analyse(nvsmi.parse("\n".join(lines), "mut"))


def test_module_is_pure():
    src = Path(nvsmi.__file__).read_text()
    for bad in ("import os", "import subprocess", "open(", "import socket"):
        assert bad not in src
