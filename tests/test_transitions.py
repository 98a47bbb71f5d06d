"""The switching core under interleavings: each state change is made on the row it just won.

A race is replayed deterministically at the database boundary: a hook on the connection
runs another writer's statement at the exact point between a decision's read and its write
(what another process could commit there), so each test shows the outcome of that
interleaving, on SQLite and on PostgreSQL.
"""

import contextlib
from collections.abc import Callable, Iterator

import pytest
from django.db import connection

from capyctl.deployments.models import Deployment, Instance
from capyctl.deployments.services import get_deployment, spec_of, update_deployment
from capyctl.hosts.models import Host
from capyctl.ledger.models import LedgerEntry
from capyctl.scheduler import actions, errors, reconcile, requests_in_progress
from tests.scheduling import GIB, deployment, entries, state, vllm_engine

TABLE = Deployment._meta.db_table


@contextlib.contextmanager
def between(
    when: Callable[[str, object], bool], meanwhile: Callable[[], None], *, after: bool = False
) -> Iterator[list[str]]:
    """Run ``meanwhile`` once, just before (or just after) the first statement on this
    connection that ``when(sql, params)`` picks. Yields the statements that fired it."""
    fired: list[str] = []

    def hook(execute, sql, params, many, context):
        if fired or not when(sql, params):
            return execute(sql, params, many, context)
        fired.append(sql)
        if not after:
            meanwhile()
        result = execute(sql, params, many, context)
        if after:
            meanwhile()
        return result

    with connection.execute_wrapper(hook):
        yield fired
    assert fired, "the interleaving never happened: the statement it waits for did not run"


def _close_connection() -> None:
    """This thread's connection (on asgiref's thread: its own), so the test database can be
    dropped after the test."""
    connection.close()


def _sets_state(sql: str, params: object, new: str) -> bool:
    return (
        sql.lstrip().upper().startswith("UPDATE")
        and TABLE in sql
        and "observed_state" in sql
        and new in (params or ())  # type: ignore[operator]
    )


@pytest.mark.django_db(transaction=True)
def test_changing_settings_keeps_a_state_the_scheduler_wrote_meanwhile(gpu24):
    """Finding 7: update_deployment read the row before locking it and saved every field,
    so a start committed in between went back to ``stopped`` (its promise and instance row
    left behind)."""
    vllm_engine()
    a = deployment("a")
    spec = spec_of(get_deployment("a"))
    spec.idle_park_seconds = 600

    def read_the_row(sql: str, params: object) -> bool:
        return sql.lstrip().upper().startswith("SELECT") and TABLE in sql

    def scheduler_starts_it() -> None:
        Deployment.objects.filter(pk=a.pk).update(observed_state="starting")

    with between(read_the_row, scheduler_starts_it, after=True):
        update_deployment("a", spec)
    saved = Deployment.objects.get(pk=a.pk)
    assert saved.observed_state == "starting"
    assert saved.idle_park_seconds == 600


@pytest.mark.django_db(transaction=True)
def test_a_wake_that_lost_its_transition_promises_nothing(gpu24):
    """Finding 5: the wake's admission checked ``parked, running`` under the host lock,
    then ignored whether its parked -> waking update won; a stop that set ``desired``
    meanwhile left a parked model with the full claim promised (and its engine woken)."""
    vllm_engine()
    a, b = deployment("a"), deployment("b")
    actions.ensure_ready(a.pk)
    actions.ensure_ready(b.pk)
    actions.stop(b.pk)  # a's wake needs no room made
    assert state("a") == ("parked", "ram")
    before = entries("a")

    def stopped_meanwhile() -> None:
        Deployment.objects.filter(pk=a.pk).update(desired_state="stopped")

    with (
        between(lambda sql, params: _sets_state(sql, params, "waking"), stopped_meanwhile),
        pytest.raises(errors.ModelStoppedError),
    ):
        actions.ensure_ready(a.pk)
    assert state("a") == ("parked", "ram")
    assert entries("a") == before


@pytest.mark.django_db(transaction=True)
def test_a_park_whose_drain_lost_closes_no_gate_and_says_so(gpu24):
    """Finding 5: a drain closed the request gate even when its ready -> draining update
    lost, and the park then reported success though nothing was parked: a model left with
    its gate closed turns every request away."""
    vllm_engine()
    a = deployment("a")
    actions.ensure_ready(a.pk)

    def stopping_elsewhere() -> None:
        Deployment.objects.filter(pk=a.pk).update(observed_state="stopping")

    with (
        between(lambda sql, params: _sets_state(sql, params, "draining"), stopping_elsewhere),
        pytest.raises(errors.SchedulerError, match="is stopping; only a ready model"),
    ):
        actions.park(a.pk)
    assert state("a") == ("stopping", "")
    assert requests_in_progress.begin(a.pk), "the gate was closed by a drain that never happened"
    requests_in_progress.end(a.pk)


