"""Adapters: LoRA fine-tunes named as models, served by their base deployment's engine,
loaded on demand, the least recently used one unloaded when its slots are full
(docs/adapters.md)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any, cast

import httpx
import pytest
from asgiref.sync import sync_to_async

from capyctl.access.services import issue_api_key
from capyctl.deployments.adapters import add_adapter, remove_adapter
from capyctl.deployments.models import Adapter, Deployment, LoadedAdapter
from capyctl.deployments.services import remove_deployment
from capyctl.engines.services import add_engine
from capyctl.errors import UserError
from capyctl.events.models import Event
from capyctl.scheduler import actions
from tests.conftest import table_counts
from tests.scheduling import SIM, SIM_ENV, deployment


def lora_dir(root: Path, name: str, rank: int = 8) -> str:
    """An adapter's folder as PEFT writes it (the simulated engines read its rank)."""
    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps({"r": rank, "peft_type": "LORA"}))
    (folder / "adapter_model.safetensors").write_bytes(b"\0" * 1024)
    return str(folder)


def _base(tmp_path: Path, slots: int = 2, **env: str) -> Deployment:
    add_engine("sim-vllm", kind="vllm", command=f"{SIM} vllm", env={**SIM_ENV, **env})
    return cast("Deployment", deployment("base", adapter_slots=slots))


@pytest.mark.django_db
def test_an_adapter_needs_a_free_name_and_a_base_with_slots_that_can_serve_it(tmp_path):
    add_engine("sim-vllm", kind="vllm", command=f"{SIM} vllm", env=SIM_ENV)
    add_engine("own", kind="custom", command="/bin/true --host {host} --port {port}")
    deployment("plain")  # no adapter slots
    deployment("base", adapter_slots=2, aliases=["base-alias"])
    deployment("other", engine="own")
    path = lora_dir(tmp_path, "sql")
    before = table_counts()
    refusals = {
        ("Sql Bot", "base"): r"^invalid adapter name 'Sql Bot': use 1-63 lowercase",
        ("base", "base"): r"^'base' is already the name of deployment 'base'$",
        ("base-alias", "base"): r"^'base-alias' is already the name of an alias of 'base'$",
        ("sql", "nowhere"): r"^no deployment named 'nowhere'$",
        ("sql", "plain"): r"^deployment 'plain' has no adapter slots; give it some first: "
        r"capyctl deployment update plain --adapter-slots N$",
        ("sql", "other"): r"^deployment 'other' runs engine 'own' \(custom\), which cannot "
        r"serve adapters; use a vllm, sglang or llamacpp engine$",
    }
    for (name, base), message in refusals.items():
        with pytest.raises(UserError, match=message):
            add_adapter(name, base, path)
    with pytest.raises(UserError, match="contains control characters"):
        add_adapter("sql", "base", str(tmp_path / "a\nb"))
    with pytest.raises(UserError, match=r"^engine 'own' \(custom\) cannot serve adapters; "
                       r"leave its adapter slots at 0$"):  # fmt: skip
        deployment("fourth", engine="own", adapter_slots=1)
    assert table_counts() == before  # a refusal changes nothing

    add_adapter("sql", "base", path)
    with pytest.raises(UserError, match=r"^an adapter named 'sql' already exists$"):
        add_adapter("sql", "base", path)
    # Deployments and aliases keep clear of adapters' names too.
    with pytest.raises(UserError, match=r"^'sql' is already the name of an adapter on 'base'$"):
        deployment("sql")
    with pytest.raises(UserError, match=r"^'sql' is already the name of an adapter on 'base'$"):
        deployment("third", aliases=["sql"])
    with pytest.raises(UserError, match=r"is the base of adapters sql; remove them first"):
        remove_deployment("base")
    remove_adapter("sql")
    remove_deployment("base")
    kinds = Event.objects.filter(kind__startswith="adapter.").order_by("pk")
    assert list(kinds.values_list("kind", flat=True)) == ["adapter.added", "adapter.removed"]


