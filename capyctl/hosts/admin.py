"""Hosts in the admin. Adding one registers it and shows its one-time join token on the
page that answers the form (the same service as `capyctl host add`)."""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse

from capyctl.admin_utils import attach_user_error
from capyctl.errors import UserError
from capyctl.hosts.models import Host
from capyctl.hosts.services import add_host, new_join_token, parse_address
from capyctl.scheduler.host_states import drain_host, remove_host, revoke_host, undrain_host
from capyctl.validation import validate_name


class NewHostForm(forms.ModelForm):  # type: ignore[type-arg]
    class Meta:
        model = Host
        fields = ("name", "address")

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        try:
            validate_name(data.get("name") or "", what="host name", field="name")
            parse_address(data.get("address") or "")
        except UserError as exc:
            attach_user_error(self, exc)
        return data


@admin.register(Host)
class HostAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    list_display = ("name", "address", "state", "draining", "is_local", "last_seen_at")
    list_filter = ("state", "is_local")
    search_fields = ("name", "address")
    readonly_fields = ("is_local", "state", "inventory", "last_seen_at", "created_at", "updated_at")
    fields = ("name", "address", "gpu_reserve_bytes", "ram_reserve_bytes", *readonly_fields)
    actions = ("new_token", "revoke", "drain", "undrain", "remove")

    @admin.display(boolean=True, description="draining")
    def draining(self, obj: Host) -> bool:
        return obj.drain_started_at is not None

    def get_form(
        self, request: HttpRequest, obj: Any = None, change: bool = False, **kwargs: Any
    ) -> Any:
        if obj is None:
            kwargs["form"] = NewHostForm
            kwargs["fields"] = NewHostForm.Meta.fields
        return super().get_form(request, obj, change, **kwargs)

    def get_fields(self, request: HttpRequest, obj: Any = None) -> Any:
        return NewHostForm.Meta.fields if obj is None else self.fields

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> Any:
        return () if obj is None else self.readonly_fields

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        # Removal goes through the action below, which refuses hosts still in use.
        return False

    def save_model(self, request: HttpRequest, obj: Host, form: Any, change: bool) -> None:
        if change:  # only the fields the form changed: the state is the scheduler's
            changed = [f for f in form.changed_data if f in self.fields]
            if changed:
                obj.save(update_fields=[*changed, "updated_at"])
            return
        try:
            host, token = add_host(form.cleaned_data["name"], form.cleaned_data["address"])
        except UserError as exc:  # a race with another add: shown, nothing saved
            self.message_user(request, str(exc), messages.ERROR)
            return
        obj.pk = host.pk
        request._capyctl_join_token = token  # type: ignore[attr-defined]

    def response_add(
        self, request: HttpRequest, obj: Host, post_url_continue: Any = None
    ) -> HttpResponse:
        token = getattr(request, "_capyctl_join_token", None)
        if token is None:
            return super().response_add(request, obj, post_url_continue)
        return self._token_page(request, Host.objects.get(pk=obj.pk), token)

    def _token_page(self, request: HttpRequest, host: Host, token: str) -> TemplateResponse:
        context = {
            **self.admin_site.each_context(request),
            "title": f"Join token for {host.name}",
            "host": host,
            "token": token,
            "opts": self.opts,
        }
        return TemplateResponse(request, "admin/hosts/host/token.html", context)

    @admin.action(description="Make a new join token (earlier ones stop working)")
    def new_token(self, request: HttpRequest, queryset: QuerySet[Host]) -> HttpResponse | None:
        hosts = [h for h in queryset if not h.is_local]
        if len(hosts) != 1:
            self.message_user(request, "Select one remote host.", messages.ERROR)
            return None
        return self._token_page(request, hosts[0], new_join_token(hosts[0]))

    @admin.action(
        description="Revoke the certificates of the selected hosts (they must join again)"
    )
    def revoke(self, request: HttpRequest, queryset: QuerySet[Host]) -> None:
        for host in queryset:
            try:
                revoke_host(host.name, actor=request.user.get_username())
            except UserError as exc:
                self.message_user(request, str(exc), messages.ERROR)
            else:
                self.message_user(request, f"Revoked host {host.name}.", messages.SUCCESS)

    @admin.action(description="Drain the selected hosts (their models move to other hosts)")
    def drain(self, request: HttpRequest, queryset: QuerySet[Host]) -> None:
        for host in queryset:
            drain_host(host.name, actor=request.user.get_username())
            self.message_user(request, f"Host {host.name} is draining.", messages.SUCCESS)

    @admin.action(description="Undrain the selected hosts (models may be placed there again)")
    def undrain(self, request: HttpRequest, queryset: QuerySet[Host]) -> None:
        for host in queryset:
            undrain_host(host.name, actor=request.user.get_username())
            self.message_user(request, f"Host {host.name} takes models again.", messages.SUCCESS)

    @admin.action(description="Remove the selected hosts (not while used)")
    def remove(self, request: HttpRequest, queryset: QuerySet[Host]) -> None:
        for host in queryset:
            try:
                remove_host(host.name)
            except UserError as exc:
                self.message_user(request, str(exc), messages.ERROR)
            else:
                self.message_user(request, f"Removed host {host.name}.", messages.SUCCESS)