@pytest.mark.django_db(transaction=True)
def test_reconcile_does_not_overwrite_a_wake_promised_meanwhile(gpu24, monkeypatch):
    """Finding 2: reconcile decided a model was parked from the list read at the start of
    its pass, read the probe, then replaced its entries with the small parked figures; a
    wake admitted in between (parked -> waking, the whole claim promised) lost its promise,
    and the ledger under-counted the GPU."""
    vllm_engine()
    a, b = deployment("a"), deployment("b")
    actions.ensure_ready(a.pk)
    actions.ensure_ready(b.pk)
    actions.stop(b.pk)
    assert state("a") == ("parked", "ram")
    # The park answered but its memory was not seen free: the whole claim stays counted.
    LedgerEntry.objects.filter(deployment=a, pool="gpu0").update(
        status=LedgerEntry.Status.UNCONFIRMED, bytes=16 * GIB
    )
    probe_usage = gpu24.usage

    def usage_then_a_wake_is_admitted(instance_id):
        seen = probe_usage(instance_id)
        Deployment.objects.filter(pk=a.pk).update(observed_state="waking")
        LedgerEntry.objects.filter(deployment=a, pool="gpu0").update(
            status=LedgerEntry.Status.PROMISED, bytes=16 * GIB
        )
        return seen

    monkeypatch.setattr(gpu24, "usage", usage_then_a_wake_is_admitted)
    reconcile.reconcile(Host.objects.get().pk)
    assert entries("a")["gpu0"] == ("promised", 16 * GIB)


def _one_parked(name: str) -> int:
    """A parked deployment (of a simulated vLLM), for a wake a worker is sent."""
    from capyctl.engines.models import Engine

    if not Engine.objects.filter(name="sim-vllm").exists():
        vllm_engine()
    parked = deployment(name)
    Deployment.objects.filter(pk=parked.pk).update(observed_state="parked")
    return int(parked.pk)


@pytest.mark.django_db(transaction=True)
async def test_a_wake_whose_failure_notice_is_lost_ends_at_the_next_database_read(
    settings, monkeypatch
):
    """Server mode: the worker's wake failed but its notice never came (a Redis blip). The
    waiter reads the database every half second; it once looked only for ``ready`` there,
    so it waited out the whole wake timeout for a model that had failed."""
    import time

    from asgiref.sync import sync_to_async
    from django.utils import timezone

    from capyctl.scheduler import tasks, wakes
    from capyctl.scheduler.errors import EngineFailedError

    settings.CELERY_TASK_ALWAYS_EAGER = False

    a_id = await sync_to_async(_one_parked)("a")

    def worker_fails_and_its_notice_is_lost(deployment_id: int) -> None:
        Deployment.objects.filter(pk=deployment_id).update(
            observed_state="failed",
            state_reason="wake failed: its engine exited with status 1",
            state_changed_at=timezone.now(),
        )

    monkeypatch.setattr(tasks.ensure_ready, "delay", worker_fails_and_its_notice_is_lost)
    started = time.monotonic()
    try:
        with pytest.raises(EngineFailedError, match="its engine exited with status 1"):
            await wakes.ready(a_id, timeout=120)
        assert time.monotonic() - started < 60, "it waited for the wake timeout"
    finally:
        await sync_to_async(_close_connection)()


@pytest.fixture
def worker_layer(settings, redis_url):
    """Server mode's waiter: wakes go to a worker (a thread here) that tells its outcome on
    the Redis channel layer, as a Celery worker does from its own process."""
    settings.CELERY_TASK_ALWAYS_EAGER = False
    settings.CHANNEL_LAYERS = {
        "default": {
            "BACKEND": "channels_redis.core.RedisChannelLayer",
            "CONFIG": {"hosts": [redis_url], "prefix": "capyctl"},
        }
    }


def _worker(monkeypatch, *steps: tuple[float, Callable[[int], None]]) -> None:
    """The wake sent goes to a worker that runs ``steps`` (after so many seconds, each)."""
    import threading
    import time

    from capyctl.scheduler import tasks

    def work(deployment_id: int) -> None:
        try:
            for seconds, step in steps:
                time.sleep(seconds)
                step(deployment_id)
        finally:
            _close_connection()

    monkeypatch.setattr(
        tasks.ensure_ready, "delay", lambda pk: threading.Thread(target=work, args=(pk,)).start()
    )


def _made_ready(deployment_id: int) -> None:
    from django.utils import timezone

    Deployment.objects.filter(pk=deployment_id).update(
        observed_state="ready", state_changed_at=timezone.now()
    )


