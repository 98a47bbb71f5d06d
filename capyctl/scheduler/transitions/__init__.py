"""Every change of a deployment's observed state and of the ledger: one function each.

A transition makes its conditional update (``UPDATE … WHERE observed_state IN
(expected)``), and, where memory moves, does it under the host lock together with the
ledger change; then it records the event and tells whoever waits. It returns whether it
won: a caller whose update matched nothing changed nothing, and decides again on the row as
it is now. Two callers can never both make the same change.

Nothing else writes ``observed_state``, an instance's state or a ledger entry
(``tests/test_layout.py`` holds the code to that): :mod:`~capyctl.scheduler.actions`
decide what to do, :mod:`reconcile` finds out what is true, and both change state only
through here. A ledger entry itself is written only by :mod:`capyctl.ledger.services`'
functions, which the transitions call; they never change an entry through the ORM.

=================  ==========================================  ============================
transition         from                                        ledger
=================  ==========================================  ============================
downloading        stopped, failed                             —
download_stopped   downloading → stopped                       —
starting           stopped, failed, downloading                promise (under the lock)
ready              starting                                    measured figures, held
draining           ready                                       —
drain_abandoned    draining → ready                            —
parking            draining                                    a RAM copy promised
park_refused       parking → ready                             engine RAM measured again
parked             parking                                     measured (or unconfirmed)
waking             parked                                      promise (under the lock)
woke               waking → ready                              measured figures, held
stopping           any but stopped                             —
stopped            stopping                                    released
failed             the given states (none other of its         released
                   engines alive)
stuck              (state, since) as read → stopping           —
download_abandoned downloading → failed                        —
recovered          any live state → stopped                    released
release_confirmed  parked                                      unconfirmed → held
=================  ==========================================  ============================

A host's state changes here too (``local_host_seen``, ``host_unreachable``, with its models'
entries unconfirmed in the same transaction, ``host_answers``, ``host_removed`` with its
foreign entries), as do a deployment's desired state (``desired``) and a download's
progress line (``download_progress``).

The transitions live in this package by what they belong to (``starting``, ``switching``,
``ending``, ``hosts``; ``base`` holds what they share); callers use them from here.
"""

from __future__ import annotations

from capyctl.scheduler.transitions.base import LIVE, UNREACHABLE_NOTE, entries, record
from capyctl.scheduler.transitions.ending import (
    download_abandoned,
    failed,
    recovered,
    stopped,
    stopping,
    stuck,
)
from capyctl.scheduler.transitions.hosts import (
    desired,
    foreign_measured,
    host_answers,
    host_removed,
    host_unreachable,
    local_host_seen,
)
from capyctl.scheduler.transitions.starting import (
    download_progress,
    download_stopped,
    downloading,
    fetched_waits_for_room,
    instance_exited,
    launched,
    ready,
    starting,
)
from capyctl.scheduler.transitions.switching import (
    drain_abandoned,
    draining,
    engine_ram_measured,
    park_refused,
    parked,
    parked_unasked,
    parking,
    release_confirmed,
    waking,
    woke,
)

__all__ = [
    "LIVE",
    "UNREACHABLE_NOTE",
    "desired",
    "download_abandoned",
    "download_progress",
    "download_stopped",
    "downloading",
    "drain_abandoned",
    "draining",
    "engine_ram_measured",
    "entries",
    "failed",
    "fetched_waits_for_room",
    "foreign_measured",
    "host_answers",
    "host_removed",
    "host_unreachable",
    "instance_exited",
    "launched",
    "local_host_seen",
    "park_refused",
    "parked",
    "parked_unasked",
    "parking",
    "ready",
    "record",
    "recovered",
    "release_confirmed",
    "starting",
    "stopped",
    "stopping",
    "stuck",
    "waking",
    "woke",
]
