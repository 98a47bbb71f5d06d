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

from capyctl.cli import serving
from capyctl.cli.listening import check_port_free as _check_port_free
from capyctl.cli.listening import parse_listen
from capyctl.cli.listening import warn_if_open as _warn_if_open
from capyctl.errors import UserError
from hostagent.units import format_size

logger = logging.getLogger("capyctl.start")

# Uvicorn and daphne stop accepting at once on SIGTERM/Ctrl-C; requests still running get
# this long before the process exits, which keeps a stop under 5 seconds.
GRACEFUL_SHUTDOWN_SECONDS = 3
LISTEN_BACKLOG = 2048


def _listen(host: str, port: int) -> socket.socket:
    """The server's listening socket, bound before the banner says where it serves: a
    request sent right after the banner waits in the queue until the server accepts it,
    instead of being refused."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(LISTEN_BACKLOG)
    except OSError as exc:
        sock.close()
        reason = "address already in use" if exc.errno == errno.EADDRINUSE else exc.strerror
        raise UserError(f"cannot listen on {host}:{port}: {reason}") from None
    return sock


def _url(host: str, port: int) -> str:
    shown = "127.0.0.1" if host in ("0.0.0.0", "") else host  # noqa: S104
    if ":" in shown:
        shown = f"[{shown}]"
    return f"http://{shown}:{port}"


def mask_url(url: str) -> str:
    """``scheme://user:secret@host/...`` → ``scheme://user:***@host/...``, for printing."""
    from urllib.parse import urlsplit, urlunsplit

    try:
        parts = urlsplit(url)
    except ValueError:
        return "(not shown: not a URL)"
    if parts.password is None:
        return url
    userinfo, _, hostinfo = parts.netloc.rpartition("@")
    user = userinfo.split(":", 1)[0]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{hostinfo}"))


def allow_listen_host(host: str) -> None:
    """Unless ``CAPYCTL_ALLOWED_HOSTS`` is set, answer to the names of the address we
    listen on as well as to loopback: on every interface, this machine's names and
    addresses. Any other ``Host`` (a DNS-rebinding name) is refused, and so is a
    dashboard WebSocket from any other origin."""
    if settings.ALLOWED_HOSTS_SET:
        return
    names = [host, f"[{host}]"] if ":" in host else [host]
    if host in ("0.0.0.0", "::", ""):  # noqa: S104 - comparing, not binding
        import psutil

        names = [socket.gethostname(), socket.getfqdn()]
        for addresses in psutil.net_if_addrs().values():
            for address in addresses:
                if address.family in (socket.AF_INET, socket.AF_INET6):
                    ip = address.address.split("%", 1)[0]
                    names += [ip, f"[{ip}]"] if ":" in ip else [ip]
    settings.ALLOWED_HOSTS = list(dict.fromkeys([*settings.ALLOWED_HOSTS, *names]))


def _describe_database() -> str:
    db = settings.DATABASES["default"]
    if db["ENGINE"].endswith("sqlite3"):
        return f"SQLite {db['NAME']}"
    return f"PostgreSQL {db.get('HOST') or 'localhost'}:{db.get('PORT') or 5432}/{db['NAME']}"


def _login_lines(admin: Any) -> list[str]:
    """The banner's lines on logging in as the first admin."""
    if admin.created and admin.password_file is not None:
        return [
            f"  log in as: {admin.username} / {admin.password}",
            f"             (first start; the password is also in {admin.password_file})",
        ]
    if admin.created:
        return [f"  log in as: {admin.username} (password from CAPYCTL_ADMIN_PASSWORD)"]
    if admin.password_file is not None:
        return [f"  log in as: {admin.username} (password in {admin.password_file})"]
    return [f"  log in as: {admin.username}"]


def _upgrade_lines(upgrade: Any) -> list[str]:
    """The banner's line on an upgrade of the database, if this start made one."""
    line = upgrade.line() if upgrade is not None else None
    return [line] if line else []


