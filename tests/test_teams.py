"""Teams: people who share GPUs, and the team each key is charged to (docs/teams.md)."""

from __future__ import annotations

import json

import pytest
from django.contrib.auth.models import User

from capyctl.access.models import ApiKey, Team
from capyctl.access.services import issue_api_key, revoke_api_key, update_api_key
from capyctl.access.teams import add_member, add_team, remove_member, remove_team, update_team
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
    assert cli("team", "list").out.splitlines()[1].split() == [
        "research", "alice,bob", "1", "interactive"
    ]  # fmt: skip
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


# --- priority classes ----------------------------------------------------------------------


def _class_of(key: ApiKey) -> str:
    return ApiKey.objects.select_related("team").get(pk=key.pk).effective_class


@pytest.mark.django_db
def test_a_key_s_class_is_its_own_else_its_team_s_else_interactive(alice):
    add_team("research", priority_class="batch")
    add_member("research", "alice")
    assert Team.objects.get(name="research").priority_class == "batch"
    assert add_team("web").priority_class == "interactive"  # the default
    plain, _ = issue_api_key("alice")
    follows, _ = issue_api_key("alice", team="research")
    own, _ = issue_api_key("alice", team="research", priority_class="interactive")
    alone, _ = issue_api_key("alice", priority_class="batch")
    assert [_class_of(k) for k in (plain, follows, own, alone)] == [
        "interactive", "batch", "interactive", "batch"
    ]  # fmt: skip
    assert follows.priority_class == ""  # stored empty: it follows its team
    update_team("research", priority_class="interactive")
    assert [_class_of(k) for k in (follows, own)] == ["interactive", "interactive"]
    update_team("research", priority_class="batch")
    update_api_key(own.key_id, priority_class="")  # back to its team's
    assert _class_of(own) == "batch"
    update_api_key(follows.key_id, team=None)  # no team: interactive
    assert _class_of(follows) == "interactive"
    before = table_counts()
    refusals = [
        lambda: issue_api_key("alice", priority_class="urgent"),
        lambda: update_api_key(own.key_id, priority_class="Batch"),
        lambda: add_team("other", priority_class=""),  # a team's own: never empty
        lambda: update_team("research", priority_class="team"),
    ]
    for attempt in refusals:
        with pytest.raises(UserError, match=r"^a priority class is interactive or batch") as err:
            attempt()
        assert err.value.field == "priority_class"
    assert table_counts() == before
    assert Team.objects.get(name="research").priority_class == "batch"
    assert ApiKey.objects.get(pk=own.pk).priority_class == ""
    with pytest.raises(NotFoundError, match=r"^no team named 'nope'$"):
        update_team("nope", priority_class="batch")
    changes = Event.objects.filter(kind="team.changed").order_by("pk")
    said = changes.values_list("message", flat=True)
    assert list(said) == ["team research changed: class interactive",
                          "team research changed: class batch"]  # fmt: skip


