"""Queries whose SQL is built once (capyctl.prepared) give what the ORM gives: the same
rows, fields, converted values and related rows, on SQLite and PostgreSQL."""

import pytest
from django.db import connection
from django.db.models import Count, F
from django.db.models.signals import post_save
from django.db.models.sql.compiler import SQLCompiler, SQLInsertCompiler, SQLUpdateCompiler
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from capyctl.deployments.models import Deployment, Instance
from capyctl.engines.models import Engine
from capyctl.events.models import Event
from capyctl.ledger.models import LedgerEntry
from capyctl.ledger.pools import read_ledger
from capyctl.prepared import Prepared, PreparedInsert, PreparedUpdate
from capyctl.scheduler import actions, snapshots
from capyctl.scheduler.actions.common import live_instance, load, states
from capyctl.scheduler.errors import SchedulerError
from tests.scheduling import deployment, entries, vllm_engine

pytestmark = pytest.mark.database


def _fields(row) -> dict[str, object]:
    """Every loaded field's value (deferred ones left out, as they are not loaded)."""
    loaded = set(row.__dict__)
    return {f.attname: getattr(row, f.attname) for f in row._meta.concrete_fields
            if f.attname in loaded}  # fmt: skip


def _builds(monkeypatch, compiler: type[SQLCompiler], name: str) -> list[str]:
    """``name`` once for each SQL statement the compiler builds from now on."""
    built: list[str] = []
    as_sql = compiler.as_sql

    def building(self, *args, **kwargs):
        built.append(name)
        return as_sql(self, *args, **kwargs)

    monkeypatch.setattr(compiler, "as_sql", building)
    return built


@pytest.fixture
def two_models(gpu24):
    """``a`` ready on the simulated GPU (with a host and an engine process), ``b`` never
    started (no host, no process)."""
    vllm_engine()
    a, b = deployment("a"), deployment("b")
    actions.ensure_ready(a.pk)
    return a, b


@pytest.mark.django_db(transaction=True)
def test_a_prepared_row_is_the_orms_row_with_its_engine_and_host(two_models):
    for model in two_models:
        orm = Deployment.objects.select_related("engine", "host").get(pk=model.pk)
        mine = load(model.pk)
        assert _fields(mine) == _fields(orm)
        assert type(mine.state_changed_at) is type(orm.state_changed_at)  # converted alike
        with CaptureQueriesContext(connection) as queries:  # its engine and host came along
            engine, host = mine.engine, mine.host
        assert not queries.captured_queries
        assert _fields(engine) == _fields(orm.engine)
        assert (host and _fields(host)) == (orm.host and _fields(orm.host))
    assert load(two_models[0].pk).host is not None
    assert load(two_models[1].pk).host is None  # a LEFT JOIN's empty row: no host
    with pytest.raises(SchedulerError, match="deployment 99999 no longer exists"):
        load(99999)
    with pytest.raises(SchedulerError, match=f"deployment {2**63} no longer exists"):
        load(2**63)  # past any key's range: the ORM's answer, not the driver's overflow


@pytest.mark.django_db(transaction=True)
def test_prepared_reads_of_processes_states_and_residents_match_the_orm(two_models):
    a, b = two_models
    process = live_instance(a)
    orm = (
        Instance.objects.filter(deployment_id=a.pk)
        .exclude(state=Instance.State.EXITED)
        .only("pk", "pid", "port", "gpu_indices", "key", "claim_bytes", "state")
        .first()
    )
    assert process is not None
    assert orm is not None
    assert _fields(process) == _fields(orm)
    assert process.get_deferred_fields() == orm.get_deferred_fields() != set()
    assert live_instance(b) is None
    assert states(a.pk) == ("ready", "running")
    assert states(b.pk) == tuple(
        Deployment.objects.filter(pk=b.pk).values_list("observed_state", "desired_state")[0]
    )
    assert states(99999) is None
    assert states(2**63) is None

    host = load(a.pk).host
    assert host is not None
    residents = snapshots.residents(host, 0.0)
    assert [r.deployment_id for r in residents] == [a.pk]
    assert residents[0].gpu_bytes == {"gpu0": entries("a")["gpu0"][1]}
    assert residents[0].state == "ready"
    # Entries read under the host lock stand, even if gone from the table since.
    read = read_ledger(host)
    LedgerEntry.objects.filter(deployment=a).delete()
    assert [r.deployment_id for r in snapshots.residents(host, 0.0, read=read)] == [a.pk]


