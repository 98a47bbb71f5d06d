"""/v1 reaches only the documented OpenAI routes: a key holder cannot walk out of /v1 to
an engine's admin routes (vLLM's /sleep and /collective_rpc, SGLang's
/release_memory_occupation, llama.cpp's /props ...), on this host or on a joined one, and
the host agent's relay refuses them even from the server's own certificate.

One server and one joined host serve a model of every engine kind each; the simulated
engines record every request they receive (``CAPYCTL_SIM_RECORD``)."""

from __future__ import annotations

import http.client
import json
import signal
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from hostagent import tls
from hostagent.routes import FORWARDED
from hostagent.runtime import free_port
from tests.conftest import program_environment, run_program, start_server, stop_server
from tests.test_hosts_join import start_agent, wait_online

pytestmark = pytest.mark.e2e

SIM = f"{sys.executable} -m hostagent.sim"
# Each kind, the simulated engine that plays it, and an admin route of that engine.
CUSTOM = (
    f"{SIM} vllm serve {{source}} --served-model-name {{model}} --host {{host}} "
    "--port {port} --enable-sleep-mode --gpu-memory-utilization 0.07"
)  # the launch key reaches it in VLLM_API_KEY: the option api_key_env below; 0.07 of the
# 80 GiB device keeps it within its 6 GiB claim (a custom kind caps nothing itself)
KINDS = {
    "vllm": (f"{SIM} vllm", "sleep?level=1"),
    "sglang": (f"{SIM} sglang", "release_memory_occupation"),
    "llamacpp": (f"{SIM} llamacpp", "props"),
    "tensorfold": (f"{SIM} tensorfold", "sleep?level=2"),
    "custom": (CUSTOM, "collective_rpc"),
}
# Ways out of /v1 ({} is the admin route); every one is refused with 400 before the key.
ESCAPES = [
    "/v1/../{}",
    "/v1/%2e%2e/{}",
    "/v1/%2E%2E/{}",
    "/v1/..%2f{}",
    "/v1/..%2F..%2F{}",
    "/v1/%252e%252e/{}",
    "/v1/.%2e/{}",
    "/v1/..%5c{}",
    "/v1//{}",
    "/v1/chat/completions/../../{}",
    "/v1/./chat/../../{}",
]


@dataclass
class Fleet:
    base_url: str
    key: str
    env: dict[str, str]
    records: dict[str, Path]  # model name -> its engine's record
    admin: dict[str, str]  # model name -> an admin route of its engine
    agent_port: int
    pki: Path

    def received(self, model: str) -> list[dict[str, object]]:
        lines = self.records[model].read_text().splitlines()
        return [json.loads(line) for line in lines]


def send_raw(base_url: str, method: str, target: str, body: dict[str, object], key: str):
    """One request with ``target`` sent exactly as written (httpx would normalise it)."""
    host, port = base_url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        data = json.dumps(body).encode()
        headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
        connection.request(method, target, body=data, headers=headers)
        answer = connection.getresponse()
        return answer.status, parse(answer.read())
    finally:
        connection.close()


def parse(data: bytes) -> dict[str, Any]:
    """An answer's JSON, or what it was instead (an engine's plain-text 404)."""
    try:
        parsed = json.loads(data)
    except ValueError:
        return {"text": data.decode("latin-1")}
    return parsed if isinstance(parsed, dict) else {"json": parsed}


