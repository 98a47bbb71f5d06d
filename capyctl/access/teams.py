"""Teams: people who share GPUs, and what their keys are charged to.

Validation lives here once, for the CLI, REST and the admin: a team's name is a lowercase
DNS label; a key may be charged to one team of its user, and only while its user is a
member (removing a member whose keys are charged to the team, or a team that keys are
charged to, is refused, naming the keys: nothing is left charged to a team its user
left).
"""

from __future__ import annotations

from django.db import transaction

from capyctl.access.classes import INTERACTIVE
from capyctl.access.models import ApiKey, Team
from capyctl.access.services import check_class, get_team, get_user
from capyctl.errors import UserError
from capyctl.events.services import record_event
from capyctl.validation import validate_name


def add_team(name: str, *, priority_class: str = INTERACTIVE, actor: str = "") -> Team:
    """A new team; ``priority_class``: its keys' class, unless a key has its own."""
    validate_name(name, what="team name")
    check_class(priority_class, inherits=False)
    if Team.objects.filter(name=name).exists():
        raise UserError(f"a team named {name!r} already exists", field="name")
    team = Team.objects.create(name=name, priority_class=priority_class)
    also = f" (class {priority_class})" if priority_class != INTERACTIVE else ""
    record_event("team.added", f"team {name} added{also}", subject=name, actor=actor)
    return team


def update_team(name: str, *, priority_class: str, actor: str = "") -> Team:
    """Set a team's priority class: its keys without one of their own follow it (the
    gateway reads it within a second)."""
    check_class(priority_class, inherits=False)
    team = get_team(name)
    team.priority_class = priority_class
    team.save(update_fields=["priority_class"])
    record_event("team.changed", f"team {name} changed: class {priority_class}", subject=name,
                 actor=actor)  # fmt: skip
    return team


def _charged(keys: list[ApiKey]) -> str:
    return ", ".join(key.prefix for key in keys)


@transaction.atomic
def remove_team(name: str, *, actor: str = "") -> None:
    """Remove a team no key is charged to (its members stay users)."""
    team = get_team(name)
    keys = list(team.api_keys.filter(revoked_at__isnull=True).order_by("key_id"))
    if keys:
        raise UserError(
            f"keys are charged to team {name!r} ({_charged(keys)}); charge them to no team "
            "first (capyctl key update ID --team none) or revoke them",
            field="name",
        )
    ApiKey.objects.filter(team=team).update(team=None)  # revoked ones: their record stays
    team.delete()
    record_event("team.removed", f"team {name} removed", subject=name, actor=actor)


def add_member(name: str, username: str, *, actor: str = "") -> Team:
    team, user = get_team(name), get_user(username)
    if team.members.filter(pk=user.pk).exists():
        raise UserError(f"{username} is already a member of team {name}", field="user")
    team.members.add(user)
    record_event("team.member_added", f"{username} joined team {name}", subject=name,
                 actor=actor)  # fmt: skip
    return team


@transaction.atomic
def remove_member(name: str, username: str, *, actor: str = "") -> Team:
    """Take ``username`` off the team: refused while keys of theirs are charged to it."""
    team, user = get_team(name), get_user(username)
    if not team.members.filter(pk=user.pk).exists():
        raise UserError(f"{username} is not a member of team {name}", field="user")
    keys = list(team.api_keys.filter(user=user, revoked_at__isnull=True).order_by("key_id"))
    if keys:
        raise UserError(
            f"{username}'s keys are charged to team {name} ({_charged(keys)}); charge them to "
            "no team first (capyctl key update ID --team none) or revoke them",
            field="user",
        )
    team.members.remove(user)
    record_event("team.member_removed", f"{username} left team {name}", subject=name,
                 actor=actor)  # fmt: skip
    return team
