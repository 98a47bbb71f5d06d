"""Deployments in the admin: the same validation and saving as the CLI, via the services."""

from __future__ import annotations

import shlex
from typing import Any

from django import forms
from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest

from capyctl.admin_utils import ReadOnlyAdmin, attach_user_error
from capyctl.deployments import adapters
from capyctl.deployments.models import Adapter, Deployment, Instance, LoadedAdapter
from capyctl.deployments.services import (
    SETTING_FIELDS,
    DeploymentSpec,
    add_deployment,
    check_deployment,
    update_deployment,
)
from capyctl.deployments.settings_spec import (
    MEMORY,
    PARKING,
    PRICES,
    REQUESTS,
    SETTINGS,
    Setting,
)
from capyctl.errors import UserError
from capyctl.scheduler.intents import request_action, restart_to_take
from capyctl.validation import parse_gpu_memory, parse_size_value, split_engine_args
from hostagent.units import format_size_exact

_PLAIN_FIELDS = ("source", *SETTING_FIELDS)


class DeploymentForm(forms.ModelForm):  # type: ignore[type-arg]
    aliases_text = forms.CharField(
        label="Aliases", required=False, help_text="other names, separated by commas"
    )
    gpu_memory = forms.CharField(
        required=False,
        help_text="per GPU: 20GiB, or a fraction of the device: 0.9 (empty: estimate)",
    )
    weights_size = forms.CharField(required=False, help_text="size of the weights copy, e.g. 15GiB")
    args_text = forms.CharField(
        label="Engine args", required=False, help_text="extra engine arguments, as on a shell"
    )
    media_domains = forms.CharField(
        label="Media domains",
        required=False,
        help_text="hosts whose http(s) image, audio and video URLs requests may name, "
        "separated by commas (empty: data: URLs only)",
    )

    class Meta:
        model = Deployment
        fields = ("name", "engine", "host", *_PLAIN_FIELDS)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for setting in SETTINGS:  # left out: its declared default (or the global one)
            if setting.name in self.fields:
                self.fields[setting.name].required = False
        obj = self.instance
        if obj.pk:
            self.initial["aliases_text"] = ", ".join(obj.alias_names)
            self.initial["args_text"] = shlex.join(obj.engine_args)
            self.initial["media_domains"] = ", ".join(obj.media_domains)
            if obj.gpu_memory_bytes is not None:
                self.initial["gpu_memory"] = format_size_exact(obj.gpu_memory_bytes)
            elif obj.gpu_memory_fraction is not None:
                self.initial["gpu_memory"] = f"{obj.gpu_memory_fraction:g}"
            if obj.weights_bytes is not None:
                self.initial["weights_size"] = format_size_exact(obj.weights_bytes)

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        if self.errors:
            return data
        try:
            self.spec = self._spec(data)
            check_deployment(self.spec, exclude_pk=self.instance.pk)
        except UserError as exc:
            attach_user_error(self, exc)
        return data

    def _spec(self, data: dict[str, Any]) -> DeploymentSpec:
        gpu_bytes, fraction = (None, None)
        if data.get("gpu_memory"):
            gpu_bytes, fraction = parse_gpu_memory(data["gpu_memory"])
        weights = data.get("weights_size")
        plain: dict[str, Any] = {name: data.get(name) for name in _PLAIN_FIELDS}
        for setting in SETTINGS:
            if plain.get(setting.name) in (None, "") and setting.default is not None:
                plain[setting.name] = setting.default
        return DeploymentSpec(
            name=data["name"],
            engine=data["engine"].name,
            host=data["host"].name if data.get("host") else None,
            aliases=[a.strip() for a in (data.get("aliases_text") or "").split(",") if a.strip()],
            gpu_memory_bytes=gpu_bytes,
            gpu_memory_fraction=fraction,
            weights_bytes=parse_size_value(weights, field="weights_bytes") if weights else None,
            engine_args=split_engine_args(data.get("args_text") or ""),
            media_domains=[
                d.strip() for d in (data.get("media_domains") or "").split(",") if d.strip()
            ],
            **plain,
        )


# Fields of each section that are not declared settings, before those that are (the
# media domains, after).
_SECTION_FIELDS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    MEMORY: (("gpu_memory", "weights_size"), ()),
    PARKING: ((), ()),
    REQUESTS: ((), ("media_domains",)),
    PRICES: ((), ()),
}


def setting_fieldsets(settings: tuple[Setting, ...]) -> tuple[Any, ...]:
    """The admin's sections, each with its declared settings in the declared order."""
    return tuple(
        (section, {"fields": (*before, *(s.name for s in settings if s.section == section),
                              *after)})
        for section, (before, after) in _SECTION_FIELDS.items()
    )  # fmt: skip


