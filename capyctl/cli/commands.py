"""Handlers of the management commands: engines, deployments, keys, users, status.

Each handler calls the service layer; it only parses, prints and picks exit codes.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any, cast

from django.conf import settings

from capyctl.cli.output import print_json, print_table
from capyctl.errors import UserError
from hostagent.units import format_size

if TYPE_CHECKING:
    from capyctl.bootstrap import AdminAccount


def prepare(*, announce: bool = True) -> AdminAccount:
    """Bring the database up to date and make sure the standalone host and admin exist
    (``announce``: say so when the admin account is made now); returns the admin."""
    from capyctl.bootstrap import ensure_first_admin, migrate_database
    from capyctl.reports import local_host_registered

    migrate_database()
    if settings.MODE == "standalone" and not local_host_registered():
        from capyctl.scheduler.host_states import ensure_local_host
        from hostagent.probe import read_inventory

        ensure_local_host(
            read_inventory(settings.CAPYCTL["SIM_GPUS"], settings.CAPYCTL["SIM_STATE_DIR"])
        )
    admin = ensure_first_admin()
    if admin.created and announce:
        where = f" (password in {admin.password_file})" if admin.password_file else ""
        print(f"capyctl: created the first admin account 'admin'{where}", file=sys.stderr)
    return admin


def init(args: argparse.Namespace) -> int:
    """Make the data dir, its database and the first admin account, as a first start does,
    and say where; a data dir made already is left as it is."""
    from capyctl.cli.start import _describe_database

    admin = prepare(announce=False)
    if not admin.created:
        print(f"the data dir {settings.DATA_DIR} is made already (admin account "
              f"'{admin.username}'): nothing changed")  # fmt: skip
        return 0
    print(f"made the data dir {settings.DATA_DIR}")
    print(f"  database:  {_describe_database()}")
    if admin.password_file is not None:
        print(f"  log in as: {admin.username} / {admin.password} (also in {admin.password_file})")
    else:
        print(f"  log in as: {admin.username} (password from CAPYCTL_ADMIN_PASSWORD)")
    return 0


def _actor() -> str:
    return "cli"


# --- engines -----------------------------------------------------------------------------


def engine_add(args: argparse.Namespace) -> int:
    from capyctl.engines.services import add_engine

    env: dict[str, str] = {}
    for item in args.env:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise UserError(f"invalid --env {item!r}: use NAME=VALUE")
        env[name] = value
    options = None
    if args.options:
        try:
            options = json.loads(args.options)
        except json.JSONDecodeError as exc:
            raise UserError(f"invalid --options: not JSON ({exc.msg} at {exc.pos})") from None
        if not isinstance(options, dict):
            raise UserError("invalid --options: it must be a JSON object")
    prepare()
    engine = add_engine(
        args.name,
        kind=args.kind,
        command=args.command,
        host=args.host,
        env=env,
        options=options,
        actor=_actor(),
    )
    print(f"engine {engine.name} added ({engine.kind}: {engine.command})")
    from capyctl.deployments.problems import missing_program

    program = missing_program(engine)
    if program is not None:
        _warn(
            f"engine {engine.name}: its program {program} is not found on this host; its "
            "models cannot start until it is installed"
        )
    return 0


def _warn(message: str) -> None:
    """A setup stored that cannot work yet: one line, and the command still succeeds."""
    sys.stdout.flush()  # after what the command printed, where both go to one place
    print(f"capyctl: warning: {message}", file=sys.stderr)


def engine_list(args: argparse.Namespace) -> int:
    from capyctl.reports import all_engines, engine_data

    prepare()
    engines = [engine_data(e) for e in all_engines()]
    if args.json:
        print_json(engines)
    else:
        rows = [
            [e["name"], e["kind"], e["host"] or "(any)", e["parks"], _version(e), e["command"]]
            for e in engines
        ]
        print_table(
            ["name", "kind", "host", "parks", "version", "command"], rows, empty="no engines"
        )
    return 0


def _version(engine: dict[str, Any]) -> str:
    """The engine's version, or "unknown" where no host has read it yet."""
    return str(engine["version"] or "unknown")