@pytest.mark.django_db
def test_the_cli_sets_and_lists_classes(cli, alice):
    assert cli("team", "add", "research", "--class", "batch").out == (
        "team research added (class batch)\n"
    )
    assert cli("team", "add", "web").out == "team web added\n"
    cli("team", "member", "add", "research", "alice")
    made = cli("key", "create", "--user", "alice", "--name", "lab", "--team", "research")
    assert made.err.endswith("charged to team research); it is shown only now\n")
    own = cli("key", "create", "--user", "alice", "--name", "chat", "--class", "batch")
    assert own.err.endswith("(id " + own.out[5:15] + ", user alice, class batch); it is shown "
                            "only now\n")  # fmt: skip
    listing = cli("key", "list").out.splitlines()
    assert listing[0].split()[4:7] == ["TEAM", "CLASS", "ADMIN"]
    assert [line.split()[2:7] for line in listing[1:]] == [
        ["chat", "(all)", "-", "batch", "no"],
        ["lab", "(all)", "research", "batch", "(team)"],
    ]
    keys = {k["name"]: k for k in json.loads(cli("key", "list", "--json").out)}
    assert (keys["lab"]["class"], keys["lab"]["priority_class"]) == ("batch", None)
    assert (keys["chat"]["class"], keys["chat"]["priority_class"]) == ("batch", "batch")
    lab = keys["lab"]["id"]
    assert cli("key", "update", lab, "--class", "interactive").out == f"key capy_{lab} changed\n"
    assert ApiKey.objects.get(key_id=lab).priority_class == "interactive"
    cli("key", "update", lab, "--class", "team")
    assert ApiKey.objects.get(key_id=lab).priority_class == ""
    assert cli("team", "update", "research", "--class", "interactive").out == (
        "team research changed: class interactive\n"
    )
    assert json.loads(cli("key", "list", "--json").out)[1]["class"] == "interactive"
    teams = json.loads(cli("team", "list", "--json").out)
    assert [(t["name"], t["priority_class"]) for t in teams] == [
        ("research", "interactive"), ("web", "interactive")
    ]  # fmt: skip
    assert cli("team", "list").out.splitlines()[0].split() == ["NAME", "MEMBERS", "KEYS", "CLASS"]
    # A bad value: one line, a non-zero exit, nothing changed.
    before = table_counts()
    for argv, prog, listed in [
        (("key", "create", "--user", "alice", "--class", "urgent"), "key create",
         "'interactive', 'batch'"),
        (("key", "update", lab, "--class", "none"), "key update",
         "'interactive', 'batch', 'team'"),
        (("team", "add", "other", "--class", "team"), "team add", "'interactive', 'batch'"),
        (("team", "update", "web", "--class", "Batch"), "team update",
         "'interactive', 'batch'"),
    ]:  # fmt: skip
        refused = cli(*argv)
        assert refused.code == 2, argv
        assert refused.out == ""
        assert refused.err.count("\n") == 1, refused.err
        assert refused.err.startswith(f"capyctl {prog}: error: argument --class: invalid choice")
        assert f"(choose from {listed})" in refused.err
    missing = cli("team", "update", "nope", "--class", "batch")
    assert (missing.code, missing.err) == (2, "capyctl: error: no team named 'nope'\n")
    assert table_counts() == before
    assert ApiKey.objects.get(key_id=lab).priority_class == ""
    assert Team.objects.get(name="web").priority_class == "interactive"


@pytest.mark.django_db
def test_rest_sets_classes_and_only_staff_change_a_team_s(client, alice, bob):
    client.force_login(alice)  # staff
    made = client.post("/api/teams/", {"name": "research", "priority_class": "batch"},
                       content_type="application/json")  # fmt: skip
    assert made.status_code == 201, made.content
    assert made.json()["priority_class"] == "batch"
    web = client.post("/api/teams/", {"name": "web"}, content_type="application/json")
    assert web.json()["priority_class"] == "interactive"
    client.post("/api/teams/research/members/", {"user": "bob"}, content_type="application/json")
    key = client.post("/api/keys/", {"user": "bob", "team": "research"},
                      content_type="application/json").json()  # fmt: skip
    assert (key["priority_class"], key["class"]) == (None, "batch")
    changed = client.patch("/api/teams/research/", {"priority_class": "interactive"},
                           content_type="application/json")  # fmt: skip
    assert changed.status_code == 200, changed.content
    assert changed.json()["priority_class"] == "interactive"
    assert client.get(f"/api/keys/{key['id']}/").json()["class"] == "interactive"
    before = table_counts()
    for path, body in [
        ("/api/teams/", {"name": "other", "priority_class": "urgent"}),
        ("/api/keys/", {"user": "bob", "priority_class": "urgent"}),
    ]:
        refused = client.post(path, body, content_type="application/json")
        assert refused.status_code == 400
        assert refused.json() == {
            "priority_class": ["'urgent' is not a priority class: interactive or batch"]
        }
    for path in ("/api/teams/research/", f"/api/keys/{key['id']}/"):
        refused = client.patch(path, {"priority_class": "team"}, content_type="application/json")
        assert refused.status_code == 400
        assert list(refused.json()) == ["priority_class"]
    assert client.patch("/api/teams/research/", {}, content_type="application/json").json() == {
        "priority_class": ["This field is required."]
    }
    assert table_counts() == before
    # Bob may set his own key's class, as its other fields; not his team's.
    client.force_login(bob)
    mine = client.patch(f"/api/keys/{key['id']}/", {"priority_class": "batch"},
                        content_type="application/json")  # fmt: skip
    assert mine.status_code == 200, mine.content
    assert (mine.json()["priority_class"], mine.json()["class"]) == ("batch", "batch")
    back = client.patch(f"/api/keys/{key['id']}/", {"priority_class": None},
                        content_type="application/json")  # fmt: skip
    assert (back.json()["priority_class"], back.json()["class"]) == (None, "interactive")
    made = client.post("/api/keys/", {"priority_class": "batch"}, content_type="application/json")
    assert made.status_code == 201, made.content
    assert made.json()["class"] == "batch"
    denied = client.patch("/api/teams/research/", {"priority_class": "batch"},
                          content_type="application/json")  # fmt: skip
    assert denied.status_code == 403
    assert Team.objects.get(name="research").priority_class == "interactive"


