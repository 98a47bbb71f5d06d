"""Boundaries of DESIGN §3 that the code must keep."""

import ast
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import hostagent


def test_hostagent_imports_no_django_and_nothing_from_capyctl():
    modules = [
        m.name
        for m in pkgutil.walk_packages(hostagent.__path__, "hostagent.")
        if not m.name.endswith("__main__")  # importing it would run the program
    ]
    assert "hostagent.kinds.vllm" in modules
    code = (
        "import importlib, sys\n"
        f"for name in {modules!r}: importlib.import_module(name)\n"
        "banned = ('django', 'capyctl', 'rest_framework', 'channels')\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in banned)\n"
        "print(','.join(bad))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == ""


def test_the_v1_routes_are_listed_in_one_place():
    """The OpenAI routes /v1 serves are named only in ``hostagent.routes``, which the
    gateway and the agent's relay both use. The simulated engines play engines (they serve
    routes, they do not let them through), and engine control sends its own calls (the
    warm-up, the model list, vLLM's adapter routes), named in ``hostagent.kinds.base``."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    allowed = {
        ("hostagent/kinds/base.py", path)
        for path in (
            "/v1/completions",
            "/v1/models",
            "/v1/load_lora_adapter",
            "/v1/unload_lora_adapter",
        )
    }
    found = []
    for package in ("capyctl", "hostagent"):
        for file in sorted((root / package).rglob("*.py")):
            name = file.relative_to(root).as_posix()
            if name == "hostagent/routes.py" or name.startswith("hostagent/sim/"):
                continue
            tree = ast.parse(file.read_text())
            docstrings = {
                id(node.value)
                for node in ast.walk(tree)
                if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
            }
            for node in ast.walk(tree):
                if not isinstance(node, ast.Constant) or id(node) in docstrings:
                    continue
                value = (
                    node.value.decode("latin-1") if isinstance(node.value, bytes) else node.value
                )
                if not isinstance(value, str) or not value.lstrip("^").startswith("/v1/"):
                    continue
                if value not in ("/v1/", "^/v1/") and (name, value) not in allowed:
                    found.append(f"{name}:{node.lineno}: {value!r}")
    assert found == []


# --- boundaries between the apps: who imports whom -------------------------------------------

GATEWAY_FACADE = "capyctl.scheduler.gateway_api"


def _sources(package: str) -> dict[str, str]:
    """Module name → source, for every module of ``package`` (migrations left out)."""
    root = Path(__file__).resolve().parent.parent
    found = {}
    for file in sorted((root / package.replace(".", "/")).rglob("*.py")):
        parts = list(file.relative_to(root).with_suffix("").parts)
        if "migrations" in parts:
            continue
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = file.read_text()
    return found


def _imports(source: str, modules: set[str]) -> tuple[set[str], list[tuple[int, str]]]:
    """What ``source`` imports of ``modules``: (at module level, [(line, module)] inside
    functions). ``from p import m`` names the module ``p.m`` when there is one; imports
    under ``if TYPE_CHECKING`` never run and are left out."""
    top: set[str] = set()
    inner: list[tuple[int, str]] = []

    def named(node: ast.Import | ast.ImportFrom) -> list[str]:
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif node.module and not node.level:
            names = [
                f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                for a in node.names
            ]
        else:
            names = []
        return [name for name in names if name in modules]

    def walk(nodes: list[ast.stmt], in_function: bool) -> None:
        for node in nodes:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            if isinstance(node, ast.Import | ast.ImportFrom):
                if in_function:
                    inner.extend((node.lineno, name) for name in named(node))
                else:
                    top.update(named(node))
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                walk(node.body, True)
            else:
                for field in ("body", "orelse", "finalbody", "handlers"):
                    walk(getattr(node, field, None) or [], in_function)

    walk(ast.parse(source).body, False)
    return top, inner


def hidden_circles(sources: dict[str, str]) -> list[str]:
    """Imports inside functions whose module imports the importer back (through
    module-level imports): a circle that the function-level import only hides."""
    modules = set(sources)
    graph = {}
    inner = {}
    for name, source in sources.items():
        graph[name], inner[name] = _imports(source, modules)

    def reaches(start: str, goal: str) -> bool:
        seen: set[str] = set()
        todo = [start]
        while todo:
            name = todo.pop()
            if name == goal:
                return True
            if name not in seen:
                seen.add(name)
                todo.extend(graph.get(name, ()))
        return False

    return [
        f"{name}:{line}: imports {target}, which imports {name} back"
        for name in sorted(inner)
        for line, target in inner[name]
        if target != name and reaches(target, name)
    ]


def test_the_gateway_uses_the_scheduler_only_through_its_facade():
    """The gateway holds no scheduling logic (DESIGN §3, rule 5): of the scheduler it
    imports ``capyctl.scheduler.gateway_api`` and nothing else, anywhere in a module."""
    scheduler = set(_sources("capyctl.scheduler"))
    assert GATEWAY_FACADE in scheduler
    found = []
    for name, source in _sources("capyctl.gateway").items():
        top, inner = _imports(source, scheduler)
        used = top | {module for _, module in inner}
        found += [f"{name} imports {module}" for module in sorted(used - {GATEWAY_FACADE})]
    assert found == []


def test_hosts_import_nothing_from_the_scheduler():
    """Hosts (models, enrolment, certificates, registration) come before the scheduler: the
    scheduler drives them (the remote host driver, host polling and the host changes that
    move a host's state live in ``capyctl.scheduler``), never the other way round. The
    admin, like every view, asks the scheduler's verbs for what people want, and nothing
    imports an admin module, so it closes no circle."""
    scheduler = set(_sources("capyctl.scheduler"))
    found = []
    for name, source in _sources("capyctl.hosts").items():
        if name == "capyctl.hosts.admin":
            continue
        top, inner = _imports(source, scheduler | {"capyctl.scheduler"})
        used = top | {module for _, module in inner}
        found += [f"{name} imports {module}" for module in sorted(used)]
    assert found == []


# The verbs, each importing only those after it: a verb never calls back up.
VERB_ORDER = ["ready", "wake", "start", "evict", "park", "stop", "drain", "adapters", "common"]


def test_the_verbs_call_only_down():
    """``capyctl.scheduler.actions``: ready → wake → start → evict → park → stop → drain, so
    a wake read top to bottom never comes back to a module it left."""
    verbs = {f"capyctl.scheduler.actions.{name}" for name in VERB_ORDER}
    sources = _sources("capyctl.scheduler.actions")
    assert set(sources) - {"capyctl.scheduler.actions"} == verbs
    found = []
    for name in sorted(verbs):
        top, inner = _imports(sources[name], verbs)
        assert not inner, f"{name} imports a verb inside a function"
        rank = VERB_ORDER.index(name.rsplit(".", 1)[1])
        found += [f"{name} imports {target}" for target in sorted(top)
                  if VERB_ORDER.index(target.rsplit(".", 1)[1]) <= rank]  # fmt: skip
    assert found == []


def test_the_replay_runs_the_servers_step_and_asks_nothing_of_its_state():
    """The what-if replay uses the scheduler's step, policy, scaling decision, routing and
    errors, and reads the server's constants (lazily, once); it imports none of the verbs,
    the writer, the ledger or the database-backed snapshots: it cannot copy their
    decisions, only share the step's."""
    allowed = {
        "capyctl.scheduler.steps",
        "capyctl.scheduler.policy",
        "capyctl.scheduler.scaling",
        "capyctl.scheduler.routing",
        "capyctl.scheduler.errors",
        "capyctl.scheduler.estimates",
        "capyctl.scheduler.executor",
        "capyctl.scheduler",
    }
    scheduler = set(_sources("capyctl.scheduler")) | {"capyctl.scheduler"}
    found = []
    uses_the_step = []
    for name, source in _sources("capyctl.whatif").items():
        top, inner = _imports(source, scheduler)
        used = top | {module for _, module in inner}
        found += [f"{name} imports {module}" for module in sorted(used - allowed)]
        if "steps.until_ready(" in source:
            uses_the_step.append(name)
    assert found == []
    assert uses_the_step == ["capyctl.whatif.ensure_ready"]


def test_the_step_loads_no_django_settings_and_no_database(tmp_path):
    """The step is plain Python over its world: importing it sets up no Django and loads
    no model, so the replay and the server share it without a database between."""
    code = (
        "import sys\n"
        "import capyctl.scheduler.steps\n"
        "print(any(m.startswith('django.db.models') or m.endswith('.models') and "
        "m.startswith('capyctl') for m in sys.modules))\n"
    )
    assert _run_cli_code(code, tmp_path).strip() == "False"


def test_no_function_level_import_hides_a_circle():
    """An import inside a function is for a module this one need not load up front (Celery,
    Redis, certificates kept off the listings' start-up), never to break a circle: the
    module imported never imports the importer back."""
    assert hidden_circles(_sources("capyctl")) == []


def test_the_circle_check_finds_a_hidden_circle():
    """The check sees a circle through a third module, and only when the import is hidden
    in a function; one under ``TYPE_CHECKING`` never runs and is no circle."""
    sources = {
        "a": "import b\n",
        "b": "from c import thing\n",
        "c": "def thing():\n    from a import x  # noqa: PLC0415\n    return x\n",
    }
    assert hidden_circles(sources) == ["c:2: imports a, which imports c back"]
    sources["b"] = "if TYPE_CHECKING:\n    from c import thing\n"
    assert hidden_circles(sources) == []


def _run_cli_code(code: str, data_dir: Path) -> str:
    env = {**os.environ, "CAPYCTL_DATA_DIR": str(data_dir)}
    env.pop("CAPYCTL_DATABASE_URL", None)
    env.pop("CAPYCTL_REDIS_URL", None)
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_listing_imports_no_server_and_no_task_queue(tmp_path):
    """A command that only reads imports only what it runs: not the ASGI servers (daphne
    pulls in Twisted) nor Celery, which a listing never uses and which cost every
    ``capyctl`` call most of a second."""
    code = (
        "import sys\n"
        "from capyctl.cli import run\n"
        "code = run(['engine', 'list'])\n"
        "heavy = ('daphne', 'twisted', 'celery', 'kombu', 'uvicorn')\n"
        "print(code, ','.join(sorted({m.split('.')[0] for m in sys.modules} & set(heavy))))\n"
    )
    out = _run_cli_code(code, tmp_path)
    assert out.split("\n")[-2] == "0 ", out


# What listings once imported and never use: HTTP clients (httpx brings rich, click and
# pygments), certificates, process and GPU probes, the agent driver, the start command,
# the admin modules, and, on a database already up to date, the migration graph with
# every migration file.
LISTING_NEVER_IMPORTS = (
    "httpx",
    "rich",
    "click",
    "pygments",
    "cryptography",
    "psutil",
    "pynvml",
    "hostagent.tls",
    "hostagent.probe",
    "capyctl.scheduler.remote_hosts",
    "capyctl.cli.start",
    "django.db.migrations.executor",
    "django.core.management.commands.migrate",
)


def test_listings_import_no_http_client_no_certificates_and_no_migrations(tmp_path):
    """Each listing and ``status``, on a data dir already set up, imports none of
    :data:`LISTING_NEVER_IMPORTS`, no admin module and no migration file."""
    _run_cli_code("from capyctl.cli import run\nassert run(['engine', 'list']) == 0\n", tmp_path)
    commands = [
        ["deployment", "list"],
        ["engine", "list"],
        ["host", "list"],
        ["key", "list"],
        ["user", "list"],
        ["cache", "list"],
        ["events", "--limit", "3"],
        ["status"],
    ]
    code = (
        "import contextlib, io, re, sys\n"
        "from capyctl.cli import run\n"
        f"never = {LISTING_NEVER_IMPORTS!r}\n"
        f"for argv in {commands!r}:\n"
        "    with contextlib.redirect_stdout(io.StringIO()):\n"
        "        code = run(argv)\n"
        "    bad = sorted(m for m in sys.modules if m in never or m.split('.')[0] in never\n"
        "                 or re.search(r'\\.migrations\\.\\d|^capyctl\\.\\w+\\.admin$', m))\n"
        "    print(' '.join(argv), code, ','.join(bad))\n"
    )
    out = _run_cli_code(code, tmp_path)
    assert out.splitlines() == [f"{' '.join(argv)} 0 " for argv in commands]


def test_commands_run_with_the_garbage_collector_back_on(tmp_path):
    """``main`` turns collection off only while Django loads: the command itself (a server,
    for ``capyctl start``) runs with it on."""
    code = (
        "import gc\n"
        "from capyctl.cli import commands, main\n"
        "listing = commands.engine_list\n"
        "def engine_list(args):\n"
        "    print('collecting:', gc.isenabled())\n"
        "    return listing(args)\n"
        "commands.engine_list = engine_list\n"
        "main(['engine', 'list'])\n"
    )
    out = _run_cli_code(code, tmp_path)
    assert out.splitlines() == ["collecting: True", "no engines"]


def test_the_admin_checks_see_every_model_admin(tmp_path):
    """Start-up leaves the admin modules alone (see capyctl.adminapp), yet the admin's
    checks (``manage.py check``) still check every ModelAdmin."""
    code = (
        "import os\n"
        "import django\n"
        "os.environ.setdefault('DJANGO_SETTINGS_MODULE', 'capyctl.settings')\n"
        "django.setup()\n"
        "from django.contrib import admin\n"
        "from django.core import checks\n"
        "print(len(admin.site._registry))\n"
        "print(checks.run_checks(tags=[checks.Tags.admin]))\n"
        "print(' '.join(sorted(m._meta.label for m in admin.site._registry)))\n"
    )
    out = _run_cli_code(code, tmp_path)
    registered = (
        "access.ApiKey access.Budget access.Team access.Usage access.UserLimits auth.Group "
        "auth.User deployments.Adapter "
        "deployments.Deployment deployments.Instance deployments.LoadedAdapter engines.Engine "
        "events.Event hosts.Host ledger.LedgerEntry traces.RequestTrace"
    )
    assert out.splitlines() == ["0", "[]", registered]


WRITER = "capyctl/scheduler/transitions/"  # the writer: this package alone
LEDGER = "capyctl/ledger/services.py"
# A deployment's observed state with what goes with it, and its desired state.
STATE_FIELDS = {
    "observed_state",
    "parked_mode",
    "state_reason",
    "state_changed_at",
    "desired_state",
}
WRITES = {"update", "create", "get_or_create", "update_or_create", "bulk_create", "delete"}
LEDGER_WRITES = {
    "admit",
    "set_measured",
    "release",
    "mark_unconfirmed",
    "mark_host_unconfirmed",
    "held_again",
    "host_held_again",
    "set_foreign",
}


def _keywords(node: ast.Call) -> set[str]:
    """The fields a write names: its keywords, and the keys of a ``defaults=`` dict."""
    names = {k.arg for k in node.keywords if k.arg}
    for keyword in node.keywords:
        if keyword.arg in ("defaults", "create_defaults") and isinstance(keyword.value, ast.Dict):
            names |= {
                k.value
                for k in keyword.value.keys
                if isinstance(k, ast.Constant) and isinstance(k.value, str)
            }
    return names


def state_writers(name: str, source: str) -> list[str]:  # noqa: PLR0912 - one walk, many checks
    """Where ``source`` (the module ``name``) writes what only the writer may write: a
    deployment's state fields, an instance's or a host's state, a ledger entry (directly,
    through the ledger's writing functions, or by deleting a host, whose entries go with
    it)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        where = f"{name}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            chain = ast.unparse(node.func)
            if node.func.attr in WRITES:
                fields = _keywords(node)
                if "LedgerEntry" in chain:
                    found.append(f"{where}: writes ledger entries ({chain})")
                if "state" in fields:
                    found.append(f"{where}: writes an instance's or a host's state ({chain})")
                if fields & STATE_FIELDS:
                    found.append(f"{where}: writes a deployment's state ({chain})")
                if node.func.attr == "delete" and "host" in chain.lower():
                    found.append(f"{where}: deletes a host and its ledger entries ({chain})")
        if isinstance(node, ast.ImportFrom) and node.module == "capyctl.ledger.services":
            for alias in node.names:
                if alias.name in LEDGER_WRITES:
                    found.append(f"{where}: imports the ledger's writer {alias.name}")
        if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for leaf in ast.walk(target):
                    if not isinstance(leaf, ast.Attribute):
                        continue
                    owner = ast.unparse(leaf.value).lower()
                    if leaf.attr in STATE_FIELDS or (
                        leaf.attr == "state" and ("host" in owner or "instance" in owner)
                    ):
                        found.append(f"{where}: assigns {leaf.attr}")
    return found


def test_which_engines_hold_an_adapter_has_one_writer():
    """Rows of ``LoadedAdapter`` (which engines hold an adapter) are written by the
    adapters' verb alone: no other module creates, updates or deletes them."""
    root = Path(__file__).resolve().parent.parent
    own = root / "capyctl/scheduler/actions/adapters.py"
    found, seen = [], 0
    for file in sorted((root / "capyctl").rglob("*.py")):
        if "migrations" in file.parts:
            continue
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                chain = ast.unparse(node.func)
                if node.func.attr in WRITES and "LoadedAdapter" in chain:
                    seen += file == own
                    if file != own:
                        found.append(f"{file.relative_to(root)}:{node.lineno}: {chain}")
    assert seen, "the check finds the verb's own writes"
    assert found == []


def test_state_and_the_ledger_have_one_writer():
    """A deployment's observed state (with its parked mode, reason and when it changed)
    and its desired state, an instance's and a host's state, and every ledger entry are
    written only by ``capyctl.scheduler.transitions`` (through ``capyctl.ledger.services``
    for the entries): no other module passes them to an update or create, assigns them,
    calls the ledger's writing functions or deletes a host (whose entries go with it)."""
    root = Path(__file__).resolve().parent.parent
    found = []
    for file in sorted((root / "capyctl").rglob("*.py")):
        name = file.relative_to(root).as_posix()
        if name.startswith(WRITER) or name == LEDGER or "/migrations/" in name:
            continue
        found += state_writers(name, file.read_text())
    assert found == []


# Writes the one-writer check once missed, each as it stood in its module.
PLANTED = [
    (
        "capyctl/scheduler/fetching.py",
        (
            "rows = Deployment.objects.filter(pk=deployment.pk, observed_state=S.DOWNLOADING)\n"
            "rows.update(download=data, state_reason=f'downloading {deployment.source}')\n"
        ),
    ),
    (
        "capyctl/hosts/services.py",
        "with transaction.atomic():\n    host.delete()\n",
    ),
    (
        "capyctl/hosts/services.py",
        (
            "host, created = Host.objects.get_or_create(\n"
            "    name=LOCAL_HOST_NAME, defaults={'is_local': True, 'state': Host.State.ONLINE}\n)\n"
        ),
    ),
    ("capyctl/hosts/services.py", "host.state = Host.State.ONLINE\n"),
    (
        "capyctl/scheduler/remote_hosts.py",
        "Host.objects.filter(pk=host.pk).update(state=Host.State.UNREACHABLE)\n",
    ),
    (
        "capyctl/scheduler/remote_hosts.py",
        "answered.update(state=Host.State.ONLINE, inventory=inventory)\n",
    ),
    (
        "capyctl/scheduler/intents.py",
        "Deployment.objects.filter(pk=deployment.pk).update(desired_state=desired)\n",
    ),
    (
        "capyctl/scheduler/actions/ready.py",
        "Deployment.objects.filter(pk=deployment_id).update(state_changed_at=timezone.now())\n",
    ),
]


@pytest.mark.parametrize(("name", "source"), PLANTED)
def test_the_one_writer_check_finds_each_write_it_once_missed(name, source):
    """Each write the check once let through, planted back into a module, is found."""
    assert len(state_writers(name, source)) == 1, state_writers(name, source)


# --- a ledger entry's status changes only in capyctl/ledger ----------------------------

LEDGER_PACKAGE = "capyctl/ledger/"
# How code reaches ledger entries: the model, or the related managers of a host and a
# deployment.
LEDGER_ROWS = ("LedgerEntry", ".ledger.", ".ledger_entries")
ROW_WRITES = {"update", "bulk_update", "create", "get_or_create", "update_or_create", "bulk_create"}


def _reaches_ledger(node: ast.AST, bound: set[str]) -> bool:
    """Whether ``node`` is (or is built from) ledger entries: it names the model or a
    ledger manager, or starts from a name bound to one."""
    text = ast.unparse(node) + "."
    if any(mark in text for mark in LEDGER_ROWS):
        return True
    return any(isinstance(leaf, ast.Name) and leaf.id in bound for leaf in ast.walk(node))


def _ledger_names(tree: ast.AST) -> set[str]:
    """Names bound to ledger entries: assigned a query of them, or looping over one."""
    bound: set[str] = set()
    for _ in range(3):  # names bound from names bound from the model
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if _reaches_ledger(node.value, bound):
                    bound |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
            if isinstance(node, ast.For | ast.comprehension) and _reaches_ledger(node.iter, bound):
                bound |= {n.id for n in ast.walk(node.target) if isinstance(n, ast.Name)}
    return bound


def _names_status(node: ast.Call) -> bool:
    """Whether a write names the ``status`` field (a keyword, or a ``bulk_update`` field)."""
    if "status" in _keywords(node):
        return True
    return any(
        isinstance(leaf, ast.Constant) and leaf.value == "status"
        for arg in [*node.args, *(k.value for k in node.keywords)]
        for leaf in ast.walk(arg)
    )


def ledger_status_writers(name: str, source: str) -> list[str]:
    """Where ``source`` (the module ``name``) changes a ledger entry's status other than
    through :mod:`capyctl.ledger.services`: an ORM write that names ``status`` on ledger
    entries, an assignment to an entry's ``status``, or SQL on the ledger's table."""
    tree = ast.parse(source)
    bound = _ledger_names(tree)
    found = []
    for node in ast.walk(tree):
        where = f"{name}:{getattr(node, 'lineno', 0)}"
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ROW_WRITES
            and _names_status(node)
            and _reaches_ledger(node.func.value, bound)
        ):
            found.append(f"{where}: changes a ledger entry's status ({ast.unparse(node.func)})")
        if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for leaf in (leaf for target in targets for leaf in ast.walk(target)):
                if (
                    isinstance(leaf, ast.Attribute)
                    and leaf.attr == "status"
                    and _reaches_ledger(leaf.value, bound)
                ):
                    found.append(f"{where}: assigns a ledger entry's status")
        if isinstance(node, ast.Attribute) and ast.unparse(node) == "LedgerEntry._meta.db_table":
            found.append(f"{where}: names the ledger's table (SQL of its own)")
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and "ledger_ledgerentry" in node.value.lower()
        ):
            found.append(f"{where}: names the ledger's table (SQL of its own)")
    return found


