"""Teams: people who share GPUs, and the team each key is charged to (docs/teams.md)."""

from __future__ import annotations

import json

import pytest
from django.contrib.auth.models import User

from capyctl.access.models import ApiKey, Team
from capyctl.access.services import issue_api_key, revoke_api_key, update_api_key
from capyctl.access.teams import add_member, add_team, remove_member, remove_team
from capyctl.errors import NotFoundError, UserError
from capyctl.events.models import Event
from tests.conftest import table_counts


@pytest.mark.django_db
def test_a_key_is_charged_only_to_a_team_of_its_user_and_nothing_is_left_charged(alice, bob):
    add_team("research")
    add_member("research", "alice")
    before = table_counts()
    refusals = [
        (lambda: add_team("Research Lab"), r"^invalid team name 'Research Lab': use 1-63"),
        (lambda: add_team("research"), r"^a team named 'research' already exists$"),
        (lambda: add_member("research", "alice"), r"^alice is already a member of team research$"),
        (lambda: add_member("nope", "alice"), r"^no team named 'nope'$"),
        (lambda: add_member("research", "carol"), r"^no user named 'carol'$"),
        (lambda: remove_member("research", "bob"), r"^bob is not a member of team research$"),
        (lambda: issue_api_key("bob", team="research"),
         r"^bob is not a member of team research; a key is charged only to a team of its user's$"),
    ]  # fmt: skip
    for attempt, message in refusals:
        with pytest.raises((UserError, NotFoundError), match=message):
            attempt()
    assert table_counts() == before  # a refusal changes nothing

    key, _ = issue_api_key("alice", name="lab", team="research")
    assert key.team == Team.objects.get(name="research")
    assert issue_api_key("alice")[0].team is None  # the default: no team
    with pytest.raises(
        UserError, match=rf"^alice's keys are charged to team research \({key.prefix}\)"
    ):
        remove_member("research", "alice")
    with pytest.raises(UserError, match=rf"^keys are charged to team 'research' \({key.prefix}\)"):
        remove_team("research")
    update_api_key(key.key_id, team=None)
    assert ApiKey.objects.get(pk=key.pk).team is None
    update_api_key(key.key_id, team="research")
    revoke_api_key(key.key_id)  # a revoked key keeps no team from going
    remove_member("research", "alice")
    remove_team("research")
    assert not Team.objects.exists()
    assert ApiKey.objects.get(pk=key.pk).team is None
    kinds = list(
        Event.objects.filter(kind__startswith="team.").order_by("pk").values_list("kind", flat=True)
    )
    assert kinds == ["team.added", "team.member_added", "team.member_removed", "team.removed"]


@pytest.mark.django_db
def test_the_cli_makes_teams_and_charges_keys_to_them(cli, alice, bob):
    assert cli("team", "add", "research").out == "team research added\n"
    assert cli("team", "member", "add", "research", "alice").out == "alice joined team research\n"
    assert cli("team", "member", "add", "research", "bob").out == "bob joined team research\n"
    made = cli("key", "create", "--user", "alice", "--name", "lab", "--team", "research")
    assert made.code == 0
    assert made.err.endswith("charged to team research); it is shown only now\n")
    listing = cli("key", "list").out.splitlines()
    assert listing[0].split()[:5] == ["ID", "USER", "NAME", "MODELS", "TEAM"]
    assert listing[1].split()[1:5] == ["alice", "lab", "(all)", "research"]
    teams = json.loads(cli("team", "list", "--json").out)
    assert [(t["name"], t["members"], t["keys"]) for t in teams] == [
        ("research", ["alice", "bob"], 1)
    ]
    assert cli("team", "list").out.splitlines()[1].split() == ["research", "alice,bob", "1"]
    refused = cli("team", "remove", "research")
    assert refused.code == 2
    assert refused.err.startswith("capyctl: error: keys are charged to team 'research' (capy_")
    key_id = json.loads(cli("key", "list", "--json").out)[0]["id"]
    assert cli("key", "update", key_id, "--team", "none").out == f"key capy_{key_id} changed\n"
    assert cli("team", "member", "remove", "research", "bob").out == "bob left team research\n"
    assert cli("team", "remove", "research").out == "team research removed\n"
    assert cli("team", "list").out == "no teams\n"


@pytest.mark.django_db
def test_rest_makes_teams_and_their_members(client, alice, bob):
    User.objects.filter(pk=alice.pk).update(is_staff=True)
    client.force_login(User.objects.get(pk=alice.pk))
    made = client.post("/api/teams/", {"name": "research"}, content_type="application/json")
    assert made.status_code == 201, made.content
    assert made.json()["members"] == []
    joined = client.post("/api/teams/research/members/", {"user": "bob"},
                         content_type="application/json")  # fmt: skip
    assert joined.json()["members"] == ["bob"]
    key = client.post("/api/keys/", {"user": "bob", "team": "research"},
                      content_type="application/json")  # fmt: skip
    assert key.status_code == 201, key.content
    refused = client.delete("/api/teams/research/members/bob/")
    assert refused.status_code == 400
    assert "charged to team research" in json.dumps(refused.json())
    key_id = ApiKey.objects.get(user__username="bob").key_id
    changed = client.patch(f"/api/keys/{key_id}/", {"team": None}, content_type="application/json")
    assert changed.json()["team"] is None
    assert client.delete("/api/teams/research/members/bob/").json()["members"] == []
    assert client.delete("/api/teams/research/").status_code == 204
    assert client.get("/api/teams/research/").status_code == 404


@pytest.mark.django_db
def test_the_keys_page_offers_the_user_s_teams(client, bob):
    add_team("research")
    add_team("other")
    add_member("research", "bob")
    client.force_login(bob)
    page = client.get("/keys/").content.decode()
    assert '<option value="research">team research</option>' in page
    assert "team other" not in page
    made = client.post("/keys/", {"name": "lab", "expires": "", "team": "research"})
    assert made.status_code == 200
    assert ApiKey.objects.get(name="lab").team == Team.objects.get(name="research")
    refused = client.post("/keys/", {"name": "x", "expires": "", "team": "other"})
    assert refused.status_code == 400
    assert "bob is not a member of team other" in refused.content.decode()
