"""What if: replay a recorded trace against a scenario (hosts, models, settings) on a
virtual clock, with the scheduler's own decisions.

- :mod:`capyctl.whatif.scenario`: the scenario (what ``capyctl status --json`` shows, with
  each model's measured switch timings) and its overrides;
- :mod:`capyctl.whatif.trace`: a trace file, read and checked;
- :mod:`capyctl.whatif.engine`: the replay: requests, queues, starts, parks and wakes on a
  virtual clock; placement, victims, park modes and turns come from
  :func:`capyctl.scheduler.policy.plan`, as in production;
- :mod:`capyctl.whatif.report`: the answer (per model and overall), a comparison, and a
  timeline picture.
"""