def engine_remove(args: argparse.Namespace) -> int:
    from capyctl.engines.services import remove_engine

    prepare()
    remove_engine(args.name, actor=_actor())
    print(f"engine {args.name} removed")
    return 0


# --- deployments -------------------------------------------------------------------------


# The settings flags whose value is a spec field as it is, by namespace name.
_PLAIN_SETTINGS = {
    "gpus": "gpus",
    "park": "park",
    "idle_park_seconds": "idle_park_seconds",
    "min_ready_seconds": "min_ready_seconds",
    "max_waiting": "max_waiting",
    "max_queue_seconds": "max_queue_seconds",
    "max_turn_seconds": "max_turn_seconds",
    "wake_timeout": "wake_timeout_seconds",
    "start_timeout": "start_timeout_seconds",
    "drain_timeout": "drain_timeout_seconds",
    "priority": "priority",
    "pinned": "pinned",
    "over_claim": "over_claim",
    "weights_size": "weights_bytes",
    "max_tokens_ceiling": "max_tokens_ceiling",
    "n_ceiling": "n_ceiling",
    "best_of_ceiling": "best_of_ceiling",
}


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    """The spec fields the settings flags give (with ``update``: only those given)."""
    from capyctl.validation import parse_gpu_memory, split_engine_args

    given = vars(args)
    fields = {spec: given[flag] for flag, spec in _PLAIN_SETTINGS.items() if flag in given}
    if "gpu_memory" in given:
        gpu_memory = given["gpu_memory"]
        bytes_, fraction = parse_gpu_memory(gpu_memory) if gpu_memory else (None, None)
        fields["gpu_memory_bytes"], fields["gpu_memory_fraction"] = bytes_, fraction
    if "args" in given:
        fields["engine_args"] = split_engine_args(given["args"])
    if "media_domains" in given:
        text = given["media_domains"].strip()
        fields["media_domains"] = (
            [] if text in ("", "none") else [d.strip() for d in text.split(",") if d.strip()]
        )
    return fields


def deployment_add(args: argparse.Namespace) -> int:
    from capyctl.deployments.services import DeploymentSpec, add_deployment

    spec = DeploymentSpec(
        name=args.name,
        engine=args.engine,
        source=args.source,
        aliases=list(args.alias),
        host=args.host,
        **_settings(args),
    )
    prepare()
    deployment = add_deployment(spec, actor=_actor())
    sizes = _sizes_text(deployment, ("gpu_memory_bytes", "weights_bytes"))
    print(
        f"deployment {deployment.name} added (engine {deployment.engine.name}, desired running"
        + (f"; {sizes})" if sizes else ")")
    )
    from capyctl.deployments.problems import never_fits, program_problem

    too_big = never_fits(deployment)
    if too_big is not None:
        _warn(f"{too_big}, so it cannot start until a host with room for it joins")
    program = program_problem(deployment)
    if program is not None:
        _warn(f"{program}; {deployment.name} cannot start until it is installed")
    return 0


def _sizes_text(deployment: Any, fields: Any) -> str:
    """The sizes a deployment stored, in GiB as listings show them (``16GB`` is 14.9 GiB)."""
    parts = []
    if "gpu_memory_bytes" in fields or "gpu_memory_fraction" in fields:
        if deployment.gpu_memory_bytes is not None:
            parts.append(f"gpu memory {format_size(deployment.gpu_memory_bytes)} per GPU")
        elif deployment.gpu_memory_fraction is not None:
            parts.append(f"gpu memory {deployment.gpu_memory_fraction:g} of each GPU")
    if "weights_bytes" in fields and deployment.weights_bytes is not None:
        parts.append(f"weights copy {format_size(deployment.weights_bytes)}")
    return ", ".join(parts)


