"""``capyctl start standalone``: prepare the data dir, then serve the ASGI application."""

from __future__ import annotations

import argparse
import errno
import logging
import os
import signal
import socket
import sys
from pathlib import Path
from typing import Any

from django.conf import settings

from capyctl.errors import UserError
from hostagent.units import format_size

logger = logging.getLogger("capyctl.start")

# Uvicorn and daphne stop accepting at once on SIGTERM/Ctrl-C; requests still running get
# this long before the process exits, which keeps a stop under 5 seconds.
GRACEFUL_SHUTDOWN_SECONDS = 3


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


def _check_port_free(host: str, port: int) -> None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            reason = "address already in use" if exc.errno == errno.EADDRINUSE else exc.strerror
            raise UserError(f"cannot listen on {host}:{port}: {reason}") from None


def _url(host: str, port: int) -> str:
    shown = "127.0.0.1" if host in ("0.0.0.0", "") else host  # noqa: S104
    if ":" in shown:
        shown = f"[{shown}]"
    return f"http://{shown}:{port}"


def _describe_database() -> str:
    db = settings.DATABASES["default"]
    if db["ENGINE"].endswith("sqlite3"):
        return f"SQLite {db['NAME']}"
    return f"PostgreSQL {db.get('HOST') or 'localhost'}:{db.get('PORT') or 5432}/{db['NAME']}"


def start_standalone(args: argparse.Namespace) -> int:
    from capyctl.bootstrap import ensure_first_admin, prepare_standalone
    from capyctl.hosts.models import LOCAL_HOST_NAME, Host

    host, port = parse_listen(args.listen)
    _check_port_free(host, port)
    prepare_standalone()
    admin = ensure_first_admin()
    local = Host.objects.get(name=LOCAL_HOST_NAME)
    inventory = local.inventory
    gpus = inventory.get("gpus") or []
    gpu_text = ", ".join(f"{g['name']} ({format_size(g['total_bytes'])})" for g in gpus)
    base = _url(host, port)

    ram = format_size(inventory.get("ram_total_bytes"))
    lines = [
        f"CapyCTL {_version()} standalone, serving on {base}",
        f"  data dir:  {settings.DATA_DIR}",
        f"  database:  {_describe_database()}",
        f"  host:      local, {gpu_text or 'no GPUs'}; RAM {ram}",
        f"  admin:     {base}/admin/",
    ]
    if admin.created and admin.password_file is not None:
        lines.append(f"  log in as: {admin.username} / {admin.password}")
        lines.append(f"             (first start; the password is also in {admin.password_file})")
    elif admin.created:
        lines.append(f"  log in as: {admin.username} (password from CAPYCTL_ADMIN_PASSWORD)")
    elif admin.password_file is not None:
        lines.append(f"  log in as: {admin.username} (password in {admin.password_file})")
    else:
        lines.append(f"  log in as: {admin.username}")
    lines.append(f"  health:    {base}/healthz   ready: {base}/readyz")
    lines.append("Stop with Ctrl-C.")
    print("\n".join(lines), flush=True)

    from capyctl.scheduler.drivers import local_driver
    from capyctl.scheduler.executor import SchedulerLoop
    from capyctl.scheduler.reconcile import recover_local

    recover_local(local)
    loop = SchedulerLoop()
    loop.start()
    enrolment = _serve_enrolment(args.enrol_listen) if args.enrol_listen else None
    try:
        if args.server == "daphne":
            return _serve_daphne(host, port)
        return _serve_uvicorn(host, port)
    finally:
        # Engines are this process's children: end them, and say so in states and events.
        loop.stop()
        if enrolment is not None:
            enrolment.should_exit = True
        local_driver().stop_all(grace_seconds=GRACEFUL_SHUTDOWN_SECONDS)
        recover_local(local, shutting_down=True)


def _serve_enrolment(listen: str) -> Any:
    """Where hosts spend join tokens: TLS with the server's certificate, on a thread."""
    import threading

    from capyctl.hosts.enrol import enrol_application
    from capyctl.hosts.pki import pki
    from hostagent import tls
    from hostagent.asgi import tls_server

    host, port = parse_listen(listen)
    _check_port_free(host, port)
    where = pki()
    context = tls.server_context(where.server_cert, where.server_key, where.ca_cert,
                                 require_client=False)  # fmt: skip
    server = tls_server(enrol_application, host, port, context)
    threading.Thread(target=server.run, name="enrolment", daemon=True).start()
    print(f"  hosts join at https://{host}:{port} (CA {where.fingerprint()[:16]}…)", flush=True)
    return server


def start_host(args: argparse.Namespace) -> int:
    """The host agent. Needs no database: it answers the server over mutual TLS."""
    from hostagent.agent import AgentError, AgentFiles, join, serve

    data_dir = Path(getattr(args, "data_dir", None) or os.environ.get("CAPYCTL_DATA_DIR")
                    or Path.cwd() / ".capyctl-host")  # fmt: skip
    files = AgentFiles(data_dir)
    try:
        host, port = parse_listen(args.listen)
        if args.join:
            if files.joined():
                raise AgentError(
                    f"{data_dir} already holds the enrolment of host {files.host_name()}: "
                    "start without --join, or use another --data-dir"
                )
            name = join(args.join, files)
            print(f"joined as host {name}; certificate in {files.cert}", flush=True)
        _check_port_free(host, port)
        serve(files, host, port)
    except (AgentError, UserError) as exc:
        print(f"capyctl: error: {exc}", file=sys.stderr)
        return 2
    return 0


def _version() -> str:
    from capyctl import __version__

    return __version__


def _serve_uvicorn(host: str, port: int) -> int:
    import uvicorn

    config = uvicorn.Config(
        "capyctl.asgi:application",
        host=host,
        port=port,
        loop="uvloop",
        http="httptools",
        lifespan="on",
        access_log=False,
        proxy_headers=False,  # one ASGI layer less a request; CapyCTL logs no client address
        log_level=settings.LOG_LEVEL.lower(),
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_SECONDS,
        server_header=False,
    )
    server = uvicorn.Server(config)
    # uvicorn re-raises the signal that stopped it once it has shut down; with SIGTERM's
    # default action that would end the process before the engines are stopped. A no-op
    # handler lets run() return, and the caller finishes the shutdown.
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        server.run()
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0 if server.started else 1


def _serve_daphne(host: str, port: int) -> int:
    from daphne.cli import CommandLineInterface

    argv = [
        "--bind",
        host,
        "--port",
        str(port),
        "--application-close-timeout",
        str(GRACEFUL_SHUTDOWN_SECONDS),
        "--verbosity",
        "1",
        "capyctl.asgi:application",
    ]
    CommandLineInterface().run(argv)
    sys.stdout.flush()
    return 0