def chat(fleet: Fleet, model: str) -> httpx.Response:
    return httpx.post(
        f"{fleet.base_url}/v1/chat/completions",
        headers={"Authorization": f"Bearer {fleet.key}"},
        json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        timeout=120,
    )


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    tmp = tmp_path_factory.mktemp("fleet")
    with program_environment(tmp / "data") as env:
        env.update(CAPYCTL_SIM_GPUS="80GiB", CAPYCTL_MIN_READY_SECONDS="0")
        run = lambda *argv: run_program(env, *argv)  # noqa: E731
        enrol_port, agent_port = free_port(), free_port()
        env["CAPYCTL_ENROL_ADDRESS"] = f"127.0.0.1:{enrol_port}"
        added = run("host", "add", "gpu1", "--address", f"127.0.0.1:{agent_port}")
        assert added.code == 0, added.err
        token = added.out.split("--join ")[1].split()[0]
        records: dict[str, Path] = {}
        admin: dict[str, str] = {}
        for kind, (command, route) in KINDS.items():
            for where in ("local", "gpu1"):
                name = f"{kind}-{where}"
                records[name] = tmp / f"{name}.jsonl"
                records[name].touch()
                hooks = {"park": {"ram": {"path": "/sleep?level=1"}},
                         "wake": {"ram": {"path": "/wake_up"}},
                         "api_key_env": "VLLM_API_KEY"}  # fmt: skip
                # vLLM serves /sleep and /wake_up only in its development mode.
                extra = ["--options", json.dumps(hooks), "--env", "VLLM_SERVER_DEV_MODE=1"]
                done = run("engine", "add", name, "--kind", kind, "--command", command,
                           "--env", f"CAPYCTL_SIM_RECORD={records[name]}",
                           "--env", "CAPYCTL_SIM_WEIGHTS_BYTES=1GiB",
                           *(extra if kind == "custom" else []))  # fmt: skip
                assert done.code == 0, done.err
                done = run("deployment", "add", name, "--engine", name, "--host", where,
                           "--source", f"m-{name}", "--gpu-memory", "6GiB",
                           "--weights-size", "1GiB")  # fmt: skip
                assert done.code == 0, done.err
                admin[name] = route
        env["CAPYCTL_SIM_GPUS"] = "80GiB"
        fleet_key = run("key", "create", "--user", "admin").out.strip()
        server = start_server(env, "--enrol-listen", f"127.0.0.1:{enrol_port}")
        agent = start_agent(env, tmp / "agent", agent_port, "--join", token, gpus="80GiB")
        try:
            wait_online(env, "gpu1")
            fleet = Fleet(server.base_url, fleet_key, env, records, admin, agent_port,
                          Path(env["CAPYCTL_DATA_DIR"]) / "pki")  # fmt: skip
            with ThreadPoolExecutor(4) as pool:  # each model starts on its first request
                answers = list(pool.map(lambda name: chat(fleet, name), records))
            for answer in answers:
                assert answer.status_code == 200, answer.text
            yield fleet
        finally:
            agent.send_signal(signal.SIGTERM)
            agent.wait(timeout=30)
            stop_server(server, signal.SIGTERM)


def engine_hits(fleet: Fleet, model: str, since: int) -> list[dict[str, object]]:
    """What the model's engine received after its ``since``-th request, CapyCTL's own
    engine control aside: health probes, and reconcile's ``GET /is_sleeping`` (whether it
    was parked behind CapyCTL's back), which may come at any moment."""
    return [
        r
        for r in fleet.received(model)[since:]
        if r["path"] != "/health" and (r["method"], r["path"]) != ("GET", "/is_sleeping")
    ]


@pytest.mark.parametrize("escape", ESCAPES, ids=range(len(ESCAPES)))
def test_no_path_leaves_v1_for_any_engine_kind_local_or_remote(fleet, escape):
    for model, route in fleet.admin.items():
        before = len(fleet.received(model))
        status, body = send_raw(fleet.base_url, "POST", escape.format(route), {"model": model},
                                fleet.key)  # fmt: skip
        assert status == 400, (model, escape, body, engine_hits(fleet, model, before))
        assert body["error"]["type"] == "invalid_request_error"
        assert body["error"]["code"] == "invalid_path"
        # Refused before the key is looked up: no key, the same answer.
        assert send_raw(fleet.base_url, "POST", escape.format(route), {"model": model},
                        "capy_nope_nope")[0] == 400  # fmt: skip
        assert engine_hits(fleet, model, before) == [], (model, escape)