@pytest.mark.django_db
def test_the_cli_adds_lists_and_removes_adapters(cli, tmp_path):
    _base(tmp_path)
    path = lora_dir(tmp_path, "sql")
    result = cli("adapter", "add", "sql", "--base", "base", "--source", path)
    assert (result.code, result.out) == (
        0,
        "adapter sql added on base (loaded when first asked for)\n",
    )
    listing = cli("adapter", "list")
    assert listing.code == 0
    assert listing.out.splitlines()[0].split() == [
        "NAME",
        "BASE",
        "STATE",
        "LOADED",
        "IN",
        "SOURCE",
    ]
    assert listing.out.splitlines()[1].split() == ["sql", "base", "on", "the", "host", "-", path]
    data = json.loads(cli("adapter", "list", "--json").out)
    assert data == [{"name": "sql", "base": "base", "source": path, "state": "on the host",
                     "loaded_on": []}]  # fmt: skip
    refused = cli("adapter", "add", "sql2", "--base", "nowhere", "--source", path)
    assert (refused.code, refused.err) == (2, "capyctl: error: no deployment named 'nowhere'\n")
    assert cli("adapter", "remove", "sql").out == "adapter sql removed\n"
    assert cli("adapter", "list").out == "no adapters\n"


@pytest.mark.django_db
def test_rest_adds_lists_and_removes_adapters(client, alice, tmp_path):
    from django.contrib.auth.models import User

    User.objects.filter(pk=alice.pk).update(is_staff=True)
    client.force_login(User.objects.get(pk=alice.pk))
    _base(tmp_path)
    path = lora_dir(tmp_path, "sql")
    made = client.post("/api/adapters/", {"name": "sql", "base": "base", "source": path},
                       content_type="application/json")  # fmt: skip
    assert made.status_code == 201, made.content
    assert made.json() == {"name": "sql", "base": "base", "source": path,
                           "state": "on the host", "loaded_on": []}  # fmt: skip
    refused = client.post("/api/adapters/", {"name": "sql", "base": "base", "source": path},
                          content_type="application/json")  # fmt: skip
    assert refused.status_code == 400
    assert "already exists" in json.dumps(refused.json())
    assert [a["name"] for a in client.get("/api/adapters/").json()] == ["sql"]
    assert client.get("/api/adapters/sql/").json()["base"] == "base"
    assert client.get("/api/adapters/nope/").status_code == 404
    assert client.delete("/api/adapters/sql/").status_code == 204
    assert not Adapter.objects.exists()


def _client(gateway: Any, key: str) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=cast("Any", gateway))
    return httpx.AsyncClient(transport=transport, base_url="http://testserver", timeout=60,
                             headers={"Authorization": f"Bearer {key}"})  # fmt: skip


def _served(tmp_path: Path, names: list[str], slots: int = 2, **env: str) -> str:
    base = _base(tmp_path, slots=slots, **env)
    for name in names:
        add_adapter(name, "base", lora_dir(tmp_path, name))
    actions.ensure_ready(base.pk)
    return issue_api_key("bob")[1]


def _loaded() -> list[str]:
    return sorted(
        LoadedAdapter.objects.filter(instance__state="running").values_list(
            "adapter__name", flat=True
        )
    )


