"""The argument parser of ``capyctl`` (DESIGN §10)."""

from __future__ import annotations

import argparse
from typing import Any

from capyctl.cli.parser_people import build_budget, build_key, build_team, build_usage, build_user
from capyctl.cli.parsing import (
    Parser,
    add_json,
    cmd,
    count_arg,
    price_arg,
    range_arg,
    size_arg,
)

# Plain Python: parsing stays Django-free.
from capyctl.deployments import settings_spec
from capyctl.deployments.settings_spec import CHOICE, FLAG, PRICE, SETTING, Setting


def build_parser() -> Parser:
    from capyctl import __version__

    parser = Parser(
        prog="capyctl",
        description="Run many LLMs on few GPUs behind one OpenAI-compatible endpoint.",
    )
    parser.add_argument("--version", action="version", version=f"capyctl {__version__}")
    parser.add_argument(
        "--data-dir",
        metavar="DIR",
        help="data directory (default: $CAPYCTL_DATA_DIR or ./.capyctl)",
    )
    commands = parser.add_subparsers(title="commands", metavar="COMMAND", parser_class=Parser)

    _build_start(commands)
    _build_engine(commands)
    _build_deployment(commands)
    _build_adapter(commands)
    build_key(commands)
    build_user(commands)
    build_team(commands)
    build_budget(commands)
    build_usage(commands)
    _build_host(commands)
    _build_cache(commands)
    _build_trace(commands)
    _build_simulate(commands)
    _build_backup(commands)
    _build_service(commands)

    init = cmd(commands, "init", "make a data dir and its admin account, as a first start does",
                "init")  # fmt: skip
    init.set_defaults(makes_data_dir=True)
    init.add_argument("--data-dir", metavar="DIR", default=argparse.SUPPRESS,
                      help="where (default: $CAPYCTL_DATA_DIR or ./.capyctl)")  # fmt: skip
    status = cmd(commands, "status", "hosts, pools, deployments and the ledger", "status")
    add_json(status)
    events = cmd(commands, "events", "what happened, newest last", "events")
    events.add_argument("--follow", "-f", action="store_true", help="keep printing new events")
    events.add_argument("--limit", type=count_arg(1), default=50, metavar="N")
    events.add_argument("--model", metavar="NAME", help="only this deployment's events")
    add_json(events)
    return parser


def _build_start(commands: Any) -> None:
    start = cmd(commands, "start", "run CapyCTL")
    modes = start.add_subparsers(title="modes", metavar="MODE", parser_class=Parser)
    standalone = cmd(
        modes, "standalone", "everything in one process, with SQLite", "start_standalone"
    )
    standalone.set_defaults(run_mode="standalone")
    standalone.add_argument(
        "--listen", metavar="ADDR", default="127.0.0.1:8000", help="HOST:PORT (127.0.0.1:8000)"
    )
    standalone.add_argument(
        "--data-dir",
        metavar="DIR",
        default=argparse.SUPPRESS,
        help="data directory (default: $CAPYCTL_DATA_DIR or ./.capyctl)",
    )
    standalone.add_argument(
        "--server",
        choices=("uvicorn", "daphne"),
        default="uvicorn",
        help="ASGI server (uvicorn; daphne serves about 0.65x its throughput)",
    )
    standalone.add_argument(
        "--enrol-listen",
        metavar="ADDR",
        help="also let hosts join here (HOST:PORT, TLS), e.g. 0.0.0.0:7443",
    )
    standalone.add_argument(
        "--demo",
        action="store_true",
        help="try it without a GPU: a simulated GPU, models and a key, on a data dir of its "
        "own (./.capyctl-demo unless --data-dir is given)",
    )
    server = cmd(modes, "server", "server mode: api and workers (PostgreSQL, Redis)",
                  "start_server")  # fmt: skip
    api = cmd(modes, "api", "server mode's web process only", "start_api")
    for parser in (server, api):
        parser.set_defaults(run_mode="server")
        parser.add_argument(
            "--listen", metavar="ADDR", default="127.0.0.1:8000", help="HOST:PORT (127.0.0.1:8000)"
        )
        parser.add_argument(
            "--enrol-listen", metavar="ADDR", help="where hosts join (HOST:PORT, TLS), e.g. :7443"
        )
    for parser in (standalone, server, api):
        parser.add_argument("--migrate", action="store_true",
                            help="upgrade a PostgreSQL database an earlier version made "
                            "(back it up with pg_dump first)")  # fmt: skip
    server.add_argument("--workers", type=count_arg(1), default=1, metavar="N",
                        help="worker processes to run (1)")  # fmt: skip
    worker = cmd(modes, "worker", "server mode's worker process only", "start_worker")
    worker.set_defaults(run_mode="server")
    worker.add_argument("--concurrency", type=count_arg(1), default=8, metavar="N",
                        help="operations at once (8)")  # fmt: skip
    host = cmd(modes, "host", "the host agent of a GPU machine (mutual TLS)", "start_host")
    host.set_defaults(no_django=True)
    host.add_argument("--join", metavar="TOKEN", help="the token from `capyctl host add` (once)")
    host.add_argument(
        "--listen", metavar="ADDR", default="0.0.0.0:7070", help="HOST:PORT (0.0.0.0:7070)"
    )
    host.add_argument(
        "--data-dir",
        metavar="DIR",
        default=argparse.SUPPRESS,
        help="where the agent keeps its key and certificate (default: ./.capyctl-host)",
    )


