"""Shapes of the REST API. Output is the same plain data as the CLI's ``--json``
(:mod:`capyctl.reports`); input is checked for types here and for meaning by the
services, whose errors name the field at fault."""

from __future__ import annotations

from typing import Any

from rest_framework import serializers
from rest_framework.fields import empty

from capyctl import reports
from capyctl.access.classes import CLASSES
from capyctl.deployments import guards, settings_spec
from capyctl.deployments.settings_spec import (
    CHOICE,
    FLAG,
    MAX_COUNT,
    MAX_PRICE,
    PRICE,
    Setting,
)
from capyctl.validation import MAX_SIZE_BYTES

# -- output ---------------------------------------------------------------------------------


class _Report(serializers.Serializer):  # type: ignore[type-arg]
    """Declared fields document the shape; the data comes from one report function."""

    report: Any = None

    def to_representation(self, instance: Any) -> dict[str, Any]:
        return dict(type(self).report(instance))


class ParkKeptMemory(serializers.Serializer):  # type: ignore[type-arg]
    """A park of the engine left its GPU memory held: since when, what the probe saw, and
    when an idle moment may check it again."""

    since = serializers.DateTimeField()
    reason = serializers.CharField()
    next_check_after = serializers.DateTimeField(allow_null=True)


class EngineOut(_Report):
    report = staticmethod(reports.engine_data)
    name = serializers.CharField()
    kind = serializers.CharField()
    command = serializers.CharField()
    host = serializers.CharField(allow_null=True)
    parks = serializers.ChoiceField(choices=["yes", "no", "kept memory"])
    park_kept_memory = ParkKeptMemory(allow_null=True)
    version = serializers.CharField(
        allow_null=True, help_text="what the program's --version said (null: not known yet)"
    )
    version_note = serializers.CharField(help_text="why the version is not known, if it is not")
    flags = serializers.ListField(
        child=serializers.CharField(),
        allow_null=True,
        help_text="the flags its --help lists, where its kind reads one",
    )
    version_checked_at = serializers.DateTimeField(allow_null=True)
    created_at = serializers.DateTimeField()


class AdapterOut(_Report):
    report = staticmethod(reports.adapter_data)
    name = serializers.CharField(help_text="the model name requests use for it")
    base = serializers.CharField(help_text="the deployment whose engine serves it")
    source = serializers.CharField()  # type: ignore[assignment]
    state = serializers.ChoiceField(choices=["loaded", "on the host", "not fetched"])
    loaded_on = serializers.ListField(
        child=serializers.CharField(), help_text="the base's engines (rows) that hold it"
    )


class AdapterIn(serializers.Serializer):  # type: ignore[type-arg]
    name = serializers.CharField(max_length=63)
    base = serializers.CharField(max_length=128, help_text="a deployment given adapter slots")
    source = serializers.CharField(  # type: ignore[assignment]
        max_length=1024, help_text="local path, hf://ORG/NAME or URL"
    )


class DeploymentOutBase(_Report):
    report = staticmethod(reports.deployment_data)
    name = serializers.CharField()
    aliases = serializers.ListField(child=serializers.CharField())
    engine = serializers.CharField()
    kind = serializers.CharField()
    host = serializers.CharField(allow_null=True)
    source = serializers.CharField()  # type: ignore[assignment]
    engine_args = serializers.ListField(child=serializers.CharField())
    gpu_memory_bytes = serializers.IntegerField(allow_null=True)
    gpu_memory_fraction = serializers.FloatField(allow_null=True)
    weights_bytes = serializers.IntegerField(allow_null=True)
    measured_gpu_bytes = serializers.IntegerField(allow_null=True)
    measured_weights_bytes = serializers.IntegerField(allow_null=True)
    weights_copy_bytes = serializers.IntegerField(
        allow_null=True,
        help_text="host RAM a ram park promises for its copy: the larger of weights_bytes "
        "(declared) and measured_weights_bytes (its last ram park's copy)",
    )
    measured_residual_bytes = serializers.IntegerField(
        allow_null=True,
        help_text="what its last confirmed park left on each of its GPUs (the most), counted "
        "on when it is parked again; empty until a park measured it",
    )
    media_domains = serializers.ListField(
        child=serializers.CharField(),
        help_text="hosts whose http(s) media URLs requests may name (empty: data: URLs only)",
    )
    desired_state = serializers.CharField()
    observed_state = serializers.CharField()
    parked_mode = serializers.CharField(allow_null=True)
    state_reason = serializers.CharField()
    download = serializers.DictField(
        allow_null=True, help_text="the source's last fetch: done/total bytes, rate, ETA, outcome"
    )
    source_bytes = serializers.IntegerField(allow_null=True, help_text="weights size at the source")
    last_request_at = serializers.DateTimeField(allow_null=True)


