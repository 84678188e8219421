"""Reading configuration files: the TOML config, and the small files it names (peers file,
notice key); every failure one :class:`~linkpass.config.problems.ConfigError` line naming the file."""

from __future__ import annotations

import os
import stat
import tomllib
import typing
from pathlib import Path
from types import SimpleNamespace

from pydantic import ValidationError

from linkpass.config.problems import ConfigError, problem_line, validation_problems
from linkpass.config.schema import Config, cross_field_problems
from linkpass.config.values import huge_number_text


def parse_config(text: str, source: str = "<config>") -> Config:
    """Parse and validate TOML text.

    Args:
        text: the TOML document.
        source: the name used in error messages (usually the file path).

    Returns:
        The validated :class:`Config`.

    Raises:
        ConfigError: one line ``<source>: <field>: <problem>``, or ``<source>: <problem>`` for
            text that is not TOML, arrays/inline tables nested so deeply that the TOML reader
            runs out of stack (RecursionError), or a document too large for memory.
    """
    text = text.removeprefix("\ufeff")  # a UTF-8 byte order mark (some Windows editors write one)
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        why = str(e)
        if why.endswith("(at end of document)"):  # name the place: the last line, after its last character
            last = text.split("\n")
            why = why[: -len(")")] + f", line {len(last)}, column {len(last[-1]) + 1})"
        raise ConfigError(f"{source}: not valid TOML: {why}") from None
    except RecursionError:  # tomllib recurses once per nested array / inline table
        raise ConfigError(f"{source}: cannot parse: arrays or inline tables nested too deeply "
                          "(past the TOML reader's recursion limit)") from None
    except MemoryError:
        raise ConfigError(f"{source}: cannot read: out of memory while parsing the TOML") from None
    except ValueError as e:  # an integer past Python's 4300-digit conversion limit (sys.set_int_max_str_digits)
        raise ConfigError(f"{source}: cannot parse: {huge_number_text(e)}") from None
    try:
        return Config.model_validate(raw)
    except ValidationError as e:
        problems = validation_problems(e, source)
        sections = valid_sections(raw)
        if sections is not None:  # the cross-field checks that do not need an invalid section
            for msg in cross_field_problems(sections.daemon, sections.rails, sections.peers, sections.topology,
                                            sections.hooks):
                line = f"{source}: {problem_line(msg)}"
                if line not in problems:
                    problems.append(line)
        more = f" (and {len(problems) - 1} more problem(s))" if len(problems) > 1 else ""
        err = ConfigError(f"{problems[0]}{more}", problems)
        err.sections = sections
        raise err from None
    except (RecursionError, MemoryError) as e:  # a deep value pydantic walks, or one too large to hold
        raise ConfigError(f"{source}: cannot validate: {'values nested too deeply' if isinstance(e, RecursionError) else 'out of memory'}") from None


def valid_sections(raw: object) -> SimpleNamespace | None:
    """The sections of a config that failed validation, each validated on its own: one attribute
    per :class:`Config` field, the section's model, or None where it is invalid (or missing
    without a default, like ``daemon``); ``rails`` and ``peers`` are lists with None for each
    invalid entry (None when not a list); ``auto`` as :attr:`Config.auto` (False when
    ``[topology]`` is invalid).  None when ``raw`` is not a table.  Lets ``linkpass config check``
    report the cross-field and file problems that do not depend on the invalid parts together
    with the field errors, in one run.  Never raises."""
    if not isinstance(raw, dict):
        return None
    out = SimpleNamespace()
    for name, field in Config.model_fields.items():
        ann = field.annotation
        entry = typing.get_args(ann)[0] if typing.get_origin(ann) is list else None
        try:
            if entry is not None:
                value = raw.get(name, [])
                setattr(out, name, [_valid(entry, x) for x in value] if isinstance(value, list) else None)
            elif name in raw:
                setattr(out, name, _valid(ann, raw[name]))
            else:
                setattr(out, name, None if field.is_required() else field.get_default(call_default_factory=True))
        except Exception:  # noqa: BLE001 - a part that cannot be validated alone is left out
            setattr(out, name, None)
    out.auto = out.topology is not None and out.topology.rails == "auto"
    return out


def _valid(model, value):
    try:
        return model.model_validate(value)
    except (ValidationError, RecursionError, MemoryError, ValueError, TypeError):
        return None


def load_config(path: str | Path) -> Config:
    """Read and validate a config file (:func:`read_text_file`, then :func:`parse_config`).

    Raises:
        ConfigError: missing or unreadable file, not a regular file, over 1 MiB, bad TOML, or
            invalid values; the message names the file and the field.
    """
    return parse_config(read_text_file(path), str(Path(path)))


#: The largest config file read (a full example config is about 20 KB).
MAX_CONFIG_BYTES = 1 << 20

_NOT_REGULAR = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                (stat.S_ISSOCK, "a socket"))