def _build_backup(commands: Any) -> None:
    backup = cmd(commands, "backup", "copy the standalone database, even while it serves",
                  "backup")  # fmt: skip
    backup.add_argument("file", nargs="?", metavar="FILE",
                        help="where (default: <data dir>/backups/, the newest 5 kept)")  # fmt: skip
    restore = cmd(commands, "restore", "bring a backup back (with no server running)",
                   "restore")  # fmt: skip
    restore.set_defaults(makes_data_dir=True)  # a backup may be brought back into a new one
    restore.add_argument("file", metavar="FILE")


def _build_service(commands: Any) -> None:
    from capyctl.cli.service import KINDS  # plain Python, like this module

    service = cmd(commands, "service", "run CapyCTL as a systemd service")
    sub = service.add_subparsers(title="actions", metavar="ACTION", parser_class=Parser)
    unit = cmd(sub, "print", "print a hardened systemd unit that runs `capyctl start KIND`",
                "service_print")  # fmt: skip
    unit.set_defaults(no_django=True)  # a GPU machine with the host agent alone prints one
    unit.add_argument("kind", choices=KINDS, metavar="KIND", help=", ".join(KINDS))
    unit.add_argument("--user", default="capyctl",
                      help="the user of its own it runs as (capyctl)")  # fmt: skip
    unit.add_argument("--data-dir", metavar="DIR", default=argparse.SUPPRESS,
                      help="its data dir, the one place it may write (/var/lib/capyctl; "
                      "host: /var/lib/capyctl-host)")  # fmt: skip
    unit.add_argument("--listen", metavar="ADDR",
                      help="HOST:PORT (as capyctl start's default; not for worker)")  # fmt: skip
    unit.add_argument("--enrol-listen", metavar="ADDR",
                      help="where hosts join (standalone, server)")  # fmt: skip
    unit.add_argument("--workers", type=count_arg(1), metavar="N", help="server: worker processes")
    unit.add_argument("--concurrency", type=count_arg(1), metavar="N",
                      help="worker: operations at once")  # fmt: skip
    unit.add_argument("--env-file", metavar="FILE",
                      help="environment file for secrets such as CAPYCTL_DATABASE_URL (server "
                      "and worker: /etc/capyctl/capyctl.env)")  # fmt: skip
    unit.add_argument("--capyctl", metavar="PATH",
                      help="the capyctl program it runs (default: this one)")  # fmt: skip
    unit.add_argument("--protect-home", choices=("yes", "read-only"),
                      help="ProtectHome= (default: yes, or read-only where a path it needs "
                      "is in a home directory)")  # fmt: skip


def _build_host(commands: Any) -> None:
    host = cmd(commands, "host", "GPU machines that run host agents")
    sub = host.add_subparsers(title="actions", metavar="ACTION", parser_class=Parser)
    add = cmd(sub, "add", "register a host and print its one-time join token", "host_add")
    add.add_argument("name")
    add.add_argument("--address", required=True, help="HOST:PORT where its agent listens")
    token = cmd(sub, "token", "print a new join token (the old one stops working)", "host_token")
    token.add_argument("name")
    add_json(cmd(sub, "list", "list hosts", "host_list"))
    remove = cmd(sub, "remove", "forget a host (nothing may use it)", "host_remove")
    remove.add_argument("name")
    revoke = cmd(sub, "revoke", "stop trusting a host's certificate, at once", "host_revoke")
    revoke.add_argument("name")
    drain = cmd(sub, "drain", "place nothing new on a host, and move its models elsewhere",
                 "host_drain")  # fmt: skip
    drain.add_argument("name")
    undrain = cmd(sub, "undrain", "let models be placed on a drained host again",
                   "host_undrain")  # fmt: skip
    undrain.add_argument("name")


def _build_cache(commands: Any) -> None:
    cache = cmd(commands, "cache", "model downloads kept on the hosts")
    sub = cache.add_subparsers(title="actions", metavar="ACTION", parser_class=Parser)
    listing = cmd(sub, "list", "list the downloads on each host", "cache_list")
    listing.add_argument("--host", help="only this host")
    add_json(listing)
    prune = cmd(
        sub, "prune", "remove downloads no deployment uses (never your own files)", "cache_prune"
    )
    prune.add_argument("--host", help="only this host")
    prune.add_argument("--dry-run", action="store_true", help="say what would go; remove nothing")
    add_json(prune)