def test_a_ledger_entrys_status_changes_only_through_the_ledgers_functions():
    """Outside ``capyctl/ledger`` (the transitions included), no module changes a ledger
    entry's status through the ORM or SQL of its own: the transitions call the ledger's
    functions (``mark_unconfirmed``, ``held_again``...), which alone write entries."""
    root = Path(__file__).resolve().parent.parent
    found = []
    for file in sorted((root / "capyctl").rglob("*.py")):
        name = file.relative_to(root).as_posix()
        if name.startswith(LEDGER_PACKAGE) or "/migrations/" in name:
            continue
        found += ledger_status_writers(name, file.read_text())
    assert found == []


# Status changes the transitions once made through the ORM, each as it stood there, and
# other ways the check must see.
PLANTED_STATUS_WRITES = [
    (
        "unconfirmed = LedgerEntry.objects.filter(\n"
        "    host=locked, deployment=deployment, status=Status.UNCONFIRMED\n)\n"
        "set_measured(locked, deployment.pk, figures)\n"
        "unconfirmed.update(status=Status.HELD)\n"
    ),
    (
        "LedgerEntry.objects.filter(\n"
        "    host=locked, deployment__isnull=False, status__in=[Status.HELD, Status.PROMISED]\n"
        ").update(status=Status.UNCONFIRMED, note=UNREACHABLE_NOTE)\n"
    ),
    (
        "LedgerEntry.objects.filter(\n"
        "    host=locked, status=Status.UNCONFIRMED, note=UNREACHABLE_NOTE\n"
        ").update(status=Status.HELD, note='')\n"
    ),
    "locked.ledger.filter(deployment=None).update(status=Status.FOREIGN)\n",
    "deployment.ledger_entries.update(status='held')\n",
    ("for entry in LedgerEntry.objects.filter(host=host):\n    entry.status = Status.HELD\n"),
    "rows = list(host.ledger.all())\nLedgerEntry.objects.bulk_update(rows, ['status'])\n",
    (
        "table = LedgerEntry._meta.db_table\n"
        "cursor.execute(f'UPDATE {table} SET bytes = 0 WHERE host_id = %s', [host.pk])\n"
    ),
]


