"""Handlers of ``capyctl key``, ``user`` and ``team``: API keys and the people who own
them, with the ceilings that bind every key of a user and the teams keys are charged to."""

from __future__ import annotations

import argparse
import sys
from datetime import timedelta
from typing import Any

from capyctl.cli.commands import _actor, prepare
from capyctl.cli.output import print_json, print_table
from capyctl.errors import UserError

# --- keys --------------------------------------------------------------------------------


def key_create(args: argparse.Namespace) -> int:
    from capyctl.access.services import issue_api_key
    from capyctl.reports import key_data
    from capyctl.validation import parse_duration

    expires = parse_duration(args.expires, field="expires") if args.expires else None
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    prepare()
    key, full_key = issue_api_key(
        args.user,
        name=args.name,
        models=models,
        expires_in=expires,
        admin=args.admin,
        requests_per_minute=args.rpm,
        max_concurrent=args.max_concurrent,
        team=args.team,
        priority_class=args.priority_class,
        actor=_actor(),
    )
    print(full_key)
    details = [f"id {key.key_id}", f"user {args.user}"]
    if key.limit_models:  # the models as REST's answer names them
        details.append(f"models {','.join(key_data(key)['models']) or '(none)'}")
    if key.expires_at:
        details.append(f"expires {key.expires_at:%Y-%m-%d %H:%M} UTC")
    if key.requests_per_minute:
        details.append(f"{key.requests_per_minute}/min")
    if key.max_concurrent:
        details.append(f"{key.max_concurrent} at once")
    if key.is_admin:
        details.append("admin scope")
    if key.team is not None:
        details.append(f"charged to team {key.team.name}")
    if key.priority_class:
        details.append(f"class {key.priority_class}")
    print(f"capyctl: key created ({', '.join(details)}); it is shown only now", file=sys.stderr)
    return 0


def key_list(args: argparse.Namespace) -> int:
    from capyctl.reports import all_keys, key_data

    prepare()
    keys = [key_data(k) for k in all_keys(user=args.user)]
    if args.json:
        print_json(keys)
        return 0
    rows = [
        [
            k["id"],
            k["user"],
            k["name"],
            "(all)" if k["all_models"] else ",".join(k["models"]) or "(none)",
            k["team"] or "-",
            _key_class(k),
            "yes" if k["admin"] else "no",
            _key_limits(k),
            k["expires_at"][:16].replace("T", " ") if k["expires_at"] else "never",
            "revoked" if k["revoked"] else ("active" if k["active"] else "expired"),
            k["last_used_at"][:16].replace("T", " ") if k["last_used_at"] else "never",
        ]
        for k in keys
    ]
    headers = ["id", "user", "name", "models", "team", "class", "admin", "limits", "expires",
               "status", "last used"]  # fmt: skip
    print_table(headers, rows, empty="no keys")
    return 0


def _key_class(key: dict[str, Any]) -> str:
    """``batch``: its own class; ``batch (team)``: its team's, which it follows."""
    if key["priority_class"] or key["team"] is None:
        return str(key["class"])
    return f"{key['class']} (team)"


def _limit_changes(args: argparse.Namespace) -> dict[str, Any]:
    """The limit flags that were given, as the services take them."""
    changes: dict[str, Any] = {}
    if hasattr(args, "models"):
        names = [m.strip() for m in args.models.split(",") if m.strip()]
        changes["models"] = None if names == ["all"] else names
    if hasattr(args, "rpm"):
        changes["requests_per_minute"] = args.rpm
    if hasattr(args, "max_concurrent"):
        changes["max_concurrent"] = args.max_concurrent
    return changes


def key_update(args: argparse.Namespace) -> int:
    from capyctl.access.services import update_api_key

    changes = _limit_changes(args)
    if "models" in changes and changes["models"] is None:
        changes["models"] = []  # a key's "all": every model its user may use
    prepare()
    if hasattr(args, "team"):
        changes["team"] = None if args.team == "none" else args.team
    if hasattr(args, "priority_class"):  # "team": its team's (stored empty)
        changes["priority_class"] = "" if args.priority_class == "team" else args.priority_class
    key = update_api_key(args.id, name=getattr(args, "name", None), actor=_actor(), **changes)
    print(f"key {key.prefix} changed")
    return 0


def _key_limits(key: dict[str, Any]) -> str:
    limits = []
    if key["requests_per_minute"]:
        limits.append(f"{key['requests_per_minute']}/min")
    if key["max_concurrent"]:
        limits.append(f"{key['max_concurrent']} at once")
    return ", ".join(limits) or "-"