def test_unknown_routes_are_404_and_never_reach_an_engine(fleet):
    for model, route in fleet.admin.items():
        before = len(fleet.received(model))
        for target in (f"/v1/{route}", "/v1/is_sleeping", "/v1/models/../../sleep"):
            status, body = send_raw(fleet.base_url, "POST", target, {"model": model}, fleet.key)
            assert status in (400, 404), (target, body)
            assert body["error"]["code"] in ("unknown_route", "invalid_path"), body
        assert engine_hits(fleet, model, before) == []


def test_after_every_attack_each_model_is_ready_awake_and_was_never_hit_on_an_admin_route(
    fleet,
):
    for escape in ESCAPES:  # (also when this test runs alone)
        for model, route in fleet.admin.items():
            send_raw(fleet.base_url, "POST", escape.format(route), {"model": model}, fleet.key)
    rows = json.loads(run_program(fleet.env, "deployment", "list", "--json").out)
    assert {d["name"]: d["observed_state"] for d in rows} == dict.fromkeys(fleet.admin, "ready")
    for model in fleet.admin:
        answer = chat(fleet, model)  # a sleeping engine answers 503
        assert answer.status_code == 200, answer.text
        asked = {(r["method"], str(r["path"]).split("?")[0]) for r in fleet.received(model)}
        # What engine control (health, warm-up, reconcile's GET /is_sleeping: whether it
        # was parked behind CapyCTL's back) and the requests above sent, nothing else.
        paths = {path for method, path in asked if (method, path) != ("GET", "/is_sleeping")}
        assert paths <= {"/health", *FORWARDED}, (model, asked)


def relay(fleet: Fleet, target: str) -> tuple[int, dict[str, Any]]:
    """Call the joined host's relay as the server would, with the server's own client
    certificate: what a compromised server could do."""
    context = tls.client_context(
        fleet.pki / "ca.crt", fleet.pki / "server.crt", fleet.pki / "server.key"
    )
    context.check_hostname = False  # the attacker does not care who answers
    connection = http.client.HTTPSConnection(
        "127.0.0.1", fleet.agent_port, context=context, timeout=30
    )
    try:
        connection.request("GET", "/instances")
        ids = json.loads(connection.getresponse().read())["ids"]
        statuses = []
        for ident in ids:
            body = json.dumps({"model": "x"}).encode()
            connection.request("POST", target.format(ident=ident), body=body,
                               headers={"Content-Type": "application/json"})  # fmt: skip
            answer = connection.getresponse()
            statuses.append((answer.status, parse(answer.read())))
        assert len(ids) == len(KINDS)
        assert len({s for s, _ in statuses}) == 1, statuses
        return statuses[0]
    finally:
        connection.close()


@pytest.mark.parametrize(
    "target",
    [
        "/relay/{ident}/v1/../sleep?level=1",
        "/relay/{ident}/v1/%2e%2e/collective_rpc",
        "/relay/{ident}/v1/%2E%2E/release_memory_occupation",
        "/relay/{ident}/v1/..%2fsleep",
        "/relay/{ident}/v1/%252e%252e/sleep",
        "/relay/{ident}/v1//sleep",
        "/relay/{ident}/v1/sleep",
        "/relay/{ident}/v1/models",
        "/relay/{ident}%2f..%2f/sleep",
        "/relay/{ident}/../sleep",
    ],
    ids=range(10),
)
def test_the_relay_refuses_what_is_not_an_openai_route_even_from_the_server(fleet, target):
    remote = [m for m in fleet.admin if m.endswith("-gpu1")]
    before = {m: len(fleet.received(m)) for m in remote}
    status, body = relay(fleet, target)
    assert status in (400, 404), body
    error = body.get("error")
    assert isinstance(error, dict), body
    assert error["code"] in ("invalid_path", "unknown_route", "unknown_instance"), error
    for model in remote:
        assert engine_hits(fleet, model, before[model]) == [], model