@pytest.mark.parametrize("source", PLANTED_STATUS_WRITES)
def test_the_ledger_status_check_finds_each_planted_write(source):
    """Each status change, planted into the writer, is found exactly once."""
    found = ledger_status_writers(f"{WRITER}base.py", source)
    assert len(found) == 1, found


def test_the_ledger_status_check_leaves_other_statuses_and_reads_alone():
    """An operation's status is not a ledger entry's, and reading entries changes nothing."""
    source = (
        "Operation.objects.filter(pk=operation_id).update(status=Operation.Status.DONE)\n"
        "unconfirmed = LedgerEntry.objects.filter(status=Status.UNCONFIRMED).exists()\n"
        "held_again(locked, deployment.pk)\n"
        "operation.status = 'done'\n"
    )
    assert ledger_status_writers(f"{WRITER}base.py", source) == []


@pytest.mark.django_db
@pytest.mark.parametrize("model", ["Host", "Deployment"])
def test_a_host_and_a_deployment_refuse_a_full_save(model, gpu24):
    """A full save would write back the state as it was read, undoing what the writer did
    meanwhile: an existing host or deployment saves only the fields it names."""
    from capyctl.hosts.models import Host
    from tests.scheduling import deployment, vllm_engine

    vllm_engine()
    row = Host.objects.get() if model == "Host" else deployment("alpha")
    with pytest.raises(
        TypeError, match=rf"{model}\.save\(\) of an existing row needs update_fields"
    ):
        row.save()
    row.save(update_fields=["updated_at"])


