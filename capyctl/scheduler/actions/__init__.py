"""The scheduler's verbs, one module each, each read top to bottom:

===========  ============================================================================
ready        :func:`ensure_ready`, the one retry loop (what a request waits on); the
             person's :func:`start`; :func:`check_park` (park a marked engine's model to
             see whether its parks free memory again, and wake it).
start        :func:`start_engine`: place, fetch, admit under the host lock, launch, measure.
wake         :func:`wake`: admit under the host lock, the engine's wake, measured.
evict        :func:`evict`: park or stop a model another needs the memory of.
park         :func:`park` (the person's), :func:`park_ready`: drain, the engine's park, measured.
stop         :func:`stop` (the person's), :func:`stop_engine`; :func:`end_engine_and_fail`.
drain        :func:`drain`: a ready model takes no new request, and its requests finish.
common       the rows they read, and the bounds they share.
===========  ============================================================================

A verb decides; every change of state and of the ledger is a transition
(:mod:`capyctl.scheduler.transitions`). Each imports only the verbs below it in this order:
ready → wake → start → evict → park → stop → drain, so none calls back up.
"""

from __future__ import annotations

from capyctl.scheduler.actions import adapters
from capyctl.scheduler.actions.common import (
    MAX_SWITCH_ROUNDS,
    STOP_GRACE_SECONDS,
    instance_key,
    load,
    touch,
)
from capyctl.scheduler.actions.park import park
from capyctl.scheduler.actions.ready import ROOM_RETRY_SECONDS, check_park, ensure_ready, start
from capyctl.scheduler.actions.start import fits_elsewhere
from capyctl.scheduler.actions.stop import drain_and_stop, end_engine_and_fail, stop, stop_engine

__all__ = [
    "MAX_SWITCH_ROUNDS",
    "ROOM_RETRY_SECONDS",
    "STOP_GRACE_SECONDS",
    "adapters",
    "check_park",
    "drain_and_stop",
    "end_engine_and_fail",
    "ensure_ready",
    "fits_elsewhere",
    "instance_key",
    "load",
    "park",
    "start",
    "stop",
    "stop_engine",
    "touch",
]