@admin.register(Deployment)
class DeploymentAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    form = DeploymentForm
    list_display = (
        "name",
        "engine",
        "host",
        "desired_state",
        "observed_state",
        "parked_mode",
        "pinned_mark",
        "priority",
    )
    list_filter = ("desired_state", "observed_state", "engine", "host", "pinned")
    search_fields = ("name", "aliases__name", "source")
    readonly_fields = (
        "desired_state",
        "observed_state",
        "parked_mode",
        "state_reason",
        "state_changed_at",
        "last_request_at",
        "measured_gpu_bytes",
        "measured_weights_bytes",
        "measured_residual_bytes",
    )
    fieldsets = (
        (None, {"fields": ("name", "aliases_text", "engine", "host", "source", "args_text")}),
        *setting_fieldsets(SETTINGS),
        ("State", {"fields": readonly_fields}),
    )

    actions = ("start", "stop", "park_ram", "park_deep", "wake")

    def get_queryset(self, request: HttpRequest) -> QuerySet[Deployment]:
        """Deployments, not the rows of their replicas past the first (kept in step with
        their deployment: people change the deployment)."""
        return super().get_queryset(request).filter(replica_of__isnull=True)

    @admin.display(description="pinned", ordering="pinned")
    def pinned_mark(self, deployment: Deployment) -> str:
        """In words: the admin's boolean icons put a red cross on every model that is
        simply not pinned, which reads as an error."""
        return "yes" if deployment.pinned else "—"

    def _ask(
        self, request: HttpRequest, queryset: QuerySet[Deployment], verb: str, mode: str = ""
    ) -> None:
        """Hand the action to the scheduler for each selected deployment (not waiting)."""
        asked: list[str] = []
        saved: list[str] = []
        for deployment in queryset:
            try:
                op = request_action(deployment, verb, mode=mode, actor=request.user.get_username())
            except UserError as exc:
                self.message_user(request, str(exc), messages.ERROR)
                continue
            (asked if op is not None else saved).append(deployment.name)
        if asked:
            self.message_user(
                request,
                f"Asked to {verb} {', '.join(asked)}; the outcome shows in its state and in "
                "the events.",
                messages.SUCCESS,
            )
        if saved:
            self.message_user(
                request,
                f"Saved: {', '.join(saved)} should be "
                f"{'running' if verb == 'start' else 'stopped'}. No CapyCTL server is running, "
                "so it takes effect when one runs.",
                messages.WARNING,
            )

    @admin.action(description="Start the selected deployments")
    def start(self, request: HttpRequest, queryset: QuerySet[Deployment]) -> None:
        self._ask(request, queryset, "start")

    @admin.action(description="Stop the selected deployments")
    def stop(self, request: HttpRequest, queryset: QuerySet[Deployment]) -> None:
        self._ask(request, queryset, "stop")

    @admin.action(description="Park the selected deployments (weights to host RAM)")
    def park_ram(self, request: HttpRequest, queryset: QuerySet[Deployment]) -> None:
        self._ask(request, queryset, "park", "ram")

    @admin.action(description="Park the selected deployments (deep: weights dropped)")
    def park_deep(self, request: HttpRequest, queryset: QuerySet[Deployment]) -> None:
        self._ask(request, queryset, "park", "deep")

    @admin.action(description="Wake the selected deployments")
    def wake(self, request: HttpRequest, queryset: QuerySet[Deployment]) -> None:
        self._ask(request, queryset, "wake")

    def save_model(
        self, request: HttpRequest, obj: Deployment, form: DeploymentForm, change: bool
    ) -> None:
        actor = request.user.get_username()
        if change:
            original = Deployment.objects.get(pk=obj.pk)
            saved = update_deployment(original.name, form.spec, actor=actor)
        else:
            saved = add_deployment(form.spec, actor=actor)
        obj.pk = saved.pk
        obj.refresh_from_db()

    def save_related(self, request: HttpRequest, form: Any, formsets: Any, change: bool) -> None:
        # Aliases are saved by the service; the form has no many-to-many fields of its own.
        for formset in formsets:
            self.save_formset(request, form, formset, change=change)


@admin.register(Instance)
class InstanceAdmin(ReadOnlyAdmin):
    list_display = ("deployment", "host", "state", "pid", "port", "socket_path", "started_at",
                    "ended_at")  # fmt: skip
    list_filter = ("state", "host")
    exclude = ("launch_key",)


class AdapterForm(forms.ModelForm):  # type: ignore[type-arg]
    class Meta:
        model = Adapter
        fields = ("name", "base", "source")

    def clean(self) -> dict[str, Any]:
        """The service's checks, each shown on its field, before anything is saved."""
        data = super().clean() or {}
        if self.errors:
            return data
        try:
            adapters.check_adapter(data["name"], data["base"].name, data["source"])
        except UserError as exc:
            attach_user_error(self, exc)
        return data


@admin.register(Adapter)
class AdapterAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    """Adapters: added through the same service as ``capyctl adapter add`` and REST; one
    is not edited (remove it and add it again), and is removed only while no engine holds
    it."""

    form = AdapterForm
    list_display = ("name", "base", "source", "source_bytes", "created_at")
    list_filter = ("base",)
    search_fields = ("name", "base__name", "source")
    readonly_fields = ("source_bytes", "created_at")

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> Any:
        return ("name", "base", "source", *self.readonly_fields) if obj else self.readonly_fields

    def save_model(
        self, request: HttpRequest, obj: Adapter, form: AdapterForm, change: bool
    ) -> None:
        if change:
            return
        data = form.cleaned_data
        saved = adapters.add_adapter(data["name"], data["base"].name, data["source"],
                                     actor=request.user.get_username())  # fmt: skip
        restart = restart_to_take(saved, actor=request.user.get_username())
        if restart:
            self.message_user(request, f"{saved.name}: {restart}.", messages.INFO)
        obj.pk = saved.pk
        obj.refresh_from_db()

    def delete_model(self, request: HttpRequest, obj: Adapter) -> None:
        adapters.remove_adapter(obj.name, actor=request.user.get_username())

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[Adapter]) -> None:
        for adapter in queryset:
            try:
                adapters.remove_adapter(adapter.name, actor=request.user.get_username())
            except UserError as exc:
                self.message_user(request, str(exc), messages.ERROR)


@admin.register(LoadedAdapter)
class LoadedAdapterAdmin(ReadOnlyAdmin):
    list_display = ("adapter", "instance", "loaded_at", "load_seconds", "last_used_at")