def start_standalone(args: argparse.Namespace) -> int:
    from capyctl.bootstrap import ensure_first_admin, prepare_standalone
    from capyctl.cli import demo as demo_mode
    from capyctl.hosts.services import local_host
    from capyctl.reports import any_deployments

    host, port = parse_listen(args.listen)
    _check_port_free(host, port)
    allow_listen_host(host)
    _warn_if_open(Path(settings.DATA_DIR))
    listening = _listen(host, port) if args.server != "daphne" else None
    upgrade = prepare_standalone(migrate=args.migrate)
    admin = ensure_first_admin()
    demo = demo_mode.set_up_demo(admin.username) if getattr(args, "demo", False) else None
    local = local_host()
    inventory = local.inventory
    gpus = inventory.get("gpus") or []
    gpu_text = ", ".join(f"{g['name']} ({format_size(g['total_bytes'])})" for g in gpus)
    base = _url(host, port)
    serving.claim(Path(settings.DATA_DIR), mode="standalone", url=base)  # for `capyctl status`

    ram = format_size(inventory.get("ram_total_bytes"))
    lines = [
        f"CapyCTL {_version()} standalone, serving on {base}",
        f"  data dir:  {settings.DATA_DIR}",
        f"  database:  {_describe_database()}",
        *_upgrade_lines(upgrade),
        f"  host:      local, {gpu_text or 'no GPUs'}; RAM {ram}",
        f"  dashboard: {base}/   admin: {base}/admin/   api: {base}/api/docs/",
    ]
    lines += _login_lines(admin)
    lines.append(f"  health:    {base}/healthz   ready: {base}/readyz")
    if demo is not None:
        lines += demo_mode.banner_lines(demo, base)
    lines.append("Stop with Ctrl-C.")
    lines.append(demo_mode.next_line(demo, Path(settings.DATA_DIR), any_deployments()))
    print("\n".join(lines), flush=True)

    from capyctl.scheduler.drivers import local_driver
    from capyctl.scheduler.executor import SchedulerLoop
    from capyctl.scheduler.reconcile import recover_local

    recover_local(local)
    loop = SchedulerLoop()
    loop.start()
    enrolment = _serve_enrolment(args.enrol_listen) if args.enrol_listen else None
    try:
        if listening is None:
            return _serve_daphne(host, port)
        return _serve_uvicorn(host, port, listening)
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


# --- server mode ---------------------------------------------------------------------------

BEAT_SECONDS = 2.0


def _check_server_mode() -> None:
    """PostgreSQL and Redis must answer; say which does not, in one line."""
    import redis
    from django.db import OperationalError, connection

    try:
        connection.ensure_connection()
    except OperationalError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(f"PostgreSQL does not answer ({_describe_database()}): {first}") from None
    try:
        redis.Redis.from_url(settings.REDIS_URL or "", socket_timeout=3).ping()
    except redis.RedisError as exc:
        where = mask_url(settings.REDIS_URL or "")
        raise UserError(f"Redis does not answer at {where}: {exc}") from None


def start_api(args: argparse.Namespace) -> int:
    """Server mode's web process: /v1, the admin and the enrolment listener. Scheduling
    runs on the workers."""
    from capyctl.bootstrap import migrate_database

    host, port = parse_listen(args.listen)
    _check_server_mode()
    _check_port_free(host, port)
    allow_listen_host(host)
    migrate_database(at_start=True, migrate=args.migrate)
    listening = _listen(host, port)
    enrolment = _serve_enrolment(args.enrol_listen) if args.enrol_listen else None
    print(f"CapyCTL {_version()} api, serving on {_url(host, port)}", flush=True)
    try:
        return _serve_uvicorn(host, port, listening)
    finally:
        if enrolment is not None:
            enrolment.should_exit = True


def start_worker(args: argparse.Namespace) -> int:
    """A Celery worker: carries out starts, parks, wakes, stops and reconciles."""
    from capyctl.celery import app

    _check_server_mode()
    name = f"capyctl-{os.getpid()}@%h"
    app.worker_main(  # runs until SIGTERM, then exits the process
        ["worker", "--pool=threads", f"--concurrency={args.concurrency}", f"--hostname={name}",
         "--loglevel=WARNING", "--without-gossip", "--without-mingle"]
    )  # fmt: skip