def key_revoke(args: argparse.Namespace) -> int:
    from capyctl.access.services import revoke_api_key

    prepare()
    key = revoke_api_key(args.id, actor=_actor())
    print(f"key {key.prefix} revoked")
    return 0


# --- teams -------------------------------------------------------------------------------


def team_add(args: argparse.Namespace) -> int:
    from capyctl.access.teams import add_team

    prepare()
    team = add_team(args.name, priority_class=args.priority_class, actor=_actor())
    also = f" (class {team.priority_class})" if team.priority_class != "interactive" else ""
    print(f"team {args.name} added{also}")
    return 0


def team_update(args: argparse.Namespace) -> int:
    from capyctl.access.teams import update_team

    prepare()
    update_team(args.name, priority_class=args.priority_class, actor=_actor())
    print(f"team {args.name} changed: class {args.priority_class}")
    return 0


def team_list(args: argparse.Namespace) -> int:
    from capyctl.reports import all_teams, team_data

    prepare()
    teams = [team_data(t) for t in all_teams()]
    if args.json:
        print_json(teams)
        return 0
    rows = [[t["name"], ",".join(t["members"]) or "-", t["keys"], t["priority_class"]]
            for t in teams]  # fmt: skip
    print_table(["name", "members", "keys", "class"], rows, empty="no teams")
    return 0


def team_remove(args: argparse.Namespace) -> int:
    from capyctl.access.teams import remove_team

    prepare()
    remove_team(args.name, actor=_actor())
    print(f"team {args.name} removed")
    return 0


def team_member(args: argparse.Namespace) -> int:
    from capyctl.access.teams import add_member, remove_member

    prepare()
    if args.change == "add":
        add_member(args.team, args.user, actor=_actor())
        print(f"{args.user} joined team {args.team}")
    else:
        remove_member(args.team, args.user, actor=_actor())
        print(f"{args.user} left team {args.team}")
    return 0


# --- users -------------------------------------------------------------------------------


def user_add(args: argparse.Namespace) -> int:
    import secrets

    from capyctl.access.services import add_user

    generated = not args.password_stdin
    if args.password_stdin:
        password = sys.stdin.readline().rstrip("\n")
        if len(password) < 8:
            raise UserError("the password from standard input is shorter than 8 characters")
    else:
        password = secrets.token_urlsafe(12)
    limits = _ceilings(args)
    prepare()
    add_user(args.name, password=password, staff=args.staff, limits=limits, actor=_actor())
    role = "staff user" if args.staff else "user"
    print(f"{role} {args.name} added")
    if generated:
        print(f"password: {password}  (shown only now)")
    return 0


def _ceilings(args: argparse.Namespace) -> dict[str, Any]:
    from capyctl.validation import parse_duration

    limits = _limit_changes(args)
    if hasattr(args, "key_lifetime"):
        lifetime = args.key_lifetime
        limits["key_lifetime"] = (
            None if lifetime == "none" else parse_duration(lifetime, field="key_lifetime")
        )
    return limits


def user_update(args: argparse.Namespace) -> int:
    from capyctl.access.services import get_user, set_user_limits
    from capyctl.reports import limits_data

    limits = _ceilings(args)
    if not limits:
        raise UserError(
            "nothing to change: give --models, --rpm, --max-concurrent or --key-lifetime"
        )
    prepare()
    set_user_limits(args.name, actor=_actor(), **limits)
    print(f"user {args.name}: {_describe_limits(limits_data(get_user(args.name)))}")
    return 0


def _describe_limits(limits: dict[str, Any]) -> str:
    models = limits["models"]
    lifetime = limits["key_lifetime_seconds"]
    return ", ".join([
        f"models {','.join(models) or '(none)'}" if models is not None else "models (all)",
        f"{limits['requests_per_minute']}/min" if limits["requests_per_minute"] else "no rpm limit",
        f"{limits['max_concurrent']} at once" if limits["max_concurrent"] else "no limit at once",
        f"keys live at most {_span(lifetime)}" if lifetime else "keys may live forever",
    ])  # fmt: skip


def _span(seconds: int) -> str:
    from capyctl.access.services import span_text

    return span_text(timedelta(seconds=seconds))


