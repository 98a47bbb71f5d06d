"""URL routes of the Django side (admin, probes). ``/v1`` is served outside Django."""

from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.urls import include, path

from capyctl.web import apidocs, keys, login, usage_page, views
from capyctl.web.dashboard import dashboard

admin.autodiscover()  # not at start-up: see capyctl.adminapp
admin.site.site_header = "CapyCTL"
admin.site.site_title = "CapyCTL admin"
admin.site.index_title = "Models, engines, hosts and keys"
admin.site.login_form = login.ThrottledAdminLoginForm

handler500 = "capyctl.web.views.server_error"

urlpatterns = [
    path("", dashboard, name="dashboard"),
    path("admin/", admin.site.urls),
    path("api/docs/", apidocs.api_docs),  # a logged-out browser is sent to log in first
    path("api/", include("capyctl.api.urls")),
    path("keys/", keys.keys_page, name="keys"),
    path("usage/", usage_page.usage_page, name="usage"),
    path("keys/<str:key_id>/revoke/", keys.revoke_key, name="revoke-key"),
    path("login/", login.LoginView.as_view(), name="login"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("healthz", views.healthz, name="healthz"),
    path("readyz", views.readyz, name="readyz"),
]
