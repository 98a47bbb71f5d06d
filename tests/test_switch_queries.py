"""How many SQL queries a switch costs: standalone (SQLite), two simulated models of
16 GiB on a simulated 24 GiB GPU, one parked while the other holds the GPU, as in
bench/switch.py. A count, not a time: it holds on a busy machine too."""

import pytest
from django.db import connection

from capyctl.engines.services import add_engine
from capyctl.scheduler import actions
from tests.scheduling import SIM, SIM_ENV, deployment, state

# Queries of one switch (the parked model woken, the ready one parked to make room):
# 46 before the switch's reads were shared within each host lock hold; 30 before a first
# try acted on the row just read and a wake's lock used the host row it had read.
MAX_QUERIES = 27


def _switch(pk: int) -> list[str]:
    """The SQL of one ``ensure_ready`` of a parked model, run in this thread."""
    seen: list[str] = []

    def record(execute, sql, params, many, context):
        seen.append(sql)
        return execute(sql, params, many, context)

    with connection.execute_wrapper(record):
        actions.ensure_ready(pk)
    return seen


@pytest.mark.django_db(transaction=True)
def test_a_switch_costs_at_most_its_counted_queries(gpu24):
    add_engine(
        "sim-vllm",
        kind="vllm",
        command=f"{SIM} vllm",
        env={**SIM_ENV, "CAPYCTL_SIM_SLEEP_SECONDS": "0", "CAPYCTL_SIM_WAKE_SECONDS": "0"},
    )
    a, b = deployment("a"), deployment("b")
    for model in (a, b, a):  # started, then each parked once (its copy measured)
        actions.ensure_ready(model.pk)
    assert state("b")[0] == "parked"

    for model, other in ((b, "a"), (a, "b"), (b, "a"), (a, "b")):
        queries = _switch(model.pk)
        assert state(model.name) == ("ready", "")
        assert state(other)[0] == "parked"
        # all of it seen here: its five moves (draining, parking, parked, waking, woke)
        moves = [q for q in queries if q.startswith('UPDATE "deployments_deployment"')]
        assert len(moves) == 5
        assert len(queries) <= MAX_QUERIES, "\n".join(q[:120] for q in queries)