def user_list(args: argparse.Namespace) -> int:
    from capyctl.reports import all_users, limits_data

    prepare()
    users: list[dict[str, Any]] = [
        {
            "name": u.get_username(),
            "staff": u.is_staff,
            "active": u.is_active,
            "keys": u.key_count,
            "limits": limits_data(u),
        }
        for u in all_users()
    ]
    if args.json:
        print_json(users)
    else:
        rows = []
        for u in users:
            limits = u["limits"]
            lifetime = limits["key_lifetime_seconds"]
            models = limits["models"]
            rows.append([
                u["name"], "yes" if u["staff"] else "no", u["keys"],
                "(all)" if models is None else ",".join(models) or "(none)",
                limits["requests_per_minute"] or "-", limits["max_concurrent"] or "-",
                _span(lifetime) if lifetime else "-",
            ])  # fmt: skip
        headers = ["name", "staff", "keys", "models", "rpm", "at once", "key lifetime"]
        print_table(headers, rows, empty="no users")
    return 0


# --- budgets and usage -------------------------------------------------------------------


def budget_set(args: argparse.Namespace) -> int:
    from capyctl.access.budgets import describe, limits_text, set_budget

    prepare()
    budget, made = set_budget(key=args.key, user=args.user, team=args.team, tokens=args.tokens,
                              gpu_seconds=args.gpu_seconds, spend=args.spend,
                              period=args.period, soft_percent=args.soft,
                              actor=_actor())  # fmt: skip
    print(f"budget {budget.pk} {'set' if made else 'changed'}: {describe(budget)}, "
          f"{limits_text(budget)}")  # fmt: skip
    return 0


def _used(row: dict[str, Any], limit: str, used: str, fmt: str) -> str:
    if row[limit] is None:
        return "-"
    most = row[limit]
    return f"{format(row[used], fmt)} / {format(most, fmt)} ({100 * row[used] / most:.0f}%)"


def budget_list(args: argparse.Namespace) -> int:
    from capyctl.access.budgets import budget_rows, budgets

    prepare()
    rows = budget_rows(budgets(key=args.key, user=args.user, team=args.team))
    if args.json:
        print_json(rows)
        return 0
    table = [
        [r["id"], f"{r['scope']} {r['of']}", r["period"], _used(r, "tokens", "used_tokens", ","),
         _used(r, "gpu_seconds", "used_gpu_seconds", ",.1f"),
         _used(r, "spend", "used_spend", ",.2f"),
         f"{r['soft_percent']}%" if r["soft_percent"] else "-",
         str(r["resets_at"] or "never")[:16].replace("T", " ")]
        for r in rows
    ]  # fmt: skip
    print_table(["id", "of", "period", "tokens", "gpu-seconds", "spend", "soft", "resets"], table,
                empty="no budgets")  # fmt: skip
    return 0


def budget_remove(args: argparse.Namespace) -> int:
    from capyctl.access.budgets import remove_budget

    prepare()
    remove_budget(args.id, actor=_actor())
    print(f"budget {args.id} removed")
    return 0


def usage(args: argparse.Namespace) -> int:
    import csv
    from datetime import UTC, datetime

    from capyctl.access.usage import usage_by
    from capyctl.validation import parse_duration

    prepare()
    since = datetime.now(UTC) - parse_duration(args.since, field="--since")
    rows = usage_by(args.by, since)
    if args.json:
        print_json(rows)
        return 0
    fields = [args.by, "requests", "prompt_tokens", "completion_tokens", "tokens", "gpu_seconds",
              "switch_gpu_seconds", "spend"]  # fmt: skip
    if args.csv:
        writer = csv.writer(sys.stdout, lineterminator="\n")
        writer.writerow(fields)
        writer.writerows([[_csv_safe("" if r[f] is None else r[f]) for f in fields] for r in rows])
        return 0
    table = [[r[args.by] or "(no team)", f"{r['requests']:,}", f"{r['prompt_tokens']:,}",
              f"{r['completion_tokens']:,}", f"{r['gpu_seconds']:,.2f}",
              f"{r['switch_gpu_seconds']:,.2f}", f"{r['spend']:,.4f}"] for r in rows]  # fmt: skip
    print_table([args.by, "requests", "prompt", "completion", "gpu-s", "of it switches", "spend"],
                table,
                empty=f"no usage in the last {args.since}")  # fmt: skip
    return 0


def _csv_safe(value: object) -> object:
    """A cell a spreadsheet will not run as a formula (a name beginning =, +, - or @)."""
    if isinstance(value, str) and value[:1] in ("=", "+", "-", "@"):
        return "'" + value
    return value