# --- the CLI reads and writes through the services ------------------------------------

CLI_PACKAGE = "capyctl/cli"
# Queryset and model calls no other object here makes; ``filter``, ``exclude`` and ``get``
# count when they take keywords (``dict.get`` takes none), ``all`` when it takes nothing.
ORM_CALLS = {
    "select_related",
    "prefetch_related",
    "values_list",
    "annotate",
    "aggregate",
    "order_by",
    "get_or_create",
    "update_or_create",
    "bulk_create",
    "bulk_update",
    "refresh_from_db",
}
ORM_LOOKUPS = {"filter", "exclude", "get"}


def _type_checking_only(tree: ast.AST) -> set[int]:
    """The ids of the nodes under ``if TYPE_CHECKING:``: imports for annotations, not run."""
    return {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If)
        and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
        for statement in node.body
        for inner in ast.walk(statement)
    }


def cli_orm_uses(source: str) -> list[str]:
    """Where ``source`` (a module of the CLI) uses the ORM itself: it imports a models module
    (or Django's ``transaction`` or ``get_user_model``), reaches a manager (``.objects``),
    or calls a queryset's or a related manager's methods."""
    tree = ast.parse(source)
    annotations_only = _type_checking_only(tree)
    found = []
    for node in ast.walk(tree):
        if id(node) in annotations_only:
            continue
        if isinstance(node, ast.ImportFrom):
            module, names = node.module or "", {alias.name for alias in node.names}
            if (
                module.endswith(".models")
                or module == "django.db.models"
                or (
                    module in ("django.db", "django.contrib.auth")
                    and names & {"models", "transaction", "get_user_model"}
                )
            ):
                found.append(ast.unparse(node))
        elif isinstance(node, ast.Import):
            found += [ast.unparse(node) for alias in node.names if alias.name.endswith(".models")]
        elif isinstance(node, ast.Attribute) and node.attr in ("objects", "_default_manager"):
            found.append(ast.unparse(node))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            call = node.func.attr
            if (
                call in ORM_CALLS
                or (call in ORM_LOOKUPS and node.keywords)
                or (call == "all" and not node.args and not node.keywords)
            ):
                found.append(ast.unparse(node))
    return found