def _size_text(n: int) -> str:
    return f"{n >> 20} MiB" if n and n % (1 << 20) == 0 else f"{n} bytes"


def read_text_file(path: str | Path, *, limit: int = MAX_CONFIG_BYTES, what: str = "a config file") -> str:
    """The text of a small UTF-8 file that linkpass reads whole (the config, the peers file).

    Only a regular file is opened (checked with stat(2) first, and again with fstat(2) on the
    descriptor, which is opened non-blocking so a FIFO swapped in cannot hang the reader); at most
    ``limit`` + 1 bytes are read.  A UTF-8 byte order mark at the start is dropped.

    Args:
        path: the file.
        limit: the largest size accepted, in bytes.
        what: how messages name the file ("a config file", "a peers file").

    Raises:
        ConfigError: one line, ``<path>: <what is wrong>``: no such file, permission denied,
            is a directory, not a regular file (a FIFO, a character device...), too large,
            not UTF-8 text, or cannot read (with the OS's reason).
    """
    p = Path(path)

    def refuse(why: str) -> ConfigError:
        return ConfigError(f"{p}: {why}")

    def os_error(e: OSError) -> ConfigError:
        if isinstance(e, FileNotFoundError):
            return refuse("no such file")
        if isinstance(e, PermissionError):
            return refuse("permission denied")
        return refuse(f"cannot read: {e.strerror or e}")

    def check(st: os.stat_result) -> None:
        if stat.S_ISDIR(st.st_mode):
            raise refuse(f"is a directory, not {what}")
        if not stat.S_ISREG(st.st_mode):
            kind = next((k for test, k in _NOT_REGULAR if test(st.st_mode)), "not a plain file")
            raise refuse(f"not a regular file ({kind})")
        if st.st_size > limit:
            raise refuse(f"too large ({st.st_size} bytes; {what} is at most {_size_text(limit)})")

    try:
        check(os.stat(p))
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | getattr(os, "O_NOCTTY", 0))
    except OSError as e:
        raise os_error(e) from None
    with os.fdopen(fd, "rb") as f:
        check(os.fstat(fd))  # the same file we stat()ed, not one swapped in since
        try:
            data = f.read(limit + 1)
        except OSError as e:
            raise os_error(e) from None
    if len(data) > limit:  # grew after the stat
        raise refuse(f"too large (over {limit} bytes; {what} is at most {_size_text(limit)})")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise refuse(f"not UTF-8 text ({e.reason} at byte {e.start})") from None
    return text.removeprefix("\ufeff")


def notice_key(cfg: Config, source: str) -> bytes | None:
    """The notice key of ``cfg`` (:func:`read_key_file` of ``daemon.notice_key_file``), None when unset.

    Raises:
        ConfigError: ``<source>: daemon.notice_key_file: <path>: <what is wrong>``.
    """
    if not cfg.daemon.notice_key_file:
        return None
    try:
        return read_key_file(cfg.daemon.notice_key_file)
    except ConfigError as e:
        raise ConfigError(f"{source}: daemon.notice_key_file: {e}") from None


#: The largest notice key file read, in bytes (`linkpass fabric` writes 64 hex digits).
MAX_KEY_FILE_BYTES = 4096


def read_key_file(path: str | Path) -> bytes:
    """Read the shared notice key.

    The file must be a regular file not readable or writable by group or others (mode 0600
    or stricter), of at most :data:`MAX_KEY_FILE_BYTES` bytes, and hold at least 16 bytes after
    stripping surrounding whitespace.  At most ``MAX_KEY_FILE_BYTES`` + 1 bytes are read.

    Raises:
        ConfigError: naming the file and what is wrong.
    """
    p = Path(path)
    try:
        st = p.stat()
    except FileNotFoundError:
        raise ConfigError(f"{p}: notice key file does not exist") from None
    except OSError as e:
        raise ConfigError(f"{p}: cannot stat notice key file: {e.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"{p}: notice key file is not a regular file")
    if st.st_mode & 0o077:
        raise ConfigError(f"{p}: notice key file has mode {st.st_mode & 0o777:04o}; it must be 0600 (no group/other access)")
    if st.st_size > MAX_KEY_FILE_BYTES:
        raise ConfigError(f"{p}: notice key file is {st.st_size} bytes; at most {MAX_KEY_FILE_BYTES} are read")
    try:
        with p.open("rb") as f:
            key = f.read(MAX_KEY_FILE_BYTES + 1)
    except OSError as e:
        raise ConfigError(f"{p}: cannot read notice key file: {e.strerror}") from None
    if len(key) > MAX_KEY_FILE_BYTES:  # grew after the stat
        raise ConfigError(f"{p}: notice key file is over {MAX_KEY_FILE_BYTES} bytes; at most {MAX_KEY_FILE_BYTES} are read")
    key = key.strip()
    if len(key) < 16:
        raise ConfigError(f"{p}: notice key is {len(key)} bytes; at least 16 are required")
    return key