def deployment_update(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from capyctl.deployments.services import get_deployment, spec_of, update_deployment

    changes = _settings(args)
    if not changes:
        raise UserError("nothing to change: give at least one setting flag (see --help)")
    prepare()
    current = get_deployment(args.name)
    deployment = update_deployment(
        current.name, replace(spec_of(current), **changes), actor=_actor()
    )
    sizes = _sizes_text(deployment, changes)
    print(
        f"deployment {deployment.name} updated: {', '.join(sorted(changes))}"
        + (f" ({sizes})" if sizes else "")
    )
    return 0


def _memory_text(data: dict[str, object]) -> str:
    if data["gpu_memory_bytes"] is not None:
        return format_size(int(data["gpu_memory_bytes"]))  # type: ignore[call-overload]
    if data["gpu_memory_fraction"] is not None:
        return f"{data['gpu_memory_fraction']:g} of GPU"
    return "estimate"


def _copy_text(data: dict[str, object]) -> str:
    """The weights copy a ram park promises: measured against declared, where known."""
    declared, measured = data["weights_bytes"], data["measured_weights_bytes"]
    if measured is None:
        return f"{format_size(int(declared))} declared" if declared is not None else "-"  # type: ignore[call-overload]
    text = f"{format_size(int(measured))} measured"  # type: ignore[call-overload]
    return text + (f" ({format_size(int(declared))} declared)" if declared is not None else "")  # type: ignore[call-overload]


def deployment_list(args: argparse.Namespace) -> int:
    from capyctl.reports import all_deployments, deployment_data

    prepare()
    deployments = [deployment_data(d) for d in all_deployments()]
    if args.json:
        print_json(deployments)
        return 0
    rows = [
        [
            d["name"],
            ",".join(d["aliases"]),
            d["engine"],
            d["host"] or "(auto)",
            d["desired_state"],
            d["observed_state"] + (f" ({d['parked_mode']})" if d["parked_mode"] else ""),
            _memory_text(d),
            _copy_text(d),
            d["park"] + (" pinned" if d["pinned"] else ""),
        ]
        for d in deployments
    ]
    headers = ["name", "aliases", "engine", "host", "desired", "state", "gpu memory", "ram copy",
               "park"]  # fmt: skip
    print_table(headers, rows, empty="no deployments")
    return 0


def deployment_remove(args: argparse.Namespace) -> int:
    from capyctl.deployments.services import remove_deployment

    prepare()
    remove_deployment(args.name, actor=_actor())
    print(f"deployment {args.name} removed (model files left in place)")
    return 0


# --- status ------------------------------------------------------------------------------


def status(args: argparse.Namespace) -> int:
    from capyctl.reports import status_data

    prepare()
    data = status_data()
    server, server_line = _server_serving()
    data["server"] = server
    if not server["running"]:
        for host in data["hosts"]:  # nobody drives them now: what was seen, and when
            host["last_known_state"], host["state"] = host["state"], "unknown"
    if args.json:
        print_json(data)
        return 0
    print(f"mode: {data['mode']}")
    print(f"server: {server_line}")
    plane = data["control_plane"]
    if plane["redis"] == "down":
        since = f" since {plane['since']}" if plane["since"] else ""
        print(f"redis: DOWN{since}: ready models answer; switches wait or are refused")
    elif plane["redis"] == "ok":
        print("redis: ok")
    for host in data["hosts"]:
        gpus = ", ".join(f"{g['name']} {format_size(g['total_bytes'])}" for g in host["gpus"])
        print(
            f"\nhost {host['name']} ({_host_state_text(host)}; probe {host['probe']}; measures "
            f"{host['measures'] or '-'}): {gpus or 'no GPUs'}"
        )
        rows = [
            [
                p["pool"],
                format_size(p["capacity_bytes"]),
                format_size(p["held_bytes"]),
                format_size(p["promised_bytes"]),
                format_size(p["unconfirmed_bytes"]),
                format_size(p["foreign_bytes"]),
                format_size(p["free_bytes"]),
            ]
            for p in host["pools"]
        ]
        headers = ["pool", "capacity", "held", "promised", "unconfirmed", "foreign", "free"]
        print_table(headers, rows, empty="  (no pools reported yet)")
    print()
    deployment_rows = [
        [
            d["name"],
            d["engine"],
            d["host"] or "(auto)",
            d["desired_state"],
            d["observed_state"] + (f" ({d['parked_mode']})" if d["parked_mode"] else ""),
            _memory_text(d),
            d["problem"] or d["state_reason"],
        ]
        for d in data["deployments"]
    ]
    headers = ["deployment", "engine", "host", "desired", "state", "gpu memory", "reason"]
    print_table(headers, deployment_rows, empty="no deployments")
    if data["queues"]:
        print("\nwaiting:")
    for queue in data["queues"]:
        line = f"  {queue['model']}: {queue['waiting']} request(s)"
        if queue["waiting_for_room_seconds"] is not None:
            line += f"; for room {queue['waiting_for_room_seconds']:.0f} s"
            if queue["holders"]:
                line += f", while {', '.join(queue['holders'])} hold(s) its GPUs (a turn)"
        print(line)
    active = sum(1 for k in data["keys"] if k["active"])
    print(f"\nengines: {len(data['engines'])}   keys: {active} active of {len(data['keys'])}")
    return 0


def _server_serving() -> tuple[dict[str, Any], str]:
    """Whether a server serves this data dir now (its ``server.pid``), and since when, as
    data and as a line; in server mode, an api and workers started apart beat in Redis."""
    from pathlib import Path

    from capyctl.cli.serving import serving

    found = serving(Path(settings.DATA_DIR))
    if found is not None:
        line = f"serving this data dir since {found.since_text()} (pid {found.pid})"
        return found.as_dict(), line
    if settings.MODE == "server":
        from capyctl.scheduler.errors import ControlPlaneUnavailableError
        from capyctl.scheduler.executor import server_alive

        try:
            if server_alive():
                data = {"running": True, "pid": None, "since": None, "mode": "server", "url": ""}
                return data, "running (its supervisor beats in Redis)"
        except ControlPlaneUnavailableError:
            pass  # Redis is down: the redis line says so
    data = {"running": False, "pid": None, "since": None, "mode": None, "url": ""}
    return data, "not running (the hosts show their last known state)"


def _host_state_text(host: dict[str, Any]) -> str:
    """``online``; or, with no server running, ``state unknown, last seen … (online)``."""
    if "last_known_state" not in host:
        return str(host["state"])
    if not host["last_seen_at"]:
        return "state unknown, never seen"
    from datetime import datetime

    seen = datetime.fromisoformat(host["last_seen_at"]).astimezone()
    return f"state unknown, last seen {seen:%Y-%m-%d %H:%M:%S} ({host['last_known_state']})"


# --- intents ------------------------------------------------------------------------------


def deployment_action(args: argparse.Namespace) -> int:
    """start/stop/park/wake: saved as an operation, carried out by the running server."""
    from capyctl.deployments.services import get_deployment
    from capyctl.scheduler.actions import default_timeout, request_action, seconds_taken

    prepare()
    deployment = get_deployment(args.name)
    op = request_action(
        deployment, args.action, mode=getattr(args, "mode", None) or "", actor="cli"
    )
    if op is None:
        desired = "running" if args.action == "start" else "stopped"
        print(
            f"{deployment.name}: desired state {desired}; no CapyCTL server is running on "
            "this data dir, so it takes effect when one runs"
        )
        return 0
    timeout = args.timeout or default_timeout(deployment)
    op = _wait_showing_downloads(op, deployment.pk, timeout)
    if op.status == "done":
        print(f"{op.message} ({seconds_taken(op):.1f}s)")
        return 0
    if op.status == "failed":
        print(f"capyctl: error: {op.message}", file=sys.stderr)
        return 1
    print(
        f"capyctl: error: {args.action} {deployment.name} did not finish in {timeout:g}s; "
        "it goes on in the server (see 'capyctl events')",
        file=sys.stderr,
    )
    return 1


def _wait_showing_downloads(op: Any, deployment_id: int, timeout: float) -> Any:
    """Wait for the operation; while its model downloads, draw a progress bar on stderr
    (a line per quarter when stderr is not a terminal). Download time does not count
    against the timeout."""
    import time

    from capyctl.deployments.services import download_state
    from capyctl.scheduler.actions import wait_for
    from capyctl.scheduler.fetching import describe
    from hostagent.sources import FetchStatus

    deadline = time.monotonic() + timeout
    tty = sys.stderr.isatty()
    shown, quarter = False, -1
    while True:
        op = wait_for(op, min(0.5, max(deadline - time.monotonic(), 0)))
        if op.status in ("done", "failed") or time.monotonic() >= deadline:
            break
        state, download = download_state(deployment_id)
        if state != "downloading" or not download:
            continue
        deadline = time.monotonic() + timeout  # downloading: the clock waits
        status = FetchStatus.from_dict(download)
        if not status.done_bytes and not status.total_bytes:
            continue  # not started yet: nothing to draw
        share = status.done_bytes / status.total_bytes if status.total_bytes else 0.0
        if tty:
            bar = "#" * int(share * 30)
            print(f"\rdownloading [{bar:<30}] {share:4.0%} {describe(status)}   ",
                  end="", file=sys.stderr, flush=True)  # fmt: skip
            shown = True
        elif int(share * 4) > quarter:
            quarter = int(share * 4)
            print(f"downloading: {describe(status)}", file=sys.stderr, flush=True)
    if shown or quarter >= 0:
        _, data = download_state(deployment_id)
        if data and data.get("state") == "done":
            done = FetchStatus.from_dict(data)
            prefix = "\rdownloading [" + "#" * 30 + "] 100% " if tty else ""
            print(f"{prefix}downloaded {describe(done)}", file=sys.stderr, flush=True)
        elif shown:
            print(file=sys.stderr)
    return op


def _print_event(row: dict[str, object], as_json: bool) -> None:
    if as_json:
        print(json.dumps(row), flush=True)
        return
    took = f" ({row['duration_ms']} ms)" if row["duration_ms"] is not None else ""
    when = str(row["time"])[:19].replace("T", " ")
    print(
        f"{when}  {str(row['level']).upper():7} {row['kind']:24} {row['message']}{took}", flush=True
    )


def events(args: argparse.Namespace) -> int:
    import time

    from capyctl.events.services import events_after, latest_events
    from capyctl.reports import event_data

    prepare()
    newest = latest_events(args.limit, subject=args.model)
    rows = [event_data(e) for e in newest]
    if args.json and not args.follow:
        print_json(rows)
        return 0
    for row in rows:
        _print_event(row, args.json)
    last_id = newest[-1].pk if newest else 0
    while args.follow:
        time.sleep(0.5)
        for event in events_after(last_id, subject=args.model):
            _print_event(event_data(event), args.json)
            last_id = event.pk
    return 0


# --- hosts -------------------------------------------------------------------------------


def host_add(args: argparse.Namespace) -> int:
    from capyctl.hosts.services import add_host

    prepare()
    host, token = add_host(args.name, args.address)
    print(f"host {host.name} added ({host.address}); on that machine, within the hour, run:")
    print(f"  capyctl start host --listen {host.address} --join {token}")
    return 0


def host_token(args: argparse.Namespace) -> int:
    from capyctl.hosts.services import get_host, new_join_token

    prepare()
    host = get_host(args.name)
    if host.is_local:
        raise UserError(f"{host.name!r} is the in-process host; it does not join", field="name")
    print(new_join_token(host))
    return 0


def host_list(args: argparse.Namespace) -> int:
    from capyctl.reports import all_hosts

    prepare()
    hosts = [
        {
            "name": h.name,
            "address": h.address or "(in-process)",
            "state": h.state,
            "gpus": [g["name"] for g in (h.inventory or {}).get("gpus") or []],
            "measures": h.measures,
            "joined": h.is_local or bool(h.cert_fingerprint),  # revoked: no longer
            "last_seen_at": h.last_seen_at.isoformat() if h.last_seen_at else None,
            "cert_expires_at": h.cert_expires_at.isoformat() if h.cert_expires_at else None,
        }
        for h in all_hosts()
    ]
    if args.json:
        print_json(hosts)
    else:
        rows = [
            [h["name"], h["address"], h["state"], "yes" if h["joined"] else "no",
             h["measures"] or "-", ", ".join(cast("list[str]", h["gpus"])) or "-"]
            for h in hosts
        ]  # fmt: skip
        headers = ["name", "address", "state", "joined", "measures", "gpus"]
        print_table(headers, rows, empty="no hosts")
    return 0


def host_remove(args: argparse.Namespace) -> int:
    from capyctl.scheduler.host_states import remove_host

    prepare()
    remove_host(args.name)
    print(f"host {args.name} removed")
    return 0


def host_revoke(args: argparse.Namespace) -> int:
    from capyctl.scheduler.host_states import revoke_host

    prepare()
    host = revoke_host(args.name, actor="cli")
    print(f"host {host.name}: certificate revoked; calls to its agent are refused from now on")
    print(f"  to let it join again: capyctl host token {host.name}")
    return 0


# --- the model cache ----------------------------------------------------------------------


def _cache_hosts(name: str | None) -> list[Any]:
    from capyctl.hosts.services import get_host
    from capyctl.reports import all_hosts

    if name:
        return [get_host(name)]
    return all_hosts()


def _cache_call(host: Any, call: str, *args: Any) -> list[dict[str, object]]:
    """``downloads`` or ``prune`` on a host: the local cache directly, another through
    its agent."""
    if host.is_local:  # this data dir's cache, read directly (no engines involved)
        from pathlib import Path

        from hostagent.sources import SourceCache

        cache = SourceCache(Path(settings.DATA_DIR) / "models")
        return cache.listing() if call == "downloads" else cache.prune_listing(*args)
    from capyctl.scheduler.remote_hosts import AgentUnreachableError, RemoteHostDriver

    try:
        return list(getattr(RemoteHostDriver(host), call)(*args))
    except AgentUnreachableError as exc:
        raise UserError(str(exc), field="host") from None


def cache_list(args: argparse.Namespace) -> int:
    prepare()
    rows: list[dict[str, object]] = []
    for host in _cache_hosts(args.host):
        rows += [{"host": host.name, **d} for d in _cache_call(host, "downloads")]
    if args.json:
        print_json(rows)
    else:
        table = [[r["host"], r["source"], format_size(cast("int", r["bytes"])), r["path"]]
                 for r in rows]  # fmt: skip
        print_table(["host", "source", "size", "path"], table, empty="no downloads")
    return 0


def cache_prune(args: argparse.Namespace) -> int:
    """Remove downloads that no deployment names; a local path is never a download."""
    from capyctl.deployments.services import fetched_sources

    prepare()
    keep = fetched_sources()
    rows: list[dict[str, object]] = []
    for host in _cache_hosts(args.host):
        rows += [{"host": host.name, **d} for d in _cache_call(host, "prune", keep, args.dry_run)]
    if args.json:
        print_json(rows)
        return 0
    verb = "would remove" if args.dry_run else "removed"
    for row in rows:
        size = format_size(cast("int", row["bytes"]))
        print(f"{verb} {row['source']} on {row['host']}: {size} at {row['path']}")
    total = format_size(sum(cast("int", r["bytes"]) for r in rows))
    print(f"{verb} {len(rows)} download(s), {total}" if rows else "nothing to remove")
    return 0
