"""URL routes of the Django side (admin, probes). ``/v1`` is served outside Django."""

from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.urls import path
from django.views.generic import RedirectView

from capyctl.web import views

admin.site.site_header = "CapyCTL"
admin.site.site_title = "CapyCTL admin"
admin.site.index_title = "Models, engines, hosts and keys"

urlpatterns = [
    path("", RedirectView.as_view(url="/admin/", permanent=False)),
    path("admin/", admin.site.urls),
    path("login/", auth_views.LoginView.as_view(), name="login"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("healthz", views.healthz, name="healthz"),
    path("readyz", views.readyz, name="readyz"),
]
