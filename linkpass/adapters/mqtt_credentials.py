"""The files an MQTT connection needs: the broker password and the TLS certificates and key.

Every file is re-read at each connection attempt (a fixed password or certificate is picked
up without a restart).  A key or password file that others may read (any ``o`` permission
bit) is refused.  Problems are one-line :class:`MqttSetupError` messages naming the option
and the file.
"""

from __future__ import annotations

import os
import ssl
import stat


class MqttSetupError(Exception):
    """A file the connection needs is missing, unreadable, too open or invalid.  ``str(err)``
    is one line naming the option and the file."""


def check_private_file(path: str, option: str) -> os.stat_result:
    """Check a secret file: exists, is a regular file, gives others no access.

    Raises:
        MqttSetupError: ``mqtt.<option> <path>: ...`` (one line).
    """
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise MqttSetupError(f"mqtt.{option} {path}: no such file") from None
    except OSError as e:
        raise MqttSetupError(f"mqtt.{option} {path}: cannot stat: {e.strerror or e}") from None
    if not stat.S_ISREG(st.st_mode):
        raise MqttSetupError(f"mqtt.{option} {path}: not a regular file")
    if st.st_mode & 0o007:
        raise MqttSetupError(f"mqtt.{option} {path}: mode {st.st_mode & 0o777:04o} lets every user on this host read it; "
                             f"refusing it (chmod o-rwx {path}, e.g. 0600)")
    return st


#: The largest broker password file read, in bytes.
MAX_PASSWORD_FILE_BYTES = 64 * 1024


def read_password_file(path: str) -> str:
    """The broker password: the first line of ``path`` (trailing newline and spaces removed).

    At most :data:`MAX_PASSWORD_FILE_BYTES` + 1 bytes are read.

    Raises:
        MqttSetupError: missing, readable by others, not a regular file, over
            ``MAX_PASSWORD_FILE_BYTES`` bytes, unreadable, not UTF-8 or empty.
    """
    st = check_private_file(path, "password_file")
    if st.st_size > MAX_PASSWORD_FILE_BYTES:
        raise MqttSetupError(f"mqtt.password_file {path}: too large ({st.st_size} bytes; at most {MAX_PASSWORD_FILE_BYTES})")
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_PASSWORD_FILE_BYTES + 1)
        if len(data) > MAX_PASSWORD_FILE_BYTES:  # grew after the stat
            raise MqttSetupError(f"mqtt.password_file {path}: too large (over {MAX_PASSWORD_FILE_BYTES} bytes)")
        pw = data.split(b"\n", 1)[0].decode("utf-8").rstrip("\r")
    except (OSError, UnicodeDecodeError) as e:
        raise MqttSetupError(f"mqtt.password_file {path}: cannot read: {getattr(e, 'strerror', None) or e}") from None
    if not pw:
        raise MqttSetupError(f"mqtt.password_file {path}: empty (the password is its first line)")
    return pw


def _readable(path: str, option: str) -> None:
    try:
        with open(path, "rb") as f:
            f.read(1)
    except FileNotFoundError:
        raise MqttSetupError(f"mqtt.{option} {path}: no such file") from None
    except IsADirectoryError:
        raise MqttSetupError(f"mqtt.{option} {path}: is a directory") from None
    except OSError as e:
        raise MqttSetupError(f"mqtt.{option} {path}: cannot read: {e.strerror or e}") from None


def build_tls_context(mc) -> ssl.SSLContext | None:
    """The TLS context for ``[mqtt]`` (None when TLS is off).

    Verifies the broker's certificate (against ``ca_file``, or the system's CAs) and its name;
    loads the client certificate and key when ``cert_file`` is set.

    Raises:
        MqttSetupError: a file is missing, unreadable, not PEM, or the key is readable by others.
    """
    if not (mc.tls or mc.ca_file or mc.cert_file):
        return None
    if mc.ca_file:
        _readable(mc.ca_file, "ca_file")
    try:
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=mc.ca_file or None)
    except (ssl.SSLError, ValueError) as e:
        raise MqttSetupError(f"mqtt.ca_file {mc.ca_file}: not usable CA certificates (PEM): {e}") from None
    except OSError as e:
        raise MqttSetupError(f"mqtt.ca_file {mc.ca_file}: cannot read: {e.strerror or e}") from None
    if mc.cert_file:
        _readable(mc.cert_file, "cert_file")
        key = mc.key_file or mc.cert_file
        if mc.key_file:
            check_private_file(mc.key_file, "key_file")
            _readable(mc.key_file, "key_file")
        try:
            ctx.load_cert_chain(mc.cert_file, mc.key_file or None)
        except ssl.SSLError as e:
            raise MqttSetupError(f"mqtt.cert_file {mc.cert_file} / key_file {key}: not a usable client certificate "
                                 f"and private key (PEM, matching each other): {e.reason or e}") from None
        except OSError as e:
            raise MqttSetupError(f"mqtt.cert_file {mc.cert_file}: cannot load: {e.strerror or e}") from None
    return ctx
