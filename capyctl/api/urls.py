"""``/api/``: the resources, the OpenAPI schema and its docs page."""

from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView
from rest_framework.routers import DefaultRouter

from capyctl.api import budget_views, people_views, views

router = DefaultRouter()
router.register("engines", views.EngineViewSet, basename="engine")
router.register("deployments", views.DeploymentViewSet, basename="deployment")
router.register("adapters", views.AdapterViewSet, basename="adapter")
router.register("hosts", views.HostViewSet, basename="host")
router.register("keys", people_views.KeyViewSet, basename="key")
router.register("users", people_views.UserViewSet, basename="user")
router.register("teams", people_views.TeamViewSet, basename="team")
router.register("budgets", budget_views.BudgetViewSet, basename="budget")
router.register("ledger", views.LedgerViewSet, basename="ledger")
router.register("events", views.EventViewSet, basename="event")
router.register("operations", views.OperationViewSet, basename="operation")

urlpatterns = [
    path("schema/", SpectacularAPIView.as_view(), name="schema"),
    path("docs/", SpectacularSwaggerView.as_view(url_name="schema"), name="api-docs"),
    path("usage/", budget_views.UsageView.as_view(), name="usage"),
    path("", include(router.urls)),
]
