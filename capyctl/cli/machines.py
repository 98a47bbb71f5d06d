"""``capyctl host …`` and ``capyctl cache …``: GPU machines that run host agents, and the
model weights cached on them."""

from __future__ import annotations

import argparse
from typing import Any, cast

from django.conf import settings

from capyctl.cli.commands import prepare
from capyctl.cli.output import print_json, print_table
from capyctl.errors import UserError
from hostagent.units import format_size


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
            "draining": h.drain_started_at is not None,
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
            [h["name"], h["address"], str(h["state"]) + (" (draining)" if h["draining"] else ""),
             "yes" if h["joined"] else "no",
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


def host_drain(args: argparse.Namespace) -> int:
    from capyctl.scheduler.host_states import drain_host

    prepare()
    host = drain_host(args.name, actor="cli")
    print(f"host {host.name} is draining: nothing new is placed on it; its models move to "
          "other hosts where they fit")  # fmt: skip
    print("  watch: capyctl events --follow | grep -e moved -e drained")
    return 0


def host_undrain(args: argparse.Namespace) -> int:
    from capyctl.scheduler.host_states import undrain_host

    prepare()
    host = undrain_host(args.name, actor="cli")
    print(f"host {host.name} takes models again")
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
