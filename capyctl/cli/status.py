"""``capyctl status``: whether a server serves this data dir, the hosts, pools, deployments
and the ledger."""

from __future__ import annotations

import argparse
from typing import Any

from django.conf import settings

from capyctl.cli.commands import _memory_text, prepare
from capyctl.cli.output import print_json, print_table
from hostagent.units import format_size


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
    deployment_rows = []
    for d in data["deployments"]:
        # A deployment of several replicas: a line for each replica past the first.
        for index, r in enumerate([d, *d["replica_set"][1:]]):
            deployment_rows.append(
                [
                    r["name"],
                    d["engine"],
                    _where(d["replica_set"][index], several=len(d["replica_set"]) > 1),
                    d["desired_state"],
                    r["observed_state"] + (f" ({r['parked_mode']})" if r["parked_mode"] else ""),
                    _memory_text(d),
                    (d["problem"] if r is d else "") or r["state_reason"],
                ]
            )
    headers = ["deployment", "engine", "host", "desired", "state", "gpu memory", "reason"]
    print_table(headers, deployment_rows, empty="no deployments")
    _print_adapters(data["adapters"])
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


def _print_adapters(adapters: list[dict[str, Any]]) -> None:
    """The adapters, after the deployments whose engines serve them (none: nothing)."""
    if adapters:
        print()
        rows = [[a["name"], a["base"], a["state"], ",".join(a["loaded_on"]) or "-"]
                for a in adapters]  # fmt: skip
        print_table(["adapter", "base", "state", "loaded in"], rows, empty="")


def _where(replica: dict[str, Any], *, several: bool) -> str:
    """Its host; for a replica of a model of several, with its GPUs while it runs
    (``local/0,1``, as the answers' ``x-capyctl-replica`` names it)."""
    host = replica["host"] or "(auto)"
    if several and replica.get("gpus"):
        return f"{host}/{','.join(str(g) for g in replica['gpus'])}"
    return host


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
