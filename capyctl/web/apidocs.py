"""``/api/docs/``, the REST API's interactive docs, as a person reaches it.

The start banner's ``api:`` link points here. A browser that is not logged in (no session,
no API key) is sent to the login page and, once logged in, back here; any other client
gets the REST API's own answer (401 with ``WWW-Authenticate: Bearer``), as before.
"""

from __future__ import annotations

from django.contrib.auth.views import redirect_to_login
from django.http import HttpRequest, HttpResponseBase
from django.views.decorators.csrf import csrf_exempt
from drf_spectacular.views import SpectacularSwaggerView

_swagger = SpectacularSwaggerView.as_view(url_name="schema")


def _asks_for_a_page(request: HttpRequest) -> bool:
    return "text/html" in request.headers.get("Accept", "")


@csrf_exempt  # as the REST API's views are: it checks a session's CSRF token itself
def api_docs(request: HttpRequest) -> HttpResponseBase:
    """The Swagger UI page (staff or an admin-scope key: the REST API decides)."""
    if (
        not request.user.is_authenticated
        and "Authorization" not in request.headers
        and _asks_for_a_page(request)
    ):
        return redirect_to_login(request.get_full_path())
    response: HttpResponseBase = _swagger(request)
    return response