def test_the_cli_uses_no_orm_of_its_own():
    """The CLI's commands read and change things through the service and report functions
    that REST's views use (``capyctl.reports``, each app's ``services``), so the two cannot
    list or accept different things: no module of ``capyctl/cli`` (a start and the demo's
    set-up included) imports a models module or queries a model itself."""
    root = Path(__file__).resolve().parent.parent
    found = []
    for file in sorted((root / CLI_PACKAGE).rglob("*.py")):
        name = file.relative_to(root).as_posix()
        found += [f"{name}: {use}" for use in cli_orm_uses(file.read_text())]
    assert found == []


# The CLI's own uses of the ORM before its commands went through the services, as they stood.
PLANTED_CLI_ORM = [
    "from capyctl.hosts.models import LOCAL_HOST_NAME, Host\n",
    "Host.objects.filter(name=LOCAL_HOST_NAME).exists()\n",
    "row = Deployment.objects.filter(pk=deployment_id).values('observed_state', 'download')\n",
    "query = query.filter(subject=args.model)\n",
    "hosts = [h.name for h in Host.objects.order_by('name')]\n",
    "keep = [d.source for d in Deployment.objects.select_related('engine')]\n",
    "names = ','.join(d.name for d in key.allowed_models.all())\n",
    "import capyctl.events.models\n",
    "from django.db import transaction\n",
    "if op.status == Operation.Status.DONE:\n    from capyctl.scheduler.models import Operation\n",
    "op.refresh_from_db()\n",
    "local = Host.objects.get(name=LOCAL_HOST_NAME)\n",
    "has_models = Deployment.objects.exists()\n",
    "earlier = ApiKey.objects.filter(user__username=username, name=KEY_NAME, revoked_at=None)\n",
    "for key_id in list(earlier.values_list('key_id', flat=True)):\n    revoke(key_id)\n",
]


@pytest.mark.parametrize("source", PLANTED_CLI_ORM)
def test_the_cli_orm_check_finds_each_planted_use(source):
    assert len(cli_orm_uses(source)) >= 1, source


def test_the_cli_orm_check_leaves_plain_python_alone():
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from capyctl.hosts.models import Host\n"
        "from django.db import DatabaseError\n"
        "limit = data.get('limit')\nvalues = sorted(data.values())\n"
        "scenario.save(data, path)\nitems = filter(None, rows)\n"
    )
    assert cli_orm_uses(source) == []