def _build_trace(commands: Any) -> None:
    trace = cmd(commands, "trace", "what each /v1 request came to (never its body), for replay")
    sub = trace.add_subparsers(title="actions", metavar="ACTION", parser_class=Parser)
    export = cmd(sub, "export", "print the recorded requests as JSON Lines, oldest first",
                  "trace_export")  # fmt: skip
    export.add_argument("--since", metavar="AGE|TIME",
                        help="from this long ago (24h, 30m, 7d) or this ISO time (default: "
                        "the oldest recorded)")  # fmt: skip
    export.add_argument("--until", metavar="AGE|TIME", help="up to then (default: now)")
    export.add_argument("--model", metavar="NAME", help="only this deployment's requests")


def _build_engine(commands: Any) -> None:
    engine = cmd(commands, "engine", "register installed engine programs")
    sub = engine.add_subparsers(title="actions", metavar="ACTION", parser_class=Parser)
    add = cmd(sub, "add", "register an engine", "engine_add")
    add.add_argument("name")
    add.add_argument("--kind", required=True, help="vllm, sglang, llamacpp, tensorfold or custom")
    add.add_argument("--command", required=True, help="the program (custom: a template)")
    add.add_argument("--host", help="the host it is installed on (default: every host)")
    add.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="an environment variable for the engine (repeatable)",
    )
    add.add_argument(
        "--options", metavar="JSON", help="kind-specific settings (custom hooks, engine_downloads)"
    )
    listing = cmd(sub, "list", "list engines", "engine_list")
    add_json(listing)
    remove = cmd(sub, "remove", "remove an engine no deployment uses", "engine_remove")
    remove.add_argument("name")


def _build_adapter(commands: Any) -> None:
    adapter = cmd(commands, "adapter", "LoRA adapters served as models by a base deployment")
    sub = adapter.add_subparsers(title="actions", metavar="ACTION", parser_class=Parser)
    add = cmd(sub, "add", "add an adapter; it loads when first asked for", "adapter_add")
    add.add_argument("name", help="the model name requests use for it")
    add.add_argument(
        "--base",
        required=True,
        metavar="DEPLOYMENT",
        help="the deployment whose engine serves it (given --adapter-slots)",
    )
    add.add_argument(
        "--source",
        required=True,
        help="its files: a local path, hf://ORG/NAME or an http(s) URL#sha256=HEX",
    )
    listing = cmd(sub, "list", "list adapters, their base and where each stands", "adapter_list")
    add_json(listing)
    remove = cmd(sub, "remove", "remove an adapter no engine holds", "adapter_remove")
    remove.add_argument("name")


def _build_deployment(commands: Any) -> None:
    deployment = cmd(commands, "deployment", "models served by engines")
    sub = deployment.add_subparsers(title="actions", metavar="ACTION", parser_class=Parser)
    add = cmd(sub, "add", "add a deployment", "deployment_add")
    add.add_argument("name")
    add.add_argument("--engine", required=True)
    add.add_argument(
        "--source",
        required=True,
        help="a local path, hf://ORG/NAME[@REV], https://…/FILE[#sha256=HEX], "
        "or a name the engine resolves",
    )
    add.add_argument("--alias", action="append", default=[], help="another name (repeatable)")
    add.add_argument("--host", help="pin to this host (default: placed where it fits)")
    _deployment_settings(add, update=False)
    update = cmd(
        sub,
        "update",
        "change a deployment's settings (the flags given; its engine takes new launch "
        "settings at its next start)",
        "deployment_update",
    )
    update.add_argument("name", help="its name or an alias")
    _deployment_settings(update, update=True)
    scale = cmd(
        sub,
        "scale",
        "set how many engines may serve it at once (its --replicas; see docs/replicas.md)",
        "deployment_scale",
    )
    scale.add_argument("name", help="its name or an alias")
    replicas = SETTING["replicas"]
    scale.add_argument(
        "replicas",
        type=range_arg(replicas.least_flag or 1),
        metavar="N|MIN:MAX",
        help=f"replicas, {replicas.minimum} to {replicas.maximum}: N kept up, or MIN kept up "
        "and more brought up by load up to MAX",
    )
    listing = cmd(sub, "list", "list deployments", "deployment_list")
    add_json(listing)
    remove = cmd(sub, "remove", "remove a stopped deployment", "deployment_remove")
    remove.add_argument("name")
    for action, text in (
        ("start", "run it (desired state running) and wait until it is ready"),
        ("stop", "stop it (desired state stopped): requests are refused until started"),
        ("park", "give back its GPU memory now"),
        ("wake", "make it ready now"),
        ("restart", "stop its engines and start them again (new args, an upgraded engine)"),
    ):
        parser = cmd(sub, action, text, "deployment_action")
        parser.add_argument("name")
        parser.set_defaults(action=action)
        if action == "park":
            parser.add_argument(
                "--mode", choices=("ram", "deep"), help="default: the best it allows"
            )
        if action == "restart":
            parser.add_argument(
                "--rolling", dest="mode", action="store_const", const="rolling", default="",
                help="one replica at a time, others kept ready (docs/replicas.md)",
            )  # fmt: skip
        parser.add_argument(
            "--timeout", type=count_arg(1), default=None, metavar="SECONDS", help="how long to wait"
        )


