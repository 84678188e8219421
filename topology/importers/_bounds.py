"""Bounds every importer applies to its input, so that no text can make one take unbounded
time or memory: a cap on the characters read and on the warnings kept.

Pure: no imports with side effects, no I/O.
"""

from __future__ import annotations

#: The most characters an importer reads: :data:`topology.importers.MAX_BYTES` (16 MiB), the
#: most ``parse_file`` reads from a file; a text handed to ``parse()`` directly is held to it too.
MAX_CHARS = 16 * 1024 * 1024
#: The most warnings one parse keeps; the rest are counted in one last warning.  A real capture
#: gives a handful; thousands mean the input is not the tool's output (or is the same broken
#: line repeated), and listing each would cost memory in proportion to the input.
MAX_WARNINGS = 200


def cap_text(text: str, source: str) -> tuple[str, str | None]:
    """``text`` cut to at most :data:`MAX_CHARS` characters (at the last line break before the
    cap when there is one in its second half), and the warning that says so, or None."""
    if len(text) <= MAX_CHARS:
        return text, None
    cut = text.rfind("\n", 0, MAX_CHARS)
    end = cut + 1 if cut >= MAX_CHARS // 2 else MAX_CHARS
    line = text.count("\n", 0, end) + 1
    return text[:end], (f"{source}: the input is {len(text)} characters, more than {MAX_CHARS >> 20} Mi (a captured "
                        f"tool output is far smaller); only the first {end} (to line {line}) were read")


class WarningCap:
    """Appends warnings to ``topo.warnings`` up to :data:`MAX_WARNINGS`; :meth:`close` adds one
    line counting those left out."""

    def __init__(self, warnings: list[str], source: str) -> None:
        self.warnings = warnings
        self.source = source
        self.dropped = 0

    def add(self, msg: str) -> None:
        if len(self.warnings) < MAX_WARNINGS:
            self.warnings.append(msg)
        else:
            self.dropped += 1

    def close(self) -> None:
        if self.dropped:
            self.warnings.append(f"{self.source}: {self.dropped} more warning(s) not listed (the first "
                                 f"{MAX_WARNINGS} are)")
            self.dropped = 0
