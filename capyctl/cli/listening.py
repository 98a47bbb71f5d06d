"""Where a ``capyctl start`` command listens, and the checks before it does. Plain Python:
the host agent (``capyctl start host``) uses these without Django."""

from __future__ import annotations

import errno
import socket
import sys
from pathlib import Path

from capyctl.errors import UserError
from hostagent.datadir import open_to_others


def parse_listen(value: str) -> tuple[str, int]:
    """``HOST:PORT``, ``[::1]:PORT``, ``:PORT`` or ``PORT`` → (host, port)."""
    text = value.strip()
    host = "127.0.0.1"
    port_text = text
    if text.startswith("["):
        end = text.find("]")
        if end == -1 or text[end + 1 : end + 2] != ":":
            raise UserError(f"invalid --listen {value!r}: use HOST:PORT, e.g. 127.0.0.1:8000")
        host, port_text = text[1:end], text[end + 2 :]
    elif ":" in text:
        host_part, _, port_text = text.rpartition(":")
        host = host_part or "0.0.0.0"  # noqa: S104 - ":PORT" asks for every interface
    if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise UserError(f"invalid --listen {value!r}: the port must be a number from 1 to 65535")
    return host, int(port_text)


def check_port_free(host: str, port: int) -> None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            reason = "address already in use" if exc.errno == errno.EADDRINUSE else exc.strerror
            raise UserError(f"cannot listen on {host}:{port}: {reason}") from None


def warn_if_open(data_dir: Path) -> None:
    warning = open_to_others(data_dir)
    if warning is not None:
        print(warning, file=sys.stderr, flush=True)