def add_setting_flag(parser: argparse.ArgumentParser, setting: Setting, *, update: bool) -> None:
    """The flag of a declared setting: on ``deployment add`` with its declared default
    (none: the global one); on ``deployment update`` left out of the namespace when not
    given."""
    default = argparse.SUPPRESS if update else setting.default
    if setting.kind == FLAG:
        parser.add_argument(
            setting.flag, action=argparse.BooleanOptionalAction if update else "store_true",
            default=default, help=setting.cli_help(),
        )  # fmt: skip
        return
    if setting.kind == CHOICE:
        parser.add_argument(setting.flag, choices=setting.choices, default=default,
                            metavar=setting.metavar, help=setting.cli_help())  # fmt: skip
        return
    if setting.kind == PRICE:
        parser.add_argument(setting.flag, type=price_arg, metavar=setting.metavar,
                            default=default, help=setting.cli_help())  # fmt: skip
        return
    least = setting.least_flag
    if setting.low_part is not None:
        parser.add_argument(setting.flag, type=range_arg(least or 0), metavar=setting.metavar,
                            default=default, help=setting.cli_help())  # fmt: skip
        return
    parser.add_argument(
        setting.flag, type=int if least is None or least < 0 else count_arg(least),
        metavar=setting.metavar, default=default, help=setting.cli_help(),
    )  # fmt: skip


def _deployment_settings(
    parser: Parser, *, update: bool, settings: tuple[Setting, ...] | None = None
) -> None:
    """The settings ``deployment add`` takes, and ``deployment update`` changes: with
    ``update``, a flag not given is left out of the namespace (and so unchanged). Each
    declared setting has its flag (:func:`add_setting_flag`); ``settings`` None: those
    :data:`capyctl.deployments.settings_spec.SETTINGS` lists now."""

    def default(value: object) -> object:
        return argparse.SUPPRESS if update else value

    unset = default(None)

    parser.add_argument(
        "--gpu-memory", metavar="SIZE", default=unset,
        help="per GPU: 20GiB, or a fraction of the device: 0.9",
    )  # fmt: skip
    parser.add_argument("--weights-size", metavar="SIZE", type=size_arg, default=unset,
                        help="weights copy size")  # fmt: skip
    parser.add_argument("--args", default=default(""), metavar='"ENGINE ARGS"',
                        help="extra engine args")  # fmt: skip
    for setting in settings_spec.SETTINGS if settings is None else settings:
        if setting.on_cli:
            add_setting_flag(parser, setting, update=update)
    parser.add_argument(
        "--media-domains", metavar="HOST,HOST|none", default=default(""),
        help="hosts whose http(s) image, audio and video URLs requests may name "
        "(default none: data: URLs only)",
    )  # fmt: skip


def _build_simulate(commands: Any) -> None:
    simulate = cmd(
        commands,
        "simulate",
        "replay a trace against these settings or other hardware, on a virtual clock",
        "simulate",
    )
    simulate.add_argument("trace", metavar="TRACE", help="a trace file (JSON Lines; - for stdin)")
    simulate.add_argument(
        "--scenario",
        metavar="FILE",
        help="replay against this scenario (capyctl status --json's shape) instead of the "
        "current configuration",
    )
    simulate.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="NAME.FIELD=VALUE",
        help="change a model's setting (NAME * for every model), e.g. chat.min_ready_seconds=30",
    )
    simulate.add_argument(
        "--hosts", metavar="SPEC", help="other hosts instead, e.g. 2x80GiB,1x24GiB (GPUs x size)"
    )
    simulate.add_argument(
        "--compare",
        metavar="SCENARIO",
        help="also replay against this scenario file (or `current`) and show both side by side",
    )
    simulate.add_argument(
        "--warm",
        action="store_true",
        help="models begin as they are now (ready, parked) instead of stopped",
    )
    simulate.add_argument(
        "--timeline", metavar="FILE", help="draw each GPU's occupancy (.png or .svg)"
    )
    simulate.add_argument(
        "--save-scenario", metavar="FILE", help="write the scenario replayed (after --set, --hosts)"
    )
    add_json(simulate)