def setting_out(setting: Setting) -> serializers.Field:  # type: ignore[type-arg]
    """A declared setting as the output shows it: as it applies (an empty one: its
    global default)."""
    if setting.kind == FLAG:
        return serializers.BooleanField(help_text=setting.help)
    if setting.kind == CHOICE:
        return serializers.CharField(help_text=setting.help)
    if setting.kind == PRICE:
        return serializers.FloatField(help_text=setting.help)
    return serializers.IntegerField(help_text=setting.help)


def deployment_out(settings: tuple[Setting, ...] | None = None) -> type[_Report]:
    """The deployment output serializer, with a field for each declared setting (None:
    each :data:`capyctl.deployments.settings_spec.SETTINGS` lists now)."""
    chosen = settings_spec.SETTINGS if settings is None else settings
    fields = {setting.name: setting_out(setting) for setting in chosen}
    return type("DeploymentOut", (DeploymentOutBase,), {"__module__": __name__, **fields})


DeploymentOut = deployment_out()


class PoolOut(serializers.Serializer):  # type: ignore[type-arg]
    pool = serializers.CharField()
    reserve_bytes = serializers.IntegerField()
    capacity_bytes = serializers.IntegerField()
    held_bytes = serializers.IntegerField()
    promised_bytes = serializers.IntegerField()
    unconfirmed_bytes = serializers.IntegerField()
    foreign_bytes = serializers.IntegerField()
    used_bytes = serializers.IntegerField()
    free_bytes = serializers.IntegerField()


class HostOut(_Report):
    report = staticmethod(reports.host_data)
    name = serializers.CharField()
    address = serializers.CharField(allow_null=True)
    local = serializers.BooleanField()
    state = serializers.CharField()
    draining = serializers.BooleanField(help_text="nothing new is placed here (host drain)")
    probe = serializers.CharField(allow_null=True)
    unified = serializers.BooleanField()
    gpus = serializers.ListField(child=serializers.DictField())
    ram_total_bytes = serializers.IntegerField(allow_null=True)
    pools = PoolOut(many=True)
    last_seen_at = serializers.DateTimeField(allow_null=True)


class HostAdded(HostOut):
    join_token = serializers.CharField(help_text="one-time token for `capyctl start host --join`")

    def to_representation(self, instance: Any) -> dict[str, Any]:
        host, token = instance
        return {**reports.host_data(host), "join_token": token}


class KeyOut(_Report):
    report = staticmethod(reports.key_data)
    id = serializers.CharField()
    prefix = serializers.CharField()
    user = serializers.CharField()
    name = serializers.CharField()
    models = serializers.ListField(
        child=serializers.CharField(), help_text="the models it may use, if not all_models"
    )
    all_models = serializers.BooleanField(
        help_text="true: every model (models is empty); false: only models, so none if empty"
    )
    team = serializers.CharField(allow_null=True, help_text="the team it is charged to")
    priority_class = serializers.ChoiceField(
        CLASSES, allow_null=True, help_text="its own class (null: its team's, else interactive)"
    )
    admin = serializers.BooleanField()
    requests_per_minute = serializers.IntegerField(allow_null=True)
    max_concurrent = serializers.IntegerField(allow_null=True)
    expires_at = serializers.DateTimeField(allow_null=True)
    revoked = serializers.BooleanField()
    revoked_at = serializers.DateTimeField(allow_null=True)
    active = serializers.BooleanField()
    last_used_at = serializers.DateTimeField(allow_null=True)
    requests = serializers.IntegerField()
    prompt_tokens = serializers.IntegerField()
    completion_tokens = serializers.IntegerField()
    created_at = serializers.DateTimeField()