SAID = "parked a (ram) 412 ms; woke b 688 ms"


def _tells(deployment_id: int) -> None:
    from capyctl.scheduler import notify

    notify.announce(deployment_id, ok=True, switch=SAID)


@pytest.mark.django_db(transaction=True)
async def test_a_switch_told_a_second_after_its_ready_row_is_still_said(worker_layer, monkeypatch):
    """Server mode: the worker commits the ready row, then tells the waiters what it
    switched once its task ends. On a busy machine that word came more than a quarter of a
    second after the row; the waiter, which had read the row at its half-second poll,
    answered without the switch (``x-capyctl-switch`` missing, a failure seen in CI)."""
    from asgiref.sync import sync_to_async

    from capyctl.scheduler import wakes

    b_id = await sync_to_async(_one_parked)("b")
    # The rest of its task, on a machine busy with other work, takes a second.
    _worker(monkeypatch, (0.1, _made_ready), (1.0, _tells))
    try:
        assert await wakes.ready(b_id, timeout=30) == SAID
    finally:
        await sync_to_async(_close_connection)()


@pytest.mark.django_db(transaction=True)
async def test_a_waiter_does_not_listen_for_a_word_that_cannot_come(worker_layer, monkeypatch):
    """The waiter listens for what was switched only when the model became ready after it
    sent its wake: one already ready then (another process woke it) is answered at its
    first read, not after the wait for a word (its own task, queued behind long starts,
    would only say that nothing was switched). And one read ready near the waiter's
    deadline is answered before it, not with a timeout."""
    import asyncio
    import time

    from asgiref.sync import sync_to_async

    from capyctl.scheduler import wakes

    monkeypatch.setattr(wakes, "TOLD_AFTER_READY_SECONDS", 30.0)
    a_id = await sync_to_async(_one_parked)("a")
    await sync_to_async(_made_ready)(a_id)
    _worker(monkeypatch)  # its task has not begun
    try:
        began = time.monotonic()
        assert await wakes.ready(a_id, timeout=60) == ""
        assert time.monotonic() - began < 10, "it waited for a word that could not come"

        b_id = await sync_to_async(_one_parked)("b")
        _worker(monkeypatch, (0.6, _made_ready))  # its word is lost
        grace = 1 + wakes.OUTCOME_GRACE_SECONDS  # what the gateway gives it (waiting.py)
        assert await asyncio.wait_for(wakes.ready(b_id, timeout=1), timeout=grace) == ""
    finally:
        await sync_to_async(_close_connection)()


# --- a losing transition changes nothing ------------------------------------------------


def _promised_start(a: Deployment, key: str):
    """A start of ``a`` admitted as the scheduler admits one: its claim promised under the
    host lock and its instance row made."""
    from capyctl.ledger.services import host_lock
    from capyctl.scheduler import transitions

    with host_lock(Host.objects.get().pk) as locked:
        instance = transitions.starting(
            locked,
            Deployment.objects.get(pk=a.pk),
            {"gpu0": 16 * GIB, "ram": GIB},
            [0],
            key=key,
            claim_bytes=16 * GIB,
        )
    assert instance is not None
    return instance


@pytest.mark.django_db(transaction=True)
def test_a_late_failure_of_an_old_worker_leaves_a_newer_start_alone(gpu24):
    """A worker's start was repaired as stuck (its lease lost in a Redis restart) and
    failed; a newer start then promised the claim. The old worker's engine call fails at
    last and it calls ``end_engine_and_fail()``: it released the newer start's promise and
    marked it failed (any state but failed, stopped or stopping was its to fail)."""
    from capyctl.events.models import Event
    from capyctl.scheduler import transitions

    vllm_engine()
    a = deployment("a")
    old = _promised_start(a, "old")
    transitions.instance_exited(old.pk)  # reconcile ended its engine
    assert transitions.failed(Deployment.objects.get(pk=a.pk), "it stayed starting too long")
    assert entries("a") == {}
    newer = _promised_start(a, "newer")
    promised = entries("a")
    assert promised == {"gpu0": ("promised", 16 * GIB), "ram": ("promised", GIB)}

    stale = Deployment.objects.get(pk=a.pk)
    actions.end_engine_and_fail(
        stale, gpu24, old, "the engine failed to start: it exited", "system"
    )

    assert state("a") == ("starting", "")
    assert entries("a") == promised
    assert Deployment.objects.get(pk=a.pk).state_reason == ""
    assert not Event.objects.filter(kind="deployment.failed", message__contains="it exited")
    assert Instance.objects.get(pk=newer.pk).state == "launching"


