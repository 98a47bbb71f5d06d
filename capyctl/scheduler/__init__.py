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
actions               the verbs, one module each (``actions/ready``, ``start``, ``wake``,
                      ``evict``, ``park``, ``stop``, ``drain``): each decides, admits under the
                      host lock (plan, promise, state moved in one transition), calls the
                      engine driver and the writer; they write nothing themselves.
                      ``actions.ready.ensure_ready`` is the scheduler's one retry loop.
steps                 the step a request waits on (try, pause, try again) and its decisions
                      (pauses, how an eviction goes, the busy grace), Django-free: the server
                      runs it on real time (``actions.ready``), the what-if replay on its
                      virtual clock (``capyctl.whatif``), so the two cannot drift.
policy                placement and eviction, a pure function of plain data
                      (placement_data: that data, and the answers; park_modes: how each
                      victim parks; turn_rules: who keeps GPUs others wait for, who is next).
routing               which replica of a deployment a request goes to (fewest in flight, or
                      its affinity key's on a hash ring within a bounded load), Django-free.
scaling               when a model of ``--replicas MIN:MAX`` brings a replica up (a parked one
                      woken first, else a stopped one started) or parks an idle one beyond
                      MIN, the most recently started first: one step at a time, with its
                      reason and figures, the standard library only (the reconcile timer and
                      the what-if simulator call the same decision).
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
intents,              people's intents (start, stop, park, wake) saved as Operation rows,
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

A wake, read top to bottom: ``gateway_api.ready`` → ``wakes.ready`` →
``actions.ready.ensure_ready`` (the model's lock, one try) → ``actions.wake.wake`` →
``actions.wake.admit_wake`` under the host lock (``transitions.waking``: PARKED → WAKING, the
claim it was launched with promised through ``ledger.services``) → the engine's wake
(``drivers``) → ``transitions.woke`` (READY, the measured figures held).
"""
