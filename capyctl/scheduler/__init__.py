"""The scheduler: who holds GPU memory, and every change of a deployment's state.

Who may write what (``tests/test_layout.py`` holds the code to it):

====================  ===================================================================
module                role
====================  ===================================================================
transitions           THE writer: a deployment's observed state (with its parked mode, reason
                      and when it changed) and desired state, its instance rows' state, a
                      host's state and every ledger entry change only here, one function per
                      state change (conditional update, ledger change, event, notification
                      together); a losing update changes nothing. It changes ledger entries
                      only through ``capyctl.ledger.services``, which nothing else calls.
operations            the verbs: ensure ready, start, wake, park, stop, evict. They decide
                      and call transitions; they write nothing themselves.
admission             whether a start or wake fits, planned and promised under the host lock.
policy                placement and eviction, a pure function of plain data.
snapshots             the host as policy sees it (reads only); estimates: figures before
                      they are measured.
reconcile             finds out what is true (dead engines, stuck states, memory seen
                      free, idle models) and corrects it through transitions.
wakes                 the one entry point the gateway awaits (``await wakes.ready(...)``):
                      in this process on threads of its own, or on a Celery worker.
gateway_api           all the gateway may use of the scheduler: ready, a request counted in
                      flight, a model asked for, the errors it answers with.
deployment_locks      one lock per deployment in a process; errors: typed failures.
requests_in_progress  requests in flight per deployment, and the drain gate: counted in this
                      process, or in server mode in Redis (``requests_in_progress_redis``).
redislink             the short Redis calls of the request path and the host lock (timeouts, a
                      shared quiet period), and who a process is (its pid checked on this machine).
actions,              people's intents (start, stop, park, wake) saved as Operation rows,
operation_runs,       carried out (``operation_runs``) by the process that owns the engines
executor,             (standalone's loop, ``executor``), or as Celery tasks (server mode).
tasks
fetching              a deployment's source fetched on its host before a start.
drivers, notify       how hosts are reached; how waiters in other processes are told.
remote_hosts          the remote host driver (JSON over mutual TLS to a host's agent) and host
                      polling (online or unreachable).
host_states           a host's changes people or the start-up ask for: the local host seen, a
                      remote host revoked or removed.
====================  ===================================================================

A wake, read top to bottom: ``wakes.ready`` → ``operations.ensure_ready`` →
``operations._wake`` → ``admission.admit_wake`` (``transitions.waking``: PARKED → WAKING,
the claim it was launched with promised) → the engine's wake call →
``transitions.woke`` (READY, the measured figures held).
"""