# The class it has (read only): its own, else its team's, else interactive. ``class`` is a
# keyword, so the field is declared here rather than in the class body.
KeyOut._declared_fields["class"] = serializers.ChoiceField(
    CLASSES, read_only=True, help_text="its own class, else its team's, else interactive"
)


class KeyCreated(KeyOut):
    key = serializers.CharField(help_text="the full key: shown this once, never again")

    def to_representation(self, instance: Any) -> dict[str, Any]:
        key, full = instance
        return {**reports.key_data(key), "key": full}


class LimitsOut(serializers.Serializer):  # type: ignore[type-arg]
    models = serializers.ListField(
        child=serializers.CharField(), allow_null=True, help_text="null: every model"
    )
    requests_per_minute = serializers.IntegerField(allow_null=True)
    max_concurrent = serializers.IntegerField(allow_null=True)
    key_lifetime_seconds = serializers.IntegerField(allow_null=True)


class UserOut(_Report):
    report = staticmethod(reports.user_data)
    username = serializers.CharField()
    staff = serializers.BooleanField()
    active = serializers.BooleanField()
    date_joined = serializers.DateTimeField()
    last_login = serializers.DateTimeField(allow_null=True)
    keys = serializers.IntegerField()
    limits = LimitsOut()


class LedgerOut(serializers.Serializer):  # type: ignore[type-arg]
    id = serializers.IntegerField()
    host = serializers.CharField(source="host.name")
    pool = serializers.CharField()
    deployment = serializers.CharField(source="deployment.name", allow_null=True)
    status = serializers.CharField()
    bytes = serializers.IntegerField()
    note = serializers.CharField()
    updated_at = serializers.DateTimeField()


class EventOut(_Report):
    report = staticmethod(reports.event_data)
    id = serializers.IntegerField()
    time = serializers.DateTimeField()
    kind = serializers.CharField()
    level = serializers.CharField()
    subject = serializers.CharField()
    message = serializers.CharField()
    duration_ms = serializers.IntegerField(allow_null=True)
    actor = serializers.CharField()


class OperationOut(serializers.Serializer):  # type: ignore[type-arg]
    id = serializers.IntegerField()
    deployment = serializers.CharField(source="deployment.name")
    action = serializers.CharField()
    mode = serializers.CharField()
    actor = serializers.CharField()
    status = serializers.CharField(help_text="pending, running, done or failed")
    message = serializers.CharField()
    created_at = serializers.DateTimeField()
    started_at = serializers.DateTimeField(allow_null=True)
    finished_at = serializers.DateTimeField(allow_null=True)


# -- input ----------------------------------------------------------------------------------


class EngineIn(serializers.Serializer):  # type: ignore[type-arg]
    name = serializers.CharField(max_length=63)
    kind = serializers.CharField(max_length=32, help_text="vllm, sglang, tensorfold, llama.cpp…")
    command = serializers.CharField(max_length=4000, help_text="the engine program, with args")
    host = serializers.CharField(required=False, allow_null=True, max_length=63)
    env = serializers.DictField(child=serializers.CharField(allow_blank=True), required=False)
    options = serializers.DictField(required=False)


class SizeField(serializers.CharField):
    """A size: bytes as a JSON integer, or text with a unit (``20GiB``); text without a
    unit is refused by the deployment's checks, with what to write."""

    def run_validation(self, data: Any = empty) -> Any:
        if isinstance(data, int) and not isinstance(data, bool):
            return data
        return super().run_validation(data)


