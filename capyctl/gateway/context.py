"""What one ``/v1`` request carries through the gateway: :class:`RequestContext`, made once
its model is resolved and passed along through admission, waiting and forwarding, and
:class:`Outcome`, what it came to (for the metrics, the access log and its trace).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from capyctl.gateway.budgets import Reservation
    from capyctl.gateway.cost import Held
    from capyctl.gateway.keys import KeyInfo
    from capyctl.gateway.routing import AdapterRef, Route
    from capyctl.gateway.waiting import KeepAlive
    from hostagent import routes

Scope = dict[str, Any]


class Outcome:
    """What one request came to, for the metrics and its trace."""

    __slots__ = ("admitted", "code", "completion_tokens", "forwarded", "gpu_seconds",
                 "headers_at", "held", "model", "overhead", "path", "prices", "prompt_tokens",
                 "queued_ms", "reservation", "status", "stream", "strip_usage", "switch",
                 "switch_gpu_seconds")  # fmt: skip

    def __init__(self) -> None:
        self.admitted: tuple[KeyInfo, str | None] | None = None  # a key and its in-flight token
        self.model = "-"  # no model label for requests refused before one was resolved
        self.path = ""  # the route's own path, once the path was found to be one
        self.status = 500
        self.code: str | None = None  # an error answer's code
        self.stream = False  # the body asked for a stream
        self.headers_at = 0.0
        self.overhead = 0.0
        self.queued_ms = 0.0  # waiting for a start or wake
        self.switch = ""  # what the wake it waited for switched (x-capyctl-switch)
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.forwarded = False  # it reached an engine: its usage is counted
        self.held: Held | None = None  # in flight on an engine: where its GPU share began
        self.gpu_seconds = 0.0  # its share of its engine's GPU time
        self.switch_gpu_seconds = 0.0  # its share of the switch it waited for
        self.reservation: Reservation | None = None  # what it reserved of its budgets
        self.prices = (0.0, 0.0, 0.0)  # its model's (see Route.prices)
        self.strip_usage = False  # a stream whose usage chunk the client did not ask for


@dataclass(slots=True, eq=False)
class RequestContext:
    """A request for a model, once admission resolved it: what waiting and forwarding need
    of it, in one place. ``route`` becomes the one it was admitted on (read afresh after a
    wake); ``send`` the keep-alive's while a waiting stream holds its answer open."""

    scope: Scope
    receive: Any
    send: Any
    key: KeyInfo
    headers: dict[bytes, bytes]  # the client's, names lower-cased
    body: bytes  # as the engine gets it: an alias renamed to the deployment's own name
    route: Route
    target: routes.Target
    started: float  # time.perf_counter() when the request arrived
    outcome: Outcome
    keepalive: KeepAlive | None = None  # a stream that waits: its head and comment lines
    # A model of several replicas: its first replica's route, with all of them (``route``
    # is then the replica chosen); None for a model of one.
    group: Route | None = None
    affinity: str | None = None  # what ties it to one of them (its session, its prompt)
    # A request for an adapter: the adapter, loaded into the engine of the route it is
    # admitted on before it is forwarded (the route after a wake is its base's).
    adapter: AdapterRef | None = None
    wants: int | None = None  # the deployment its class counts for (see app._wants)

    @property
    def stream(self) -> bool:
        """The body asked for a stream."""
        return self.outcome.stream