@pytest.mark.django_db(transaction=True)
def test_a_prepared_query_is_counted_as_any_other_and_takes_new_arguments(two_models, monkeypatch):
    a, b = two_models
    built = _builds(monkeypatch, SQLCompiler, "select")
    names = Prepared(lambda pk: Deployment.objects.filter(pk__gte=pk).values_list("name"), 1)
    with CaptureQueriesContext(connection) as queries:
        assert names(a.pk) == [("a",), ("b",)]
        assert names(b.pk) == [("b",)]
        assert names(b.pk + 1) == []
    assert len(queries.captured_queries) == 3  # each run a query Django's cursor saw
    assert built == ["select"]  # its SQL built once
    assert names(True) == list(Deployment.objects.filter(pk__gte=True).values_list("name"))


@pytest.mark.django_db
def test_what_cannot_be_given_as_the_orm_gives_it_is_refused():
    with pytest.raises(ValueError, match="only a model's rows or values_list"):
        Prepared(lambda pk: Engine.objects.filter(pk=pk).values("name"), 1)(1)
    with pytest.raises(ValueError, match="annotations"):
        Prepared(lambda pk: Engine.objects.filter(pk=pk).annotate(n=Count("deployments")), 1)(1)
    with pytest.raises(ValueError, match=r"argument\(s\) \[1\] are not values"):
        Prepared(lambda pk, other: Engine.objects.filter(pk=pk), 2)(1, 2)
    with pytest.raises(ValueError, match="prefetches or locks"):
        Prepared(lambda pk: Engine.objects.filter(pk=pk).prefetch_related("deployments"), 1)(1)
    with pytest.raises(TypeError, match="1 argument"):
        Prepared(lambda pk: Engine.objects.filter(pk=pk), 1)(1, 2)


@pytest.mark.django_db(transaction=True)
def test_a_prepared_update_writes_what_the_orms_update_writes(two_models, monkeypatch):
    a, b = two_models
    built = _builds(monkeypatch, SQLUpdateCompiler, "update")
    when = timezone.now()
    ready = PreparedUpdate(lambda pk: Deployment.objects.filter(pk=pk, observed_state="ready"), 1)
    seen: list[str] = []

    def record(execute, sql, params, many, context):
        seen.append(sql)
        return execute(sql, params, many, context)

    values = {"state_reason": "checked", "state_changed_at": when, "measured_weights_bytes": None}
    with connection.execute_wrapper(record):
        assert ready(a.pk, **values) == 1
        assert ready(b.pk, **values) == 0
    assert len(seen) == 2
    assert seen[0] == seen[1]
    assert built == ["update"]  # built once, run twice with other parameters
    Deployment.objects.filter(pk=b.pk).update(observed_state="ready")
    assert ready(b.pk, state_reason="checked", state_changed_at=when, measured_weights_bytes=5) == 1
    Deployment.objects.filter(pk=b.pk).update(
        measured_weights_bytes=None
    )  # the ORM, to compare with
    rows = {d.name: d for d in Deployment.objects.filter(pk__in=[a.pk, b.pk])}
    assert rows["a"].state_reason == rows["b"].state_reason == "checked"
    assert rows["a"].state_changed_at == rows["b"].state_changed_at == when
    assert rows["a"].measured_weights_bytes is rows["b"].measured_weights_bytes is None

    # An expression is the ORM's to write; the count of rows updated is the same.
    assert ready(a.pk, priority=F("priority") + 2) == 1
    assert Deployment.objects.get(pk=a.pk).priority == a.priority + 2


@pytest.mark.django_db(transaction=True)
def test_a_prepared_insert_writes_what_the_orms_create_writes(monkeypatch):
    built = _builds(monkeypatch, SQLInsertCompiler, "insert")
    insert = PreparedInsert(Event)
    values = {"kind": "test.kind", "message": "m", "subject": "s", "level": "warning",
              "actor": "me", "duration_ms": 7, "data": {"mode": "ram", "n": [1, 2]}}  # fmt: skip
    before = timezone.now()
    first, second = insert(**values), insert(**{**values, "data": {}, "duration_ms": None})
    assert built == ["insert"]  # built once, run twice
    assert second.pk > first.pk
    assert not first._state.adding
    for row in (first, second):
        saved = Event.objects.get(pk=row.pk)
        assert saved.created_at == row.created_at
        assert saved.created_at >= before
        assert (saved.kind, saved.level, saved.data, saved.duration_ms) == (
            row.kind, row.level, row.data, row.duration_ms)  # fmt: skip
    orm = Event.objects.create(**values)
    assert Event.objects.filter(pk=orm.pk).values("data", "level").get() == {
        "data": first.data, "level": first.level}  # fmt: skip

    # A model whose saves something listens to is saved by the ORM (the receiver sees it).
    heard: list[int] = []

    def receiver(sender, instance, created, **kwargs):
        heard.append(instance.pk)

    post_save.connect(receiver, sender=Event)
    try:
        third = insert(**values)
    finally:
        post_save.disconnect(receiver, sender=Event)
    assert heard == [third.pk]