def start_server(args: argparse.Namespace) -> int:
    """Server mode in one command: the api and worker processes, supervised (one that
    dies is started again), and the periodic pass over the hosts."""
    import subprocess
    import threading

    import redis

    from capyctl.bootstrap import ensure_first_admin, migrate_database

    host, port = parse_listen(args.listen)
    _check_server_mode()
    _check_port_free(host, port)
    _warn_if_open(Path(settings.DATA_DIR))
    upgrade = migrate_database(at_start=True, migrate=args.migrate)
    admin = ensure_first_admin()
    base = _url(host, port)
    serving.claim(Path(settings.DATA_DIR), mode="server", url=base)  # for `capyctl status`
    print(f"CapyCTL {_version()} server, serving on {base}", flush=True)
    print(f"  database:  {_describe_database()}", flush=True)
    for line in _upgrade_lines(upgrade):
        print(line, flush=True)
    print(f"  redis:     {mask_url(settings.REDIS_URL or '')}", flush=True)
    print(f"  workers:   {args.workers} process(es)", flush=True)
    if admin.created and admin.password_file is not None:
        print(f"  log in as: {admin.username} / {admin.password}", flush=True)
    print("Stop with Ctrl-C.", flush=True)
    entry = [sys.executable, "-c", "from capyctl.cli import main; main()", "start"]
    api = [*entry, "api", "--listen", args.listen]
    if args.enrol_listen:
        api += ["--enrol-listen", args.enrol_listen]
    commands = {"api": api} | {f"worker-{i}": [*entry, "worker"] for i in range(args.workers)}
    stopping = threading.Event()
    previous = {sig: signal.signal(sig, lambda signum, frame: stopping.set())
                for sig in (signal.SIGTERM, signal.SIGINT)}  # fmt: skip
    children = {name: subprocess.Popen(argv) for name, argv in commands.items()}
    beat = redis.Redis.from_url(settings.REDIS_URL or "", socket_timeout=3)
    try:
        while not stopping.wait(BEAT_SECONDS):
            for name, child in list(children.items()):
                if child.poll() is not None:
                    logger.warning("%s exited with status %s; starting it again", name,
                                   child.returncode)  # fmt: skip
                    children[name] = subprocess.Popen(commands[name])
            _beat(beat)
    finally:
        for child in children.values():
            child.terminate()
        for child in children.values():
            try:
                child.wait(timeout=GRACEFUL_SHUTDOWN_SECONDS + 5)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


def _beat(beat: Any) -> None:
    """The supervisor's periodic pass: say the server is alive, poll and reconcile the
    hosts (on a worker), and send again any operation whose message was lost."""
    from datetime import timedelta

    from capyctl.scheduler import tasks
    from capyctl.scheduler.executor import SERVER_ALIVE_KEY, pending_operations

    try:
        beat.set(SERVER_ALIVE_KEY, "1", ex=15)
        tasks.poll_hosts.delay()
        for op_id in pending_operations(older_than=timedelta(seconds=BEAT_SECONDS)):
            tasks.run_operation.delay(op_id)
    except Exception as exc:  # the supervisor outlives a Redis or database hiccup
        from capyctl.scheduler.errors import is_control_plane_error

        if not is_control_plane_error(exc):
            logger.exception("server beat failed")
        else:  # one line a beat, not a traceback every two seconds of an outage
            logger.warning("server beat skipped: %s: %s", type(exc).__name__, exc)


def _version() -> str:
    from capyctl import __version__

    return __version__


def _serve_uvicorn(host: str, port: int, listening: socket.socket) -> int:
    import uvicorn

    from capyctl.cli.httpguard import bounds_from_settings, guarded_protocol

    config = uvicorn.Config(
        "capyctl.asgi:application",
        host=host,
        port=port,
        loop="uvloop",
        # Head and body deadlines, the per-address cap, and the connection cap with its
        # share kept for keys (the protocol keeps it: limit_concurrency would not know
        # a key).
        http=guarded_protocol(bounds_from_settings(settings.CAPYCTL)),
        limit_concurrency=None,
        timeout_keep_alive=settings.CAPYCTL["HTTP_KEEPALIVE_TIMEOUT"],
        backlog=LISTEN_BACKLOG,
        lifespan="on",
        access_log=False,
        proxy_headers=False,  # one ASGI layer less a request; CapyCTL logs no client address
        log_level=settings.LOG_LEVEL.lower(),
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_SECONDS,
        server_header=False,
    )

    class Server(uvicorn.Server):
        """uvicorn on the socket bound before the banner; it says when it serves, as it does
        on a socket of its own (given sockets, it would say nothing)."""

        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets)
            if self.started and sockets:
                self._log_started_message(sockets)

        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            from capyctl.gateway.app import gateway

            gateway.stopping()  # requests waiting for a wake are answered, not cut
            await super().shutdown(sockets)

    server = Server(config)
    # uvicorn re-raises the signal that stopped it once it has shut down; with SIGTERM's
    # default action that would end the process before the engines are stopped. A no-op
    # handler lets run() return, and the caller finishes the shutdown.
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        server.run(sockets=[listening])
    finally:
        signal.signal(signal.SIGTERM, previous)
        listening.close()
    return 0 if server.started else 1


def _serve_daphne(host: str, port: int) -> int:
    """daphne (Twisted) reads a whole request, body included, into a temporary file
    before the application sees it, and caps nothing per address: the bounds of
    capyctl.cli.httpguard (and the body limits, which come too late here) are uvicorn's
    only. Guarding Twisted's own HTTP would be a server of its own; it stays an
    alternative for loopback."""
    from daphne.cli import CommandLineInterface

    print(
        "capyctl: warning: daphne has no deadline for slow request bodies, no cap per "
        "client address and reads whole bodies to disk; serve with uvicorn (the default) "
        "where others can reach it",
        file=sys.stderr,
        flush=True,
    )

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
