"""Importers for captured tool outputs (NCCL topology XML, nvidia-smi topo, ibstat, ...).

Each importer module exposes ``looks_like(text) -> bool`` and ``parse(text, source) -> Topology``;
:func:`topology.importers.parse_file` (added with the CLI) runs every importer whose format it
recognises in a file and merges the results, so a paste of several tools' outputs works.
"""
