"""The parsers of the commands about people: ``key``, ``user``, ``team``, ``budget`` and
``usage``."""

from __future__ import annotations

import argparse
from typing import Any

from capyctl.access.classes import CLASSES
from capyctl.cli.parsing import Parser, add_json, cmd, count_arg, limit_arg

_CLASS_HELP = "interactive, or batch: idle GPUs only"


def build_key(commands: Any) -> None:
    key = cmd(commands, "key", "API keys")
    sub = key.add_subparsers(title="actions", metavar="ACTION", parser_class=Parser)
    create = cmd(sub, "create", "make a key (printed once)", "key_create")
    create.add_argument("--user", required=True)
    create.add_argument("--name", default="", metavar="LABEL")
    create.add_argument("--models", default="", metavar="A,B", help="allowed models (default all)")
    create.add_argument("--expires", metavar="DURATION", help="e.g. 30d, 12h, 2w")
    create.add_argument("--admin", action="store_true", help="allow REST automation as admin")
    create.add_argument("--rpm", type=count_arg(1), metavar="N", help="requests per minute")
    create.add_argument("--max-concurrent", type=count_arg(1), metavar="N",
                        help="requests in flight at once")  # fmt: skip
    create.add_argument("--team", metavar="TEAM", help="charge it to this team of its user's")
    create.add_argument("--class", dest="priority_class", choices=CLASSES, default="",
                        help=f"{_CLASS_HELP} (default: its team's, else interactive)")  # fmt: skip
    update = cmd(sub, "update", "change a key's name, models, limits, team or class",
                 "key_update")  # fmt: skip
    update.add_argument("id", help="the key id or its capy_<id> prefix")
    update.add_argument("--name", metavar="LABEL", default=argparse.SUPPRESS)
    update.add_argument("--team", metavar="TEAM|none", default=argparse.SUPPRESS,
                        help="charge it to a team of its user's ('none': to no team)")  # fmt: skip
    update.add_argument("--class", dest="priority_class", choices=(*CLASSES, "team"),
                        default=argparse.SUPPRESS,
                        help=f"{_CLASS_HELP} ('team': its team's, else interactive)")  # fmt: skip
    _limit_flags(update, "")
    listing = cmd(sub, "list", "list keys", "key_list")
    listing.add_argument("--user", help="only this user's keys")
    add_json(listing)
    revoke = cmd(sub, "revoke", "revoke a key", "key_revoke")
    revoke.add_argument("id", help="the key id or its capy_<id> prefix")


def _limit_flags(parser: Parser, scope: str) -> None:
    """--models, --rpm and --max-concurrent, left out of the namespace when not given."""
    unset = argparse.SUPPRESS
    parser.add_argument("--models", metavar="A,B|all", default=unset,
                        help=f"the models it may use{scope} ('all': every one)")  # fmt: skip
    parser.add_argument("--rpm", type=limit_arg, metavar="N|none", default=unset,
                        help=f"requests per minute{scope}")  # fmt: skip
    parser.add_argument("--max-concurrent", type=limit_arg, metavar="N|none", default=unset,
                        help=f"requests in flight at once{scope}")  # fmt: skip


def build_team(commands: Any) -> None:
    team = cmd(commands, "team", "teams: people who share GPUs, and what their keys are charged to")
    sub = team.add_subparsers(title="actions", metavar="ACTION", parser_class=Parser)
    add = cmd(sub, "add", "add a team", "team_add")
    add.add_argument("name")
    add.add_argument("--class", dest="priority_class", choices=CLASSES, default="interactive",
                     help=f"its keys' class, unless a key has its own: {_CLASS_HELP} "
                     "(default: interactive)")  # fmt: skip
    update = cmd(sub, "update", "set a team's priority class", "team_update")
    update.add_argument("name")
    update.add_argument("--class", dest="priority_class", choices=CLASSES, required=True,
                        help=f"its keys' class, unless a key has its own: {_CLASS_HELP}",
                        )  # fmt: skip
    listing = cmd(sub, "list", "list teams with their members and class", "team_list")
    add_json(listing)
    remove = cmd(sub, "remove", "remove a team no key is charged to", "team_remove")
    remove.add_argument("name")
    member = cmd(sub, "member", "add a user to a team, or take one off it", "team_member")
    member.add_argument("change", choices=["add", "remove"])
    member.add_argument("team")
    member.add_argument("user")


