"""Connecting to an engine's Unix socket the way TCP would.

Where a listening Unix socket's accept queue is full, Linux refuses a non-blocking connect
at once with ``EAGAIN``, where TCP would keep trying (its SYN is sent again) until the
engine accepts. uvloop passes that refusal on, so a burst of new connections to a busy
engine would fail. :func:`connect_unix` waits for room instead, as TCP does."""

from __future__ import annotations

import asyncio
import socket
import time

FIRST_WAIT = 0.002
LONGEST_WAIT = 0.1


async def connect_unix(path: str, timeout: float) -> socket.socket:
    """A non-blocking stream socket connected to the Unix socket ``path``; raises
    ``OSError`` (``TimeoutError`` when its accept queue stayed full for ``timeout``)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setblocking(False)
    deadline = time.monotonic() + timeout
    wait = FIRST_WAIT
    try:
        while True:
            try:
                sock.connect(path)  # a Unix connect is done at once, or refused
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"{path} accepted no connection for {timeout:.0f} s"
                    ) from None
                await asyncio.sleep(wait)
                wait = min(wait * 2, LONGEST_WAIT)
            else:
                return sock
    except BaseException:
        sock.close()
        raise