@pytest.mark.django_db(transaction=True)
async def test_each_adapter_answers_by_its_own_name_and_loads_once(
    gpu24, bob, database_threads, tmp_path
):
    """Two adapters on a simulated vLLM base: each answers by its own name, plain and
    streamed; the first request of each loads it (x-capyctl-switch says so), and many
    requests at once for one not loaded cause one load."""
    from capyctl.gateway.app import Gateway

    key = await sync_to_async(_served)(tmp_path, ["sql", "poet"])
    gateway = Gateway()
    async with _client(gateway, key) as client:

        async def chat(model: str, **extra: Any) -> httpx.Response:
            body = {"model": model, "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 2, **extra}  # fmt: skip
            return await client.post("/v1/chat/completions", json=body)

        answers = await asyncio.gather(*(chat("sql") for _ in range(8)))
        assert {a.status_code for a in answers} == {200}, [a.text for a in answers]
        assert {a.json()["model"] for a in answers} == {"sql"}
        switches = [a.headers.get("x-capyctl-switch") for a in answers]
        loads = [s for s in switches if s]
        assert loads, switches  # the ones that waited for the load say so
        assert all(s.startswith("loaded adapter sql ") for s in loads), switches
        events = await sync_to_async(
            lambda: list(
                Event.objects.filter(kind="adapter.loaded").values_list("message", flat=True)
            )
        )()
        assert len(events) == 1, events  # one load for all eight
        assert events[0].startswith("adapter sql loaded into base in "), events

        streamed = await chat("poet", stream=True)
        assert streamed.status_code == 200
        assert streamed.headers["x-capyctl-switch"].startswith("loaded adapter poet ")
        chunks = [json.loads(line[6:]) for line in streamed.text.splitlines()
                  if line.startswith("data: {")]  # fmt: skip
        assert chunks
        assert {c["model"] for c in chunks} == {"poet"}
        again = await chat("poet")
        assert again.status_code == 200
        assert "x-capyctl-switch" not in again.headers
        # The base answers as itself beside them.
        assert (await chat("base")).json()["model"] == "base"

        models = (await client.get("/v1/models")).json()["data"]
        listed = {m["id"]: m.get("parent") for m in models}
        assert listed == {"base": None, "poet": "base", "sql": "base"}
        assert {m["id"]: m["state"] for m in models if "parent" in m} == {
            "poet": "loaded", "sql": "loaded"
        }  # fmt: skip
    await gateway.close()
    assert await sync_to_async(_loaded)() == ["poet", "sql"]


@pytest.mark.django_db(transaction=True)
async def test_a_third_adapter_unloads_the_least_recently_used_never_one_streaming(
    gpu24, bob, database_threads, tmp_path
):
    """Two slots: with `poet` streaming (its answer under way) and `sql` used after it,
    `docs` unloads `sql`, though `poet` was loaded first and used less recently: never
    one serving a request."""
    from capyctl.gateway.app import Gateway

    key = await sync_to_async(_served)(
        tmp_path, ["sql", "poet", "docs"], CAPYCTL_SIM_TOKENS_PER_SECOND="20"
    )
    gateway = Gateway()
    async with _client(gateway, key) as client:

        def body(model: str, tokens: int = 1, **extra: Any) -> dict[str, Any]:
            return {"model": model, "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": tokens, **extra}  # fmt: skip

        assert (await client.post("/v1/chat/completions", json=body("poet"))).status_code == 200
        assert (await client.post("/v1/chat/completions", json=body("sql"))).status_code == 200
        long = body("poet", tokens=60, stream=True)  # three seconds of answer
        async with client.stream("POST", "/v1/chat/completions", json=long) as streaming:
            lines = streaming.aiter_lines()
            assert (await anext(lines)).startswith("data: ")  # its answer has begun
            answer = await client.post("/v1/chat/completions", json=body("docs"))
            assert answer.status_code == 200, answer.text
            switch = answer.headers["x-capyctl-switch"]
            assert switch.startswith("unloaded adapter sql; loaded adapter docs "), switch
            rest = [line async for line in lines if line.startswith("data: ")]
            assert rest[-1] == "data: [DONE]"  # the stream ran to its end
        assert await sync_to_async(_loaded)() == ["docs", "poet"]
        unloaded = await sync_to_async(
            lambda: list(
                Event.objects.filter(kind="adapter.unloaded").values_list("message", flat=True)
            )
        )()
        assert len(unloaded) == 1
        assert unloaded[0].startswith("adapter sql unloaded from base in ")
        assert unloaded[0].endswith(
            "to make room for docs (least recently used, no request in flight)"
        )
    await gateway.close()


@pytest.mark.django_db(transaction=True)
async def test_a_key_allowed_one_adapter_sees_neither_the_other_nor_the_base(
    gpu24, bob, database_threads, tmp_path
):
    from capyctl.gateway.app import Gateway

    await sync_to_async(_served)(tmp_path, ["sql", "poet"])
    key = (await sync_to_async(issue_api_key)("bob", models=["sql"]))[1]
    gateway = Gateway()
    async with _client(gateway, key) as client:
        for model, status in (("sql", 200), ("poet", 404), ("base", 404)):
            body = {"model": model, "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 1}  # fmt: skip
            answer = await client.post("/v1/chat/completions", json=body)
            assert answer.status_code == status, (model, answer.text)
            if status == 404:
                assert answer.json()["error"]["code"] == "model_not_found"
        listed = [m["id"] for m in (await client.get("/v1/models")).json()["data"]]
        assert listed == ["sql"]
    await gateway.close()


@pytest.mark.django_db(transaction=True)
async def test_the_base_parked_and_woken_keeps_serving_its_adapters(
    gpu24, bob, database_threads, tmp_path
):
    from capyctl.gateway.app import Gateway

    key = await sync_to_async(_served)(tmp_path, ["sql"])
    gateway = Gateway()
    async with _client(gateway, key) as client:
        body = {"model": "sql", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
        base = await sync_to_async(Deployment.objects.get)(name="base")
        await sync_to_async(actions.park)(base.pk, "ram")
        answer = await client.post("/v1/chat/completions", json=body)
        assert answer.status_code == 200, answer.text
        assert answer.json()["model"] == "sql"
        assert answer.headers["x-capyctl-switch"].startswith("woke base ")
    await gateway.close()


@pytest.mark.django_db(transaction=True)
def test_a_vllm_base_with_adapter_slots_parks_in_ram_when_asked_to_park_deep(gpu24, bob, tmp_path):
    """vLLM with LoRA enabled fails to wake from a level-2 sleep (vllm#39934): its base
    parks in RAM instead, and says why; a policy of deep parks only stops it."""
    from capyctl.scheduler.placement_data import Resident
    from capyctl.scheduler.policy import park_mode
    from capyctl.scheduler.snapshots import snapshot

    _served(tmp_path, ["sql"])
    base = Deployment.objects.get(name="base")
    actions.park(base.pk, "deep")
    assert Deployment.objects.get(pk=base.pk).parked_mode == "ram"
    parked = Event.objects.filter(kind="deployment.parked").latest("pk").message
    assert "in RAM, not deep: vLLM with LoRA enabled fails to wake from a deep park" in parked
    actions.ensure_ready(base.pk)
    host = Deployment.objects.get(pk=base.pk).host
    assert host is not None
    resident = next(r for r in snapshot(host).residents if r.deployment_id == base.pk)
    assert not resident.can_park_deep
    assert resident.deep_refused.startswith("vLLM with LoRA enabled")
    deep_only = Resident(**{**resident.__dict__, "park_policy": "deep"})
    mode, why = park_mode(deep_only, snapshot(host), ram_free=0)
    assert (mode, why) == ("stop", f"it may not park deep: {resident.deep_refused}")


@pytest.mark.django_db(transaction=True)
async def test_adapters_load_again_after_their_base_parked_deep(
    gpu24, bob, database_threads, tmp_path
):
    """An SGLang base parked deep drops its adapters: the next request for one wakes the
    base and loads the adapter again."""
    from capyctl.gateway.app import Gateway

    def setup() -> str:
        add_engine("sim-sglang", kind="sglang", command=f"{SIM} sglang", env=SIM_ENV)
        base = deployment("base", engine="sim-sglang", adapter_slots=2, park="deep")
        add_adapter("sql", "base", lora_dir(tmp_path, "sql"))
        actions.ensure_ready(base.pk)
        return issue_api_key("bob")[1]

    key = await sync_to_async(setup)()
    gateway = Gateway()
    async with _client(gateway, key) as client:
        body = {"model": "sql", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        first = await client.post("/v1/chat/completions", json=body)
        assert first.status_code == 200, first.text
        assert first.headers["x-capyctl-switch"].startswith("loaded adapter sql ")
        base = await sync_to_async(Deployment.objects.get)(name="base")
        await sync_to_async(actions.park)(base.pk, "deep")
        assert await sync_to_async(_loaded)() == []
        again = await client.post("/v1/chat/completions", json=body)
        assert again.status_code == 200, again.text
        switch = again.headers["x-capyctl-switch"]
        assert switch.startswith("woke base "), switch
        assert "; loaded adapter sql " in switch, switch
    await gateway.close()
    messages = await sync_to_async(
        lambda: list(
            Event.objects.filter(kind="adapter.unloaded").values_list("message", flat=True)
        )
    )()
    assert messages == [
        "adapter sql unloaded from base: base parked deep; it loads again when asked for"
    ]


@pytest.mark.django_db(transaction=True)
def test_status_and_the_dashboard_show_adapters_under_their_base(gpu24, bob, cli, tmp_path):
    from capyctl.web.dashboard import dashboard_data

    _served(tmp_path, ["sql", "poet"])
    base = Deployment.objects.get(name="base")
    actions.adapters.load(base.pk, Adapter.objects.get(name="sql").pk, 30)
    lines = cli("status").out.splitlines()
    table = lines[lines.index("ADAPTER  BASE  STATE        LOADED IN") :]
    assert table[1:3] == ["poet     base  on the host  -", "sql      base  loaded       base"]
    data = json.loads(cli("status", "--json").out)
    assert [(a["name"], a["state"]) for a in data["adapters"]] == [
        ("poet", "on the host"),
        ("sql", "loaded"),
    ]
    shown = {d["name"]: d["adapters"] for d in dashboard_data()["deployments"]}
    assert shown["base"] == [
        {"name": "poet", "state": "on the host"},
        {"name": "sql", "state": "loaded"},
    ]


@pytest.mark.django_db(transaction=True)
def test_a_load_measures_what_the_engine_holds_in_host_ram_again(gpu24, bob, tmp_path):
    """An engine caches its adapters in host RAM: after a load (and an unload) the base's
    RAM entry in the ledger is what its processes were measured holding then."""
    from capyctl.deployments.services import fetched_sources
    from capyctl.ledger.models import LedgerEntry

    _served(tmp_path, ["sql"])
    base = Deployment.objects.get(name="base")
    before = LedgerEntry.objects.get(deployment=base, pool="ram")
    actions.adapters.load(base.pk, Adapter.objects.get(name="sql").pk, 30)
    after = LedgerEntry.objects.get(deployment=base, pool="ram")
    assert after.note == "after loading adapter sql"
    assert after.bytes > 0
    assert after.updated_at > before.updated_at
    actions.adapters.unload(Adapter.objects.get(name="sql").pk, reason="a test")
    assert LedgerEntry.objects.get(deployment=base, pool="ram").note == "after unloading sql"
    # Its files are kept by a prune of the model cache, as a deployment's are.
    assert str(tmp_path / "sql") in fetched_sources()


@pytest.mark.django_db(transaction=True)
async def test_llama_server_takes_its_adapters_at_launch_and_a_new_one_at_a_restart(
    gpu24, bob, database_threads, tmp_path
):
    """llama-server loads adapters only at launch (``--lora``): each request names its
    adapter by its place there; one added while it runs is refused until the base has
    restarted (503 adapter_not_loaded, Retry-After), then served; slots bound how many."""
    from capyctl.gateway.app import Gateway
    from capyctl.scheduler import intents, restarts

    record = tmp_path / "record.jsonl"

    def gguf(name: str) -> str:
        path = tmp_path / f"{name}.gguf"
        path.write_bytes(b"GGUF" + b"\0" * 64)
        return str(path)

    def setup() -> str:
        env = {**SIM_ENV, "CAPYCTL_SIM_RECORD": str(record)}
        add_engine("sim-llama", kind="llamacpp", command=f"{SIM} llamacpp", env=env)
        base = deployment("base", engine="sim-llama", adapter_slots=3, gib=4)
        add_adapter("sql", "base", gguf("sql"))
        add_adapter("poet", "base", gguf("poet"))
        actions.ensure_ready(base.pk)
        return issue_api_key("bob")[1]

    key = await sync_to_async(setup)()
    assert await sync_to_async(_loaded)() == ["poet", "sql"]
    gateway = Gateway()
    async with _client(gateway, key) as client:

        async def chat(model: str) -> httpx.Response:
            body = {"model": model, "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 1}  # fmt: skip
            return await client.post("/v1/chat/completions", json=body)

        for model in ("poet", "sql"):
            answer = await chat(model)
            assert answer.status_code == 200, answer.text
            assert "x-capyctl-switch" not in answer.headers  # held since its launch
        docs = await sync_to_async(add_adapter)("docs", "base", gguf("docs"))
        # With no server to restart it (this test drives the scheduler itself), it says so.
        said = await sync_to_async(intents.restart_to_take)(docs)
        assert said == "base takes it at its next start (llamacpp takes its adapters at launch)"
        waits = await chat("docs")
        assert waits.status_code == 503, waits.text
        assert waits.json()["error"]["code"] == "adapter_not_loaded"
        assert waits.headers["retry-after"] == "5"
        base = await sync_to_async(Deployment.objects.get)(name="base")
        await sync_to_async(restarts.restart)(base.pk, rolling=False)
        assert (await chat("docs")).status_code == 200
        with pytest.raises(UserError, match=r"^llamacpp takes its adapters at launch, one a slot"):
            await sync_to_async(add_adapter)("more", "base", gguf("more"))
    await gateway.close()
    sent = [json.loads(line) for line in record.read_text().splitlines()]
    asked = [(s["model"], s["lora"]) for s in sent if s["path"] == "/v1/chat/completions"]
    # Launched in the order they were added: sql 0, poet 1, then docs 2 after the restart.
    assert asked == [
        ("base", [{"id": 1, "scale": 1.0}]),
        ("base", [{"id": 0, "scale": 1.0}]),
        ("base", [{"id": 2, "scale": 1.0}]),
    ]


@pytest.mark.django_db
def test_a_llama_server_base_s_estimated_claim_counts_the_adapters_it_launches_with(tmp_path):
    from capyctl.deployments.services import DeploymentSpec, add_deployment
    from capyctl.scheduler import estimates

    add_engine("sim-llama", kind="llamacpp", command=f"{SIM} llamacpp", env=SIM_ENV)
    base = add_deployment(
        DeploymentSpec(name="base", engine="sim-llama", source="base", adapter_slots=1)
    )
    Deployment.objects.filter(pk=base.pk).update(source_bytes=1000 * 1024**2)
    without = estimates.claim_per_gpu(Deployment.objects.get(pk=base.pk), 80 * 1024**3)
    add_adapter("sql", "base", str(tmp_path / "sql.gguf"))
    Adapter.objects.filter(name="sql").update(source_bytes=100 * 1024**2)
    with_one = estimates.claim_per_gpu(Deployment.objects.get(pk=base.pk), 80 * 1024**3)
    assert with_one - without == int(100 * 1024**2 * 1.2)


@pytest.mark.django_db(transaction=True)
async def test_a_load_waits_for_a_slot_while_every_slot_serves_a_request(
    gpu24, bob, database_threads, tmp_path
):
    """Two slots, each serving a stream: a request for a third adapter waits until one of
    them ends (counted as queued, not as CapyCTL's own time), then loads in its place."""
    from capyctl.gateway.app import Gateway

    key = await sync_to_async(_served)(
        tmp_path, ["sql", "poet", "docs"], CAPYCTL_SIM_TOKENS_PER_SECOND="20"
    )
    gateway = Gateway()
    async with _client(gateway, key) as client:

        def body(model: str, tokens: int = 1, **extra: Any) -> dict[str, Any]:
            return {"model": model, "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": tokens, **extra}  # fmt: skip

        async def stream(model: str) -> list[str]:
            async with client.stream(
                "POST", "/v1/chat/completions", json=body(model, tokens=20, stream=True)
            ) as answer:
                return [line async for line in answer.aiter_lines() if line.startswith("data: ")]

        streams = [asyncio.ensure_future(stream(m)) for m in ("sql", "poet")]
        for _ in range(100):  # both loaded and streaming
            if len(await sync_to_async(_loaded)()) == 2:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)
        answer = await client.post("/v1/chat/completions", json=body("docs"))
        assert answer.status_code == 200, answer.text
        assert float(answer.headers["x-capyctl-queued-ms"]) > 0  # its wait, as a wait
        assert "; loaded adapter docs " in answer.headers["x-capyctl-switch"]
        for done in await asyncio.gather(*streams):
            assert done[-1] == "data: [DONE]"  # neither stream was cut
    await gateway.close()