@pytest.mark.django_db(transaction=True)
def test_a_stop_that_lost_releases_nothing_and_says_nothing(gpu24):
    """``stopped()`` released the ledger before its stopping -> stopped update, and
    recorded ``deployment.stopped`` whether or not that update won: a stop whose state was
    repaired meanwhile (failed, then started again) took the new start's promise with it."""
    from capyctl.events.models import Event
    from capyctl.scheduler import transitions

    vllm_engine()
    a = deployment("a")
    old = _promised_start(a, "old")
    assert transitions.stopping(a.pk, "starting")
    stopper = Deployment.objects.get(pk=a.pk)
    transitions.instance_exited(old.pk)
    assert transitions.failed(stopper, "it stayed stopping too long", expected=["stopping"])
    _promised_start(a, "newer")
    promised = entries("a")

    assert transitions.stopped(stopper, reason="stopped on request") is False
    assert state("a") == ("starting", "")
    assert entries("a") == promised
    assert not Event.objects.filter(kind="deployment.stopped").exists()


@pytest.mark.django_db(transaction=True)
def test_a_recovery_that_lost_releases_nothing(gpu24):
    """``recovered()`` released what the deployment held before its move from the state
    it had read: a start admitted meanwhile lost its promise though the state stayed."""
    from capyctl.scheduler import transitions

    vllm_engine()
    a = deployment("a")
    Deployment.objects.filter(pk=a.pk).update(observed_state="parked")
    read = Deployment.objects.get(pk=a.pk)  # what the start-up's pass read
    Deployment.objects.filter(pk=a.pk).update(observed_state="failed")
    _promised_start(a, "newer")
    promised = entries("a")

    assert transitions.recovered(read, Host.objects.get(), shutting_down=False) is False
    assert state("a") == ("starting", "")
    assert entries("a") == promised


@pytest.mark.django_db(transaction=True)
def test_a_park_that_lost_records_no_parked_event(gpu24):
    """``parked()`` recorded ``deployment.parked`` even when its parking -> parked update
    matched nothing (a stop took the model meanwhile): the events said it was parked."""
    from capyctl.events.models import Event
    from capyctl.scheduler import transitions

    vllm_engine()
    a = deployment("a")
    _promised_start(a, "one")
    Deployment.objects.filter(pk=a.pk).update(observed_state="stopping")
    promised = entries("a")
    for figures in ({"gpu0": GIB, "ram": GIB}, None):
        won = transitions.parked(
            Deployment.objects.get(pk=a.pk), Host.objects.get(), "ram", figures,
            reason="", started=0.0, actor="system",
        )  # fmt: skip
        assert won is False
    assert state("a") == ("stopping", "")
    assert entries("a") == promised
    assert not Event.objects.filter(kind="deployment.parked").exists()


@pytest.mark.django_db(transaction=True)
def test_a_release_confirmed_for_a_model_with_nothing_unconfirmed_changes_nothing(gpu24):
    """``release_confirmed()`` cleared the parked model's reason before it found nothing
    unconfirmed to confirm, and said it lost."""
    from capyctl.scheduler import transitions

    vllm_engine()
    a = deployment("a")
    Deployment.objects.filter(pk=a.pk).update(
        observed_state="parked", parked_mode="ram", state_reason="to make room for b"
    )
    assert transitions.release_confirmed(a, Host.objects.get(), {"gpu0": GIB}) is False
    assert Deployment.objects.get(pk=a.pk).state_reason == "to make room for b"
    assert entries("a") == {}


@pytest.mark.django_db(transaction=True)
def test_a_host_marked_unreachable_changes_state_and_ledger_together(gpu24):
    """A host was marked unreachable in one transaction and its models' entries made
    unconfirmed in another: a failure between them left the host unreachable with its
    memory counted as held and confirmed."""
    from capyctl.hosts.services import add_host
    from capyctl.scheduler.remote_hosts import mark_unreachable
    from tests.refusals import refused

    vllm_engine()
    a = deployment("a")
    remote, _token = add_host("gpu-a", "10.0.0.5:7443")
    Host.objects.filter(pk=remote.pk).update(state="online")
    LedgerEntry.objects.create(host=remote, deployment=a, pool="gpu0", bytes=GIB, status="held")
    table = LedgerEntry._meta.db_table
    with refused(table, "UPDATE"), pytest.raises(Exception, match="refused by the database"):
        mark_unreachable(Host.objects.get(pk=remote.pk), "host gpu-a did not answer")
    assert Host.objects.get(pk=remote.pk).state == "online"
    assert LedgerEntry.objects.get(host=remote).status == "held"
    mark_unreachable(Host.objects.get(pk=remote.pk), "host gpu-a did not answer")
    assert Host.objects.get(pk=remote.pk).state == "unreachable"
    assert LedgerEntry.objects.get(host=remote).status == "unconfirmed"
