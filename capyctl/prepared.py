"""Queries of the switch path whose SQL is built once.

Django builds a query's SQL every time it runs it. For the row a verb decides on (a
deployment with its engine and host: 86 columns) building takes about seven times as long
as running it on SQLite (1.1 ms against 0.16 ms here), and a switch reads such rows twice
besides its engine processes and states. A :class:`Prepared` query is built once per
database backend, with stand-in values for its arguments, and then only run: the
arguments (primary keys: ints) take the stand-ins' places among the parameters, and the
rows come back as the ORM gives them (its converters, and for a model its instances with
their ``select_related`` rows), through Django's own cursor (so a query counter or log sees
it as any other).

Only what it can give exactly as the ORM would is prepared: a model's rows (``filter``,
``exclude``, ``select_related``, ``only``, ``order_by``, a slice) or ``values_list`` of
fields, each argument an int used as a value. Anything else is refused when the query is
first built, and an argument that is not an int runs the query through the ORM.

:class:`PreparedUpdate` does the same for an ``UPDATE`` of one table by a filter of one
shape (the scheduler's conditional state moves: five a switch): its SQL is built once per
set of columns it sets (and which of them are set to NULL); each value is converted for
the database by its field, as the ORM converts it. :class:`PreparedInsert`: a model's
``objects.create()`` (the events: two a switch). ``tests/test_prepared.py`` holds both
ways to the same answers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from django.db import DEFAULT_DB_ALIAS, connections, transaction
from django.db.models import AutoField, Model, QuerySet, signals
from django.db.models.query import ModelIterable, ValuesListIterable, get_related_populators
from django.db.models.sql.subqueries import InsertQuery, UpdateQuery

T = TypeVar("T")

# Stand-ins for the arguments while the SQL is built, one per argument: ints no key takes,
# within every backend's range for an integer column (Django answers a lookup of a value
# out of its column's range without asking the database, which would build other SQL).
_STAND_IN = -1_987_654_321


@dataclass(frozen=True)
class _Built:
    sql: str
    params: tuple[Any, ...]
    slots: tuple[tuple[int, int], ...]  # (position among the parameters, argument)
    converters: dict[int, tuple[list[Any], Any]]  # a column's converters, and its expression
    model: Any  # the model of the rows, or None for values_list's tuples
    init_list: tuple[str, ...]
    fields: tuple[int, int]  # the model's columns in a row
    populators: tuple[Any, ...]


class Prepared(Generic[T]):
    """``build(*args)``'s query, its SQL built once per database backend; ``prepared(*args)``
    runs it and returns its rows as a list (model instances, or tuples for
    ``values_list``)."""

    def __init__(self, build: Callable[..., QuerySet[Any, T]], arity: int) -> None:
        self._build = build
        self._arity = arity
        self._built: dict[str, _Built] = {}

    def __call__(self, *args: Any) -> list[T]:
        if len(args) != self._arity:
            raise TypeError(f"{self._arity} argument(s) expected, got {len(args)}")
        if not all(_key_like(arg) for arg in args):
            return list(self._build(*args))  # as the ORM runs it
        connection = connections[DEFAULT_DB_ALIAS]
        built = self._built.get(connection.vendor) or self._prepare(connection.vendor)
        params = list(built.params)
        for position, index in built.slots:
            params[position] = args[index]
        with connection.cursor() as cursor:
            cursor.execute(built.sql, params)
            rows = cursor.fetchall()
        if built.converters:
            rows = [_converted(row, built.converters, connection) for row in rows]
        if built.model is None:
            return [tuple(row) for row in rows]  # type: ignore[misc]  # T: values_list's tuple
        start, end = built.fields
        found = []
        for row in rows:
            obj = built.model.from_db(DEFAULT_DB_ALIAS, built.init_list, row[start:end])
            for populator in built.populators:
                populator.populate(row, obj)
            found.append(obj)
        return found

    def _prepare(self, vendor: str) -> _Built:
        stand_ins = _stand_ins(self._arity)
        queryset = self._build(*stand_ins)
        query = queryset.query
        if queryset._iterable_class not in (ModelIterable, ValuesListIterable):
            raise ValueError("only a model's rows or values_list of fields can be prepared")
        if queryset._prefetch_related_lookups or query.select_for_update:  # type: ignore[attr-defined]
            raise ValueError("a query that prefetches or locks rows cannot be prepared")
        if query.extra_select or query.annotation_select or queryset._known_related_objects:  # type: ignore[attr-defined]
            raise ValueError("a query with extra columns or annotations cannot be prepared")
        compiler = query.get_compiler(using=DEFAULT_DB_ALIAS)
        sql, params = compiler.as_sql()
        slots = _slots(params, stand_ins)
        model, init_list, fields, populators = None, (), (0, 0), ()  # type: tuple[Any, tuple[str, ...], tuple[int, int], tuple[Any, ...]]
        if queryset._iterable_class is ModelIterable:
            info = compiler.klass_info
            model = info["model"]
            columns = info["select_fields"]
            fields = (columns[0], columns[-1] + 1)
            init_list = tuple(s[0].target.attname for s in compiler.select[fields[0] : fields[1]])
            # Django 5.2's signature (the stubs know a later one)
            populators = tuple(get_related_populators(info, compiler.select, DEFAULT_DB_ALIAS))  # type: ignore[call-arg]
        columns = [s[0] for s in compiler.select[: compiler.col_count]]
        # As results_iter() finds them. The backend's are methods of this thread's
        # connection; they read only its settings (the time zone), alike in every thread.
        converters = compiler.get_converters(columns)
        if compiler.has_composite_fields(columns):
            raise ValueError("a query of composite fields cannot be prepared")
        built = _Built(sql, tuple(params), slots, converters, model, init_list, fields, populators)
        self._built[vendor] = built  # built alike by any thread that got here first
        return built


@dataclass(frozen=True)
class _BuiltUpdate:
    sql: str
    fields: tuple[Any, ...]  # the field of each value set to other than NULL, in order
    where: tuple[Any, ...]  # the filter's parameters, the stand-ins among them
    slots: tuple[tuple[int, int], ...]  # (position among ``where``, argument)


class PreparedUpdate:
    """``where(*args).update(**values)``, its SQL built once per database backend and per
    the columns set (and which are set to NULL); ``prepared(*args, **values)`` returns the
    number of rows updated. Values the ORM would write as SQL expressions (``F(...)``), or
    that its SQL would hold other than as a parameter, are updated through the ORM."""

    def __init__(self, where: Callable[..., QuerySet[Any]], arity: int) -> None:
        self._where = where
        self._arity = arity
        self._built: dict[tuple[Any, ...], _BuiltUpdate | None] = {}

    def __call__(self, *args: Any, **values: Any) -> int:
        if len(args) != self._arity:
            raise TypeError(f"{self._arity} argument(s) expected, got {len(args)}")
        connection = connections[DEFAULT_DB_ALIAS]
        built = None
        plain = all(_key_like(a) for a in args) and not any(
            hasattr(v, "resolve_expression") or hasattr(v, "prepare_database_save")
            for v in values.values()
        )
        if plain:
            key = (connection.vendor, *((name, v is None) for name, v in values.items()))
            built = self._built[key] if key in self._built else self._prepare(key, values)
        if built is None:  # as the ORM runs it
            return int(self._where(*args).update(**values))
        where = list(built.where)
        for position, index in built.slots:
            where[position] = args[index]
        given = (v for v in values.values() if v is not None)
        params = [
            field.get_db_prep_save(value, connection=connection)
            for field, value in zip(built.fields, given, strict=True)
        ]
        with transaction.mark_for_rollback_on_error(), connection.cursor() as cursor:
            cursor.execute(built.sql, params + where)
            return int(cursor.rowcount)

    def _prepare(self, key: tuple[Any, ...], values: dict[str, Any]) -> _BuiltUpdate | None:
        stand_ins = _stand_ins(self._arity)
        query: Any = self._where(*stand_ins).query.chain(UpdateQuery)
        query.add_update_values(values)
        sql, params = query.get_compiler(using=DEFAULT_DB_ALIAS).as_sql()
        if query.related_updates or query.count_active_tables() != 1:
            raise ValueError("only an update of one table by its own columns can be prepared")
        connection = connections[DEFAULT_DB_ALIAS]
        set_to = [(field, value) for field, _model, value in query.values if value is not None]
        converted = [f.get_db_prep_save(v, connection=connection) for f, v in set_to]
        built = None
        if _alike(params[: len(set_to)], converted):  # else a value its SQL holds otherwise
            where = tuple(params[len(set_to) :])
            built = _BuiltUpdate(sql, tuple(f for f, _v in set_to), where, _slots(where, stand_ins))
        self._built[key] = built
        return built


@dataclass(frozen=True)
class _BuiltInsert:
    sql: str
    fields: tuple[Any, ...]  # the columns written, in order
    returning: tuple[Any, ...]  # the columns the database gives back (its key)
    returns_columns: bool  # given back by the INSERT itself (RETURNING), else its last id


class PreparedInsert:
    """``model.objects.create(**values)``, its SQL built once per database backend; returns
    the new row (its key set). A model whose saves something listens to (``pre_save``,
    ``post_save``), or a value its SQL would hold other than as a parameter, is saved
    through the ORM."""

    def __init__(self, model: type[Model]) -> None:
        self._model = model
        self._built: dict[str, _BuiltInsert | None] = {}

    def __call__(self, **values: Any) -> Any:
        model = self._model
        row = model(**values)
        connection = connections[DEFAULT_DB_ALIAS]
        built = None
        if not (signals.pre_save.has_listeners(model) or signals.post_save.has_listeners(model)):
            vendor = connection.vendor
            built = self._built[vendor] if vendor in self._built else self._prepare(row, vendor)
        if built is None:  # as the ORM saves it
            row.save(force_insert=True)
            return row
        params = [f.get_db_prep_save(f.pre_save(row, True), connection=connection)
                  for f in built.fields]  # fmt: skip
        with transaction.mark_for_rollback_on_error(), connection.cursor() as cursor:
            cursor.execute(built.sql, params)
            if built.returns_columns:
                given = connection.ops.fetch_returned_insert_columns(cursor, ())  # type: ignore[attr-defined]  # Django 5.2's
            else:
                given = (connection.ops.last_insert_id(cursor, model._meta.db_table,
                                                       built.returning[0].column),)  # fmt: skip
        for field, value in zip(built.returning, given, strict=True):
            setattr(row, field.attname, value)
        row._state.adding = False
        row._state.db = DEFAULT_DB_ALIAS
        return row

    def _prepare(self, row: Model, vendor: str) -> _BuiltInsert | None:
        meta = self._model._meta
        fields = tuple(f for f in meta.local_concrete_fields
                       if not f.generated and f is not meta.auto_field)  # fmt: skip
        returning = tuple(meta.db_returning_fields)
        connection = connections[DEFAULT_DB_ALIAS]
        query = InsertQuery(self._model)
        query.insert_values(fields, [row])
        compiler = query.get_compiler(using=DEFAULT_DB_ALIAS)
        compiler.returning_fields = list(returning)
        statements = compiler.as_sql()
        built = None
        columns = connection.features.can_return_columns_from_insert
        # The row's values as its fields gave them to the SQL just built (their pre_save
        # ran there), converted as a call converts them.
        converted = [f.get_db_prep_save(getattr(row, f.attname), connection=connection)
                     for f in fields]  # fmt: skip
        plain = len(returning) == 1 and (columns or isinstance(returning[0], AutoField))
        if len(statements) == 1 and plain and _alike(statements[0][1], converted):
            built = _BuiltInsert(statements[0][0], fields, returning, columns)
        self._built[vendor] = built
        return built


def _alike(built: Sequence[Any], converted: Sequence[Any]) -> bool:
    """Whether the parameters the SQL was built with are the values as converted: equal,
    or wrapping equal values alike (PostgreSQL's JSON parameters: ``Jsonb(obj)``)."""
    return len(built) == len(converted) and all(
        a == b or (type(a) is type(b) and hasattr(a, "obj") and a.obj == b.obj)
        for a, b in zip(built, converted, strict=True)
    )


def _converted(
    row: Sequence[Any], converters: dict[int, tuple[list[Any], Any]], connection: Any
) -> list[Any]:
    """A row's values as the ORM converts them (``SQLCompiler.apply_converters``)."""
    values = list(row)
    for position, (functions, expression) in converters.items():
        value = values[position]
        for function in functions:
            value = function(value, expression, connection)
        values[position] = value
    return values


def _key_like(value: Any) -> bool:
    """An int within a 64-bit column's range, as the stand-ins are (the ORM answers a value
    out of a column's range without asking the database; the driver would refuse it)."""
    return type(value) is int and -(2**63) <= value < 2**63


def _stand_ins(arity: int) -> list[int]:
    return [_STAND_IN + i for i in range(arity)]


def _slots(params: Sequence[Any], stand_ins: list[int]) -> tuple[tuple[int, int], ...]:
    """Where each argument's stand-in is among the parameters: (position, argument)."""
    slots = tuple(
        (position, stand_ins.index(value))
        for position, value in enumerate(params)
        if type(value) is int and value in stand_ins
    )
    missing = set(range(len(stand_ins))) - {index for _position, index in slots}
    if missing:
        raise ValueError(f"argument(s) {sorted(missing)} are not values of the query")
    return slots


def first(rows: Sequence[T]) -> T | None:
    """The first row, or None."""
    return rows[0] if rows else None
