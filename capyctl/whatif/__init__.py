"""What if: replay a recorded trace against a scenario (hosts, models, settings) on a
virtual clock, with the scheduler's own decisions.

- :mod:`capyctl.whatif.scenario`: the scenario (what ``capyctl status --json`` shows, with
  each model's measured switch timings) and its overrides;
- :mod:`capyctl.whatif.trace`: a trace file, read and checked;
- :mod:`capyctl.whatif.engine`: the replay: requests, queues, starts, parks and wakes on a
  virtual clock; placement, victims, park modes and turns come from
  :func:`capyctl.scheduler.policy.plan`, as in production. Its parts:
  :mod:`~capyctl.whatif.clock` (the virtual clock and its processes),
  :mod:`~capyctl.whatif.state` (models and hosts as the ledger sees them),
  :mod:`~capyctl.whatif.ledger` (memory, state changes, snapshots and plans),
  :mod:`~capyctl.whatif.serving` (requests served, refused and queued, in and before
  their engine), :mod:`~capyctl.whatif.adapters` (adapters loaded into their base's
  engine), :mod:`~capyctl.whatif.ensure_ready` (a wake, and the parks and stops
  that make room), :mod:`~capyctl.whatif.replicas` (a model of several replicas: routing
  and scaling, by :mod:`capyctl.scheduler.routing` and :mod:`capyctl.scheduler.scaling`)
  and :mod:`~capyctl.whatif.outcome` (what a replay yields);
- :mod:`capyctl.whatif.report`: the answer (per model and overall), a comparison, and a
  timeline picture.
"""