def build_user(commands: Any) -> None:
    user = cmd(commands, "user", "people who use CapyCTL")
    sub = user.add_subparsers(title="actions", metavar="ACTION", parser_class=Parser)
    add = cmd(sub, "add", "add a user (a password is generated and printed once)", "user_add")
    add.add_argument("name")
    add.add_argument("--staff", action="store_true", help="may use the admin and manage all")
    add.add_argument(
        "--password-stdin", action="store_true", help="read the password from standard input"
    )
    update = cmd(sub, "update", "set a user's ceilings (their keys can only narrow them)",
                  "user_update")  # fmt: skip
    update.add_argument("name")
    for parser in (add, update):
        _limit_flags(parser, " across all their keys")
        parser.add_argument(
            "--key-lifetime", metavar="DURATION|none", default=argparse.SUPPRESS,
            help="longest a key of theirs may live, e.g. 30d",
        )  # fmt: skip
    listing = cmd(sub, "list", "list users", "user_list")
    add_json(listing)


def _positive_number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} must be a number above 0")
    return value


def build_budget(commands: Any) -> None:
    budget = cmd(commands, "budget", "budgets: tokens, GPU-seconds or spend a key, user or "
                 "team may use in a period")  # fmt: skip
    sub = budget.add_subparsers(title="actions", metavar="ACTION", parser_class=Parser)
    put = cmd(sub, "set", "set the budget of a key, user or team for a period (one a period: "
              "setting it again changes it)", "budget_set")  # fmt: skip
    whose = put.add_mutually_exclusive_group(required=True)
    whose.add_argument("--key", metavar="ID", help="one key (its id, or capy_ID)")
    whose.add_argument("--user", metavar="NAME", help="a user: all their keys together")
    whose.add_argument("--team", metavar="NAME", help="a team: the keys charged to it")
    put.add_argument("--tokens", type=count_arg(1), metavar="N",
                     help="prompt and completion tokens")  # fmt: skip
    put.add_argument("--gpu-seconds", type=_positive_number, metavar="N",
                     help="the time requests held their engines times its GPUs, shared, "
                     "and their shares of the switches made for them")  # fmt: skip
    put.add_argument("--spend", type=_positive_number, metavar="AMOUNT",
                     help="what its tokens and GPU-seconds come to at the models' prices "
                     "(deployment --price-*)")  # fmt: skip
    put.add_argument("--period", required=True, choices=["day", "week", "month", "total"],
                     help="a calendar period in CAPYCTL_TIME_ZONE (total: never resets)",
                     )  # fmt: skip
    put.add_argument("--soft", type=count_arg(1), metavar="PCT",
                     help="an event (and the alert webhook) once a period when this much "
                     "is used")  # fmt: skip
    listing = cmd(sub, "list", "list budgets with what each period used so far", "budget_list")
    for_whom = listing.add_mutually_exclusive_group()
    for_whom.add_argument("--key", metavar="ID")
    for_whom.add_argument("--user", metavar="NAME")
    for_whom.add_argument("--team", metavar="NAME")
    add_json(listing)
    remove = cmd(sub, "remove", "remove a budget", "budget_remove")
    remove.add_argument("id")


def build_usage(commands: Any) -> None:
    usage = cmd(commands, "usage", "what was used, by team, user, key or model", "usage")
    usage.add_argument("--by", choices=["team", "user", "key", "model"], default="key",
                       help="what each row is (default: key)")  # fmt: skip
    usage.add_argument("--since", default="7d", metavar="SPAN",
                       help="how far back: 12h, 7d, 4w (default: 7d)")  # fmt: skip
    shape = usage.add_mutually_exclusive_group()
    shape.add_argument("--json", action="store_true", help="print JSON instead of a table")
    shape.add_argument("--csv", action="store_true", help="print CSV instead of a table")