class DeploymentInBase(serializers.Serializer):  # type: ignore[type-arg]
    """What a deployment is; :func:`deployment_in` adds its declared settings."""

    name = serializers.CharField(max_length=63)
    engine = serializers.CharField(max_length=63)
    source = serializers.CharField(max_length=1000)  # type: ignore[assignment]
    aliases = serializers.ListField(child=serializers.CharField(max_length=200), required=False)
    host = serializers.CharField(required=False, allow_null=True, max_length=63)
    gpu_memory = SizeField(
        required=False, allow_null=True, allow_blank=True, max_length=32,
        help_text="per GPU: 20GiB, bytes as an integer, or a fraction of the device such as 0.9",
    )  # fmt: skip
    weights_size = SizeField(
        required=False, allow_null=True, allow_blank=True, max_length=32,
        help_text="e.g. 15GiB, or bytes as an integer",
    )  # fmt: skip
    engine_args = serializers.ListField(
        child=serializers.CharField(max_length=4000), required=False
    )
    media_domains = serializers.ListField(
        child=serializers.CharField(max_length=253),
        required=False,
        max_length=guards.MAX_MEDIA_DOMAINS,
        help_text="hosts whose http(s) media URLs requests may name (empty: data: URLs only)",
    )


def setting_in(setting: Setting) -> serializers.Field:  # type: ignore[type-arg]
    """A declared setting as a request gives it: optional; null (where it has a global
    default) empties it."""
    if setting.kind == FLAG:
        return serializers.BooleanField(required=False, help_text=setting.help)
    if setting.kind == CHOICE:
        return serializers.ChoiceField(
            choices=setting.choices, required=False, help_text=setting.help
        )
    if setting.kind == PRICE:
        return serializers.FloatField(required=False, min_value=0, max_value=MAX_PRICE,
                                      help_text=setting.help)  # fmt: skip
    return serializers.IntegerField(
        required=False,
        allow_null=setting.nullable,
        min_value=setting.least_api,
        max_value=setting.maximum,
        help_text=setting.help,
    )


def deployment_in(
    settings: tuple[Setting, ...] | None = None,
) -> type[serializers.Serializer]:  # type: ignore[type-arg]
    """The deployment input serializer, with a field for each declared setting (None:
    each :data:`capyctl.deployments.settings_spec.SETTINGS` lists now)."""
    chosen = settings_spec.SETTINGS if settings is None else settings
    fields = {setting.name: setting_in(setting) for setting in chosen}
    return type("DeploymentIn", (DeploymentInBase,), {"__module__": __name__, **fields})


DeploymentIn = deployment_in()


class ActionIn(serializers.Serializer):  # type: ignore[type-arg]
    mode = serializers.ChoiceField(
        choices=["ram", "deep", "rolling"], required=False,
        help_text="a park's: where the weights go (ram, deep); a restart's: rolling",
    )  # fmt: skip
    wait = serializers.FloatField(
        required=False, default=0, min_value=0, max_value=3600,
        help_text="seconds to wait for the outcome (0: answer at once with the operation)",
    )  # fmt: skip


class HostIn(serializers.Serializer):  # type: ignore[type-arg]
    name = serializers.CharField(max_length=63)
    address = serializers.CharField(max_length=255, help_text="HOST:PORT the agent listens on")


class HostChange(serializers.Serializer):  # type: ignore[type-arg]
    address = serializers.CharField(max_length=255, required=False)
    gpu_reserve_bytes = serializers.IntegerField(
        required=False, allow_null=True, min_value=0, max_value=MAX_SIZE_BYTES
    )
    ram_reserve_bytes = serializers.IntegerField(
        required=False, allow_null=True, min_value=0, max_value=MAX_SIZE_BYTES
    )


_BAD_CLASS: dict[str, Any] = {
    "invalid_choice": "{input!r} is not a priority class: interactive or batch"
}


def _key_class() -> serializers.ChoiceField:
    return serializers.ChoiceField(
        CLASSES, required=False, allow_null=True, allow_blank=True, error_messages=_BAD_CLASS,
        help_text="interactive or batch (batch: idle GPUs only; null or empty: its team's, "
        "else interactive)",
    )  # fmt: skip


