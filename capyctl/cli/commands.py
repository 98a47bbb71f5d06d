"""Handlers of the management commands: engines, deployments, keys, users, status.

Each handler calls the service layer; it only parses, prints and picks exit codes.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any

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


# --- adapters ----------------------------------------------------------------------------


def adapter_add(args: argparse.Namespace) -> int:
    from capyctl.deployments.adapters import add_adapter
    from capyctl.scheduler.intents import restart_to_take

    prepare()
    adapter = add_adapter(args.name, args.base, args.source, actor=_actor())
    restart = restart_to_take(adapter, actor=_actor())
    print(f"adapter {adapter.name} added on {adapter.base.name} (" + (restart or
          "loaded when first asked for") + ")")  # fmt: skip
    return 0


def adapter_list(args: argparse.Namespace) -> int:
    from capyctl.reports import adapter_data, all_adapters

    prepare()
    adapters = [adapter_data(a) for a in all_adapters()]
    if args.json:
        print_json(adapters)
    else:
        rows = [[a["name"], a["base"], a["state"], ",".join(a["loaded_on"]) or "-", a["source"]]
                for a in adapters]  # fmt: skip
        print_table(["name", "base", "state", "loaded in", "source"], rows, empty="no adapters")
    return 0


def adapter_remove(args: argparse.Namespace) -> int:
    from capyctl.deployments.adapters import remove_adapter

    prepare()
    remove_adapter(args.name, actor=_actor())
    print(f"adapter {args.name} removed")
    return 0


# --- deployments -------------------------------------------------------------------------


def _plain_settings() -> dict[str, str]:
    """The settings flags whose value is a spec field as it is: spec field by namespace
    name (each declared setting's flag, and ``--weights-size``)."""
    from capyctl.deployments.settings_spec import SETTINGS

    return {
        "weights_size": "weights_bytes",
        **{s.dest: s.name for s in SETTINGS if s.on_cli and s.low_part is None},
    }


def _ranges() -> dict[str, tuple[str, str]]:
    """The flags that take ``N`` or ``LOW:N`` (``--replicas``): the spec fields of N and of
    LOW, by namespace name."""
    from capyctl.deployments.settings_spec import SETTINGS

    return {s.dest: (s.name, s.low_part) for s in SETTINGS if s.low_part is not None}


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    """The spec fields the settings flags give (with ``update``: only those given)."""
    from capyctl.validation import parse_gpu_memory, split_engine_args

    given = vars(args)
    fields = {spec: given[flag] for flag, spec in _plain_settings().items() if flag in given}
    for flag, (high_field, low_field) in _ranges().items():
        if flag in given:  # (LOW, N) given; N alone, its declared default, when not
            value = given[flag]
            low, high = value if isinstance(value, tuple) else (0, value)
            fields[low_field], fields[high_field] = low, high
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


def deployment_scale(args: argparse.Namespace) -> int:
    """``deployment update NAME --replicas N|MIN:MAX``, said in one word."""
    from dataclasses import replace

    from capyctl.deployments.services import get_deployment, spec_of, update_deployment

    prepare()
    current = get_deployment(args.name)
    before = _replicas_text(current.min_replicas, current.replicas)
    low, high = args.replicas
    deployment = update_deployment(
        current.name,
        replace(spec_of(current), replicas=high, min_replicas=low),
        actor=_actor(),
    )
    after = _replicas_text(deployment.min_replicas, deployment.replicas)
    print(f"deployment {deployment.name}: {before} -> {after} replicas")
    return 0


def _replicas_text(low: int, high: int) -> str:
    """How many replicas a deployment wants: ``3``, or ``1:3`` scaled by load."""
    return f"{low}:{high}" if 0 < low < high else str(high)


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
    if any(d["replicas"] > 1 for d in deployments):  # shown where a model has several
        headers.insert(6, "replicas")
        for row, d in zip(rows, deployments, strict=True):
            ready = sum(1 for r in d["replica_set"] if r["observed_state"] == "ready")
            row.insert(6, f"{ready}/{_replicas_text(d['min_replicas'], d['replicas'])}")
    print_table(headers, rows, empty="no deployments")
    return 0


def deployment_remove(args: argparse.Namespace) -> int:
    from capyctl.deployments.services import remove_deployment

    prepare()
    remove_deployment(args.name, actor=_actor())
    print(f"deployment {args.name} removed (model files left in place)")
    return 0


# --- intents ------------------------------------------------------------------------------


def deployment_action(args: argparse.Namespace) -> int:
    """start/stop/park/wake: saved as an operation, carried out by the running server."""
    from capyctl.deployments.services import get_deployment
    from capyctl.scheduler.intents import default_timeout, request_action, seconds_taken

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
    timeout = args.timeout or default_timeout(deployment) * (
        deployment.replicas if args.action == "restart" else 1
    )
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
    from capyctl.scheduler.fetching import describe
    from capyctl.scheduler.intents import wait_for
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