@pytest.mark.django_db
def test_the_keys_page_shows_and_offers_the_class(client, bob):
    add_team("research", priority_class="batch")
    add_member("research", "bob")
    client.force_login(bob)
    page = client.get("/keys/").content.decode()
    assert '<option value="batch">batch: idle GPUs only</option>' in page
    client.post("/keys/", {"name": "lab", "expires": "", "team": "research"})
    client.post("/keys/", {"name": "chat", "expires": "", "team": "research",
                           "priority_class": "interactive"})  # fmt: skip
    assert ApiKey.objects.get(name="lab").priority_class == ""
    assert ApiKey.objects.get(name="chat").priority_class == "interactive"
    page = client.get("/keys/").content.decode()
    assert '<td>batch <span class="muted">(team)</span></td>' in page
    assert "<td>interactive</td>" in page
    refused = client.post("/keys/", {"name": "x", "expires": "", "priority_class": "urgent"})
    assert refused.status_code == 400
    assert "a priority class is interactive or batch" in refused.content.decode()
    assert not ApiKey.objects.filter(name="x").exists()


@pytest.mark.django_db
def test_the_admin_sets_classes_through_the_services(client, alice):
    alice.is_superuser = True
    alice.save()
    client.force_login(alice)
    added = client.post("/admin/access/team/add/", {"name": "research", "priority_class": "batch"})
    assert added.status_code == 302, added.content
    team = Team.objects.get(name="research")
    assert team.priority_class == "batch"
    changed = client.post(f"/admin/access/team/{team.pk}/change/",
                          {"priority_class": "interactive"})  # fmt: skip
    assert changed.status_code == 302, changed.content
    assert Team.objects.get(pk=team.pk).priority_class == "interactive"
    assert Event.objects.filter(kind="team.changed").count() == 1
    made = client.post("/admin/access/apikey/add/", {"user": alice.pk, "priority_class": "batch"})
    assert made.status_code == 200
    key = ApiKey.objects.get()
    assert key.priority_class == "batch"
    assert (
        '<td class="field-priority">batch</td>'
        in client.get("/admin/access/apikey/").content.decode()
    )
    form = client.get(f"/admin/access/apikey/{key.pk}/change/").content.decode()
    assert 'name="priority_class"' in form
    back = client.post(f"/admin/access/apikey/{key.pk}/change/",
                       {"name": "x", "priority_class": ""})  # fmt: skip
    assert back.status_code == 302, back.content
    assert ApiKey.objects.get(pk=key.pk).priority_class == ""