class KeyIn(serializers.Serializer):  # type: ignore[type-arg]
    user = serializers.CharField(
        required=False, max_length=150, help_text="staff only: whose key (default: yours)"
    )
    name = serializers.CharField(required=False, allow_blank=True, max_length=100)
    models = serializers.ListField(
        child=serializers.CharField(max_length=200), required=False,
        help_text="deployments it may use (left out or empty: all its user may use)",
    )  # fmt: skip
    expires = serializers.CharField(
        required=False, allow_blank=True, max_length=16, help_text="e.g. 30d, 12h"
    )
    admin = serializers.BooleanField(required=False, default=False)
    requests_per_minute = serializers.IntegerField(
        required=False, allow_null=True, min_value=1, max_value=MAX_COUNT
    )
    max_concurrent = serializers.IntegerField(
        required=False, allow_null=True, min_value=1, max_value=MAX_COUNT
    )
    team = serializers.CharField(
        required=False, allow_null=True, max_length=63,
        help_text="the team it is charged to: one of its user's (left out or null: none)",
    )  # fmt: skip
    priority_class = _key_class()


class KeyChange(serializers.Serializer):  # type: ignore[type-arg]
    name = serializers.CharField(required=False, allow_blank=True, max_length=100)
    models = serializers.ListField(
        child=serializers.CharField(max_length=200), required=False,
        help_text="deployments it may use (empty: all its user may use)",
    )  # fmt: skip
    requests_per_minute = serializers.IntegerField(
        required=False, allow_null=True, min_value=1, max_value=MAX_COUNT
    )
    max_concurrent = serializers.IntegerField(
        required=False, allow_null=True, min_value=1, max_value=MAX_COUNT
    )
    team = serializers.CharField(
        required=False, allow_null=True, max_length=63,
        help_text="the team it is charged to: one of its user's (null: none)",
    )  # fmt: skip
    priority_class = _key_class()


class TeamOut(_Report):
    report = staticmethod(reports.team_data)
    name = serializers.CharField()
    members = serializers.ListField(child=serializers.CharField())
    priority_class = serializers.ChoiceField(
        CLASSES, help_text="its keys' class, unless a key has its own"
    )
    keys = serializers.IntegerField(allow_null=True, help_text="its keys not revoked")
    created_at = serializers.DateTimeField()


class TeamIn(serializers.Serializer):  # type: ignore[type-arg]
    name = serializers.CharField(max_length=63)
    priority_class = serializers.ChoiceField(
        CLASSES, required=False, default="interactive", error_messages=_BAD_CLASS,
        help_text="its keys' class, unless a key has its own (batch: idle GPUs only)",
    )  # fmt: skip


class TeamChange(serializers.Serializer):  # type: ignore[type-arg]
    priority_class = serializers.ChoiceField(
        CLASSES, error_messages=_BAD_CLASS,
        help_text="its keys' class, unless a key has its own (batch: idle GPUs only)",
    )  # fmt: skip


class MemberIn(serializers.Serializer):  # type: ignore[type-arg]
    user = serializers.CharField(max_length=150)


class LimitsIn(serializers.Serializer):  # type: ignore[type-arg]
    """A user's ceilings, set by staff; each of their keys can only narrow them."""

    models = serializers.ListField(
        child=serializers.CharField(max_length=200), required=False, allow_null=True,
        help_text="the models they may use (null: every model)",
    )  # fmt: skip
    requests_per_minute = serializers.IntegerField(
        required=False, allow_null=True, min_value=1, max_value=MAX_COUNT,
        help_text="across all of their keys (null: no ceiling)",
    )  # fmt: skip
    max_concurrent = serializers.IntegerField(
        required=False, allow_null=True, min_value=1, max_value=MAX_COUNT,
        help_text="requests in flight at once, across all of their keys (null: no ceiling)",
    )  # fmt: skip
    key_lifetime = serializers.CharField(
        required=False, allow_null=True, max_length=16,
        help_text="longest a key may live, e.g. 30d (null: no ceiling)",
    )  # fmt: skip

    LIMIT_FIELDS = ("models", "requests_per_minute", "max_concurrent", "key_lifetime")


class UserIn(LimitsIn):
    username = serializers.CharField(max_length=150)
    password = serializers.CharField(required=False, write_only=True, max_length=256)
    staff = serializers.BooleanField(required=False, default=False)


class UserChange(LimitsIn):
    password = serializers.CharField(required=False, write_only=True, max_length=256)
    staff = serializers.BooleanField(required=False)
    active = serializers.BooleanField(required=False)
