"""A deployment setting is declared once (capyctl.deployments.settings_spec): the model,
the service, REST, the admin, the CLI, the listings and the what-if model are built from
the declaration, so a setting declared there shows on each of them."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys

import pytest
from django.conf import settings as django_settings
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models
from rest_framework.fields import IntegerField

from capyctl.api import serializers as s
from capyctl.cli.parser import _deployment_settings, build_parser
from capyctl.cli.parsing import Parser
from capyctl.deployments import settings_spec
from capyctl.deployments.admin import DeploymentAdmin, DeploymentForm, setting_fieldsets
from capyctl.deployments.models import Deployment, OverClaim, ParkPolicy, Routing, Spread
from capyctl.deployments.services import SETTING_FIELDS, DeploymentSpec
from capyctl.deployments.settings_spec import COUNT, FLAG, PARKING, SETTINGS, Setting
from capyctl.whatif.model import MIRRORED_SETTINGS, SimModel

NAMES = [setting.name for setting in SETTINGS]


def _deployment_parser(*, update: bool) -> Parser:
    parser = Parser(prog="capyctl deployment add")
    _deployment_settings(parser, update=update)
    return parser


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    return {flag for action in parser._actions for flag in action.option_strings}


def _deployment_sub(parser: argparse.ArgumentParser, action: str) -> argparse.ArgumentParser:
    """``capyctl deployment ACTION``'s parser inside the whole command line's."""
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    deployment = commands.choices["deployment"]
    actions = next(a for a in deployment._actions if isinstance(a, argparse._SubParsersAction))
    found: argparse.ArgumentParser = actions.choices[action]
    return found


@pytest.mark.parametrize("setting", SETTINGS, ids=NAMES)
def test_each_declared_setting_is_a_model_field_with_its_bounds_default_and_help(setting):
    field = Deployment._meta.get_field(setting.name)
    assert isinstance(field, models.Field)
    assert field.null == setting.nullable
    assert field.help_text == setting.model_help()
    if setting.default is not None:
        assert field.default == setting.default
    if setting.kind == COUNT:
        bounds = {type(v): v.limit_value for v in field.validators
                  if isinstance(v, MinValueValidator | MaxValueValidator)}  # fmt: skip
        assert bounds[MinValueValidator] == setting.minimum
        assert bounds[MaxValueValidator] == setting.maximum
    if setting.choices:
        assert tuple(value for value, _ in field.choices or ()) == setting.choices


@pytest.mark.parametrize("setting", SETTINGS, ids=NAMES)
def test_each_declared_setting_is_a_spec_field_with_its_default(setting):
    fields = {f.name: f for f in dataclasses.fields(DeploymentSpec)}
    assert setting.name in fields
    assert fields[setting.name].default == setting.default
    assert setting.name in SETTING_FIELDS


@pytest.mark.parametrize("setting", SETTINGS, ids=NAMES)
def test_each_declared_setting_is_a_rest_field_in_and_out(setting):
    given = s.DeploymentIn().fields[setting.name]
    assert not given.required
    assert given.allow_null == setting.nullable
    if setting.kind == COUNT:
        assert isinstance(given, IntegerField)
        assert given.min_value == setting.least_api
        assert given.max_value == setting.maximum
    assert setting.name in s.DeploymentOut().fields


@pytest.mark.parametrize("setting", SETTINGS, ids=NAMES)
def test_each_declared_setting_is_an_admin_field_in_its_section(setting):
    form = DeploymentForm()
    assert setting.name in form.fields
    assert not form.fields[setting.name].required  # left out: its default
    sections = {name: options["fields"] for name, options in DeploymentAdmin.fieldsets}
    assert setting.name in sections[setting.section]


@pytest.mark.parametrize("setting", SETTINGS, ids=NAMES)
def test_each_declared_setting_is_a_flag_of_deployment_add_and_update(setting):
    parser = build_parser()
    if not setting.on_cli:  # given as another flag's LOW part (--replicas MIN:MAX)
        (owner,) = [s for s in SETTINGS if s.low_part == setting.name]
        assert owner.on_cli
        added = _deployment_parser(update=False).parse_args([owner.flag, "1:2"])
        assert getattr(added, owner.dest) == (1, 2)
        return
    for action in ("add", "update"):
        assert setting.flag in _flags(_deployment_sub(parser, action))
    added = _deployment_parser(update=False).parse_args([])
    assert getattr(added, setting.dest) == setting.default
    assert setting.dest not in vars(_deployment_parser(update=True).parse_args([]))


def test_the_listing_shows_each_declared_setting_as_it_applies(settings):
    settings.CAPYCTL = {**django_settings.CAPYCTL, "MAX_QUEUE_SECONDS": 0,
                        "WAKE_TIMEOUT_SECONDS": 77}  # fmt: skip
    values = Deployment(name="x").setting_values()
    assert list(values) == NAMES
    assert values["max_queue_seconds"] == 77  # 0: its wake timeout
    assert values["gpus"] == 1
    assert Deployment(name="x", min_ready_seconds=5).setting("min_ready_seconds") == 5


def test_global_defaults_and_choices_are_those_declared():
    for setting in SETTINGS:
        if setting.global_key is not None:
            assert setting.global_key in django_settings.CAPYCTL, setting.name
    assert settings_spec.SETTING["park"].choices == tuple(ParkPolicy.values)
    assert settings_spec.SETTING["over_claim"].choices == tuple(OverClaim.values)
    assert settings_spec.SETTING["spread"].choices == tuple(Spread.values)
    assert settings_spec.SETTING["routing"].choices == tuple(Routing.values)


def test_the_whatif_model_starts_from_the_declared_defaults():
    model = SimModel("x")
    for name in MIRRORED_SETTINGS:
        assert getattr(model, name) == settings_spec.builtin_default(name), name
    assert model.max_queue_seconds == settings_spec.builtin_default("wake_timeout_seconds")


def test_flags_kept_as_they_were():
    """Flag spellings, and bounds an entry point held to before the declaration."""
    flags = {setting.name: setting.flag for setting in SETTINGS}
    assert flags["wake_timeout_seconds"] == "--wake-timeout"
    assert flags["start_timeout_seconds"] == "--start-timeout"
    assert flags["drain_timeout_seconds"] == "--drain-timeout"
    assert flags["max_tokens_ceiling"] == "--max-tokens-ceiling"
    parser = _deployment_parser(update=False)
    with pytest.raises(SystemExit):
        parser.parse_args(["--wake-timeout", "0"])  # the CLI asks at least 1, as before
    assert parser.parse_args(["--drain-timeout", "0"]).drain_timeout == 0
    assert s.DeploymentIn(data={"max_waiting": 0}, partial=True).is_valid()  # the service says
    assert not s.DeploymentIn(data={"wake_timeout_seconds": 0}, partial=True).is_valid()


def test_the_service_messages_come_from_the_declaration():
    spec = settings_spec.SETTING
    assert spec["priority"].check(2000) == "invalid priority 2000: use -1000 to 1000"
    assert spec["park"].check("x") == "invalid park policy 'x' (use auto, ram, deep, stop, never)"
    assert spec["over_claim"].check("y") == "invalid over-claim 'y' (use stop, raise)"
    assert spec["n_ceiling"].check(0) == "invalid n ceiling 0: use 1 to 2147483647"
    assert spec["idle_park_seconds"].check(None) is None  # empty: the global default
    assert spec["gpus"].check(None) == "invalid gpus None: use 0 to 64"


WARMUP = Setting(
    "warmup_seconds",
    COUNT,
    "how long it warms up after a start",
    PARKING,
    builtin=5,
    minimum=0,
    maximum=600,
    metavar="N",
)
SHARED = Setting("shared", FLAG, "may share its GPUs", PARKING, default=False)


def test_a_setting_declared_shows_in_the_serializers_parser_and_admin(monkeypatch):
    monkeypatch.setattr(settings_spec, "SETTINGS", (*SETTINGS, WARMUP, SHARED))

    given = s.deployment_in()
    assert set(given().fields) >= {"warmup_seconds", "shared"}
    ok = given(data={"warmup_seconds": 30, "shared": True}, partial=True)
    assert ok.is_valid(), ok.errors
    assert ok.validated_data == {"warmup_seconds": 30, "shared": True}
    too_long = given(data={"warmup_seconds": 601}, partial=True)
    assert not too_long.is_valid()
    assert "warmup_seconds" in too_long.errors
    assert given(data={"warmup_seconds": None}, partial=True).is_valid()  # its global default
    assert set(s.deployment_out()().fields) >= {"warmup_seconds", "shared"}

    parser = build_parser()
    args = parser.parse_args(["deployment", "add", "x", "--engine", "e", "--source", "m",
                              "--warmup-seconds", "12", "--shared"])  # fmt: skip
    assert (args.warmup_seconds, args.shared) == (12, True)
    update = parser.parse_args(["deployment", "update", "x", "--no-shared"])
    assert update.shared is False
    assert "warmup_seconds" not in vars(update)
    assert "--warmup-seconds N" in _deployment_sub(parser, "add").format_help()
    with pytest.raises(SystemExit):
        parser.parse_args(["deployment", "add", "x", "--engine", "e", "--source", "m",
                           "--warmup-seconds", "-1"])  # fmt: skip

    sections = dict(setting_fieldsets(settings_spec.SETTINGS))
    assert sections[PARKING]["fields"][-2:] == ("warmup_seconds", "shared")
    assert WARMUP.check(601) == "invalid warmup seconds 601: use 0 to 600"
    assert WARMUP.cli_help() == "how long it warms up after a start (default 5)"


def test_the_builtin_global_defaults_are_those_settings_start_from(tmp_path):
    """Where no CAPYCTL_ variable sets them, the global defaults are the declared builtins
    (what the what-if model starts from)."""
    script = (
        "import json, django; django.setup(); from django.conf import settings; "
        "from capyctl.deployments.settings_spec import SETTINGS; "
        "print(json.dumps({s.name: [settings.CAPYCTL[s.global_key], s.builtin] "
        "for s in SETTINGS if s.global_key}))"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("CAPYCTL_")}
    env |= {"CAPYCTL_DATA_DIR": str(tmp_path), "DJANGO_SETTINGS_MODULE": "capyctl.settings"}
    found = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                           text=True, check=True, timeout=120)  # fmt: skip
    pairs = json.loads(found.stdout)
    assert pairs
    assert all(value == builtin for value, builtin in pairs.values()), pairs
