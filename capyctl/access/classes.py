"""The priority classes of keys and teams, declared once (no Django here: the CLI's parser
and the what-if replay read them before Django is set up). ``batch`` requests use the GPUs
interactive ones leave idle (:mod:`capyctl.scheduler.turn_rules`)."""

INTERACTIVE = "interactive"
BATCH = "batch"
CLASSES = (INTERACTIVE, BATCH)
