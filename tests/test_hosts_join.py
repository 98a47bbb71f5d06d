"""Hosts join by token and then speak mutual TLS only: the real agent program, the real
enrolment listener, and every refusal the issue lists."""

import hashlib
import json
import signal
import socket
import ssl
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
from django.utils import timezone

from hostagent import tls
from hostagent.runtime import free_port
from tests.conftest import CAPYCTL, run_program, start_server, stop_server
from tests.waiting import wait_until

pytestmark = pytest.mark.e2e


def start_agent(env, data_dir, port, *join, gpus="2x80GiB"):
    log = (Path(data_dir).parent / f"agent-{port}.log").open("w")
    agent_env = {**env, "CAPYCTL_SIM_GPUS": gpus,
                 "CAPYCTL_SIM_STATE_DIR": str(Path(data_dir).parent / f"sim-{port}")}  # fmt: skip
    for name in ("CAPYCTL_DATA_DIR", "CAPYCTL_DATABASE_URL", "CAPYCTL_REDIS_URL"):
        agent_env.pop(name, None)  # the agent has no database
    process = subprocess.Popen(
        [CAPYCTL, "start", "host", "--listen", f"127.0.0.1:{port}", "--data-dir", str(data_dir),
         *join],
        env=agent_env, stdout=log, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(Path(log.name).read_text())
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return process
        except OSError:
            time.sleep(0.1)
    process.kill()
    raise AssertionError("the agent did not start listening")


def call_agent(port, name, ca, cert=None, key=None):
    context = tls.client_context(ca, cert, key)
    with httpx.Client(verify=context, timeout=5) as client:
        return client.get(
            f"https://127.0.0.1:{port}/inventory", extensions={"sni_hostname": name}
        ).json()


def host_rows(env):
    return {h["name"]: h for h in json.loads(run_program(env, "host", "list", "--json").out)}


@pytest.fixture
def joined(program_env, tmp_path):
    enrol_port, agent_port = free_port(), free_port()
    program_env["CAPYCTL_ENROL_ADDRESS"] = f"127.0.0.1:{enrol_port}"
    added = run_program(program_env, "host", "add", "gpu1", "--address", f"127.0.0.1:{agent_port}")
    assert added.code == 0, added.err
    token = added.out.split("--join ")[1].split()[0]
    server = start_server(program_env, "--enrol-listen", f"127.0.0.1:{enrol_port}")
    agent_dir = tmp_path / "agent1"
    agent = start_agent(program_env, agent_dir, agent_port, "--join", token)
    try:
        yield program_env, token, agent_port, agent_dir, agent, server.base_url
    finally:
        agent.send_signal(signal.SIGTERM)
        agent.wait(timeout=15)
        stop_server(server, signal.SIGTERM)


def test_a_host_joins_once_and_is_polled_over_mutual_tls(joined, tmp_path):
    env, token, agent_port, agent_dir, agent, _ = joined
    assert (agent_dir / "agent.key").stat().st_mode & 0o777 == 0o600
    pki = Path(env["CAPYCTL_DATA_DIR"]) / "pki"
    assert (pki / "ca.key").stat().st_mode & 0o777 == 0o600
    wait_online(env, "gpu1")
    assert host_rows(env)["gpu1"]["gpus"] == ["Simulated GPU 0", "Simulated GPU 1"]
    assert host_rows(env)["gpu1"]["joined"]

    # The same token a second time: refused, and the second agent writes no enrolment.
    again = start_agent_expect_failure(env, tmp_path / "agent2", token)
    assert "join token is not valid" in again
    assert not (tmp_path / "agent2" / "agent.crt").exists()

    # A token that pins another CA: the agent refuses to trust the server.
    parts = tls.JoinToken.decode(token)
    forged = tls.JoinToken(parts.url, "0" * 64, parts.host, parts.secret).encode()
    refused = start_agent_expect_failure(env, tmp_path / "agent3", forged)
    assert "refusing to trust it" in refused

    # A restart needs no token: the agent serves again from its data dir.
    agent.send_signal(signal.SIGTERM)
    assert agent.wait(timeout=15) == 0
    restarted = start_agent(env, agent_dir, agent_port)
    try:
        inventory = call_agent(
            agent_port, "gpu1", pki / "ca.crt", pki / "server.crt", pki / "server.key"
        )
        assert [g["total_bytes"] for g in inventory["gpus"]] == [80 * 1024**3] * 2
    finally:
        restarted.send_signal(signal.SIGTERM)
        restarted.wait(timeout=15)


def wait_online(env, name):
    wait_until(lambda: host_rows(env)[name]["state"] == "online", f"{name} online", interval=0.3)


def test_the_scheduler_drives_a_joined_host_over_mutual_tls(joined):
    env, _, _, agent_dir, agent, base_url = joined
    wait_online(env, "gpu1")
    run = lambda *argv: run_program(env, *argv)  # noqa: E731
    sim = f"{sys.executable} -m hostagent.sim vllm"
    assert run("engine", "add", "sim", "--kind", "vllm", "--command", sim,
               "--env", "CAPYCTL_SIM_WEIGHTS_BYTES=2GiB").code == 0  # fmt: skip
    for name in ("r1", "r2"):
        added = run("deployment", "add", name, "--engine", "sim", "--host", "gpu1",
                    "--source", f"m-{name}", "--gpu-memory", "60GiB", "--gpus", "1",
                    "--weights-size", "2GiB")  # fmt: skip
        assert added.code == 0, added.err

    def states():
        rows = json.loads(run("deployment", "list", "--json").out)
        return {d["name"]: (d["observed_state"], d["parked_mode"] or "") for d in rows}

    started = run("deployment", "start", "r1")
    assert started.code == 0, started.err
    assert states()["r1"] == ("ready", "")
    # /v1 reaches it through the agent's relay, over mutual TLS, streams included.
    key = run("key", "create", "--user", "admin").out.strip()
    v1 = f"{base_url}/v1/chat/completions"
    ask = {"model": "r1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    answer = httpx.post(v1, headers={"Authorization": f"Bearer {key}"}, json=ask, timeout=30)
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["message"]["content"] == "tok0 tok1 tok2"
    streamed = httpx.post(v1, headers={"Authorization": f"Bearer {key}"},
                          json={**ask, "stream": True}, timeout=30)  # fmt: skip
    assert streamed.text.rstrip().endswith("data: [DONE]")
    # The engine runs on the host, under the agent: its log is in the agent's data dir.
    assert list((agent_dir / "logs").glob("*.log"))
    parked = run("deployment", "park", "r1", "--mode", "ram")
    assert parked.code == 0, parked.err
    assert states()["r1"] == ("parked", "ram")
    woke = run("deployment", "wake", "r1")
    assert woke.code == 0, woke.err
    assert states()["r1"] == ("ready", "")
    # r2 fits beside r1 (two 80 GiB GPUs): placed on the other GPU, both ready.
    assert run("deployment", "start", "r2").code == 0
    assert states()["r2"] == ("ready", "")
    ledger = json.loads(run("status", "--json").out)["ledger"]
    pools = {e["pool"] for e in ledger if e["host"] == "gpu1" and e["deployment"] in ("r1", "r2")}
    assert {"gpu0", "gpu1"} <= pools
    for name in ("r1", "r2"):
        stopped = run("deployment", "stop", name)
        assert stopped.code == 0, stopped.err
    assert states()["r1"] == ("stopped", "")
    held = json.loads(run("status", "--json").out)["ledger"]
    assert not [e for e in held if e["host"] == "gpu1" and e["deployment"]]  # foreign may stay

    # The host goes away: requests for its models are answered at once, not left waiting.
    assert run("deployment", "start", "r1").code == 0
    agent.send_signal(signal.SIGTERM)
    agent.wait(timeout=15)
    wait_until(lambda: host_rows(env)["gpu1"]["state"] == "unreachable", "gpu1 unreachable")

    # Until the gateway re-reads the route (in the background), a request still goes to
    # the agent that is gone and fails there; after, it is refused before it is sent.
    def ask_r1() -> httpx.Response | None:
        answer = httpx.post(v1, headers={"Authorization": f"Bearer {key}"}, json=ask, timeout=30)
        if answer.status_code == 502:
            assert answer.json()["error"]["code"] == "engine_failed"
            return None
        return answer

    refused = wait_until(ask_r1, "the gateway to see gpu1 unreachable")
    assert refused.status_code == 503
    assert refused.json()["error"]["code"] == "host_unreachable"


def test_a_killed_agent_leaves_its_engines_running_and_takes_them_back(joined):
    import threading

    import psutil

    env, _, agent_port, agent_dir, agent, base_url = joined
    wait_online(env, "gpu1")
    run = lambda *argv: run_program(env, *argv)  # noqa: E731
    slow = [
        "--env",
        "CAPYCTL_SIM_TOKENS_PER_SECOND=10",
        "--env",
        "CAPYCTL_SIM_COMPLETION_TOKENS=60",
    ]
    assert run("engine", "add", "sim", "--kind", "vllm", "--command",
               f"{sys.executable} -m hostagent.sim vllm", *slow).code == 0  # fmt: skip
    assert run("deployment", "add", "r", "--engine", "sim", "--host", "gpu1", "--source", "m-r",
               "--gpu-memory", "20GiB").code == 0  # fmt: skip
    key = run("key", "create", "--user", "admin").out.strip()
    v1 = f"{base_url}/v1/chat/completions"
    ask = {"model": "r", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    headers = {"Authorization": f"Bearer {key}"}
    assert httpx.post(v1, headers=headers, json=ask, timeout=30).status_code == 200
    (record,) = json.loads((agent_dir / "instances.json").read_text())
    engine = psutil.Process(record["pid"])

    # A stream in flight when the agent dies ends in an error, not in silence.
    seen: list[str] = []

    def stream() -> None:
        body = {**ask, "max_tokens": 60, "stream": True}
        with httpx.stream("POST", v1, headers=headers, json=body, timeout=30) as answer:
            for line in answer.iter_lines():
                seen.append(line)

    reader = threading.Thread(target=stream)
    reader.start()
    # The agent dies once the stream is under way (its first token is here; the other 59
    # would take 6 s more at 10 tokens a second).
    wait_until(lambda: any(line.startswith("data: ") for line in seen), "the first token")
    agent.kill()
    agent.wait(timeout=10)
    reader.join(timeout=30)
    assert seen
    assert "data: [DONE]" not in seen
    assert '"engine_failed"' in [line for line in seen if line][-1]
    assert engine.is_running()  # the engine lives on without its agent

    def statuses():
        ledger = json.loads(run("status", "--json").out)["ledger"]
        return {e["status"] for e in ledger if e["deployment"] == "r"}

    wait_until(lambda: host_rows(env)["gpu1"]["state"] == "unreachable", "gpu1 unreachable")
    assert statuses() == {"unconfirmed"}  # still counted, as nobody can confirm it now

    restarted = start_agent(env, agent_dir, agent_port)  # no token needed
    try:
        wait_online(env, "gpu1")
        assert statuses() == {"held"}  # it reports again
        again = httpx.post(v1, headers=headers, json=ask, timeout=30)
        assert again.status_code == 200, again.text
        events = run("events", "--model", "r", "--limit", "50").out
        assert events.count("deployment.starting") == 1  # taken back, not started again
        assert run("deployment", "stop", "r").code == 0
        engine.wait(timeout=15)  # stopping reaches the re-adopted engine
    finally:
        restarted.send_signal(signal.SIGTERM)
        restarted.wait(timeout=15)


def test_an_engine_gone_with_its_host_is_failed_and_started_again(joined):
    import psutil

    env, _, agent_port, agent_dir, agent, base_url = joined
    wait_online(env, "gpu1")
    run = lambda *argv: run_program(env, *argv)  # noqa: E731
    assert run("engine", "add", "sim", "--kind", "vllm", "--command",
               f"{sys.executable} -m hostagent.sim vllm").code == 0  # fmt: skip
    assert run("deployment", "add", "r", "--engine", "sim", "--host", "gpu1", "--source", "m-r",
               "--gpu-memory", "20GiB").code == 0  # fmt: skip
    assert run("deployment", "start", "r").code == 0
    (record,) = json.loads((agent_dir / "instances.json").read_text())
    agent.kill()  # the machine goes down: agent and engine both
    agent.wait(timeout=10)
    psutil.Process(record["pid"]).kill()
    restarted = start_agent(env, agent_dir, agent_port)
    try:

        def failed() -> bool:
            (row,) = json.loads(run("deployment", "list", "--json").out)
            return bool(row["observed_state"] == "failed")

        wait_until(failed, "r to be failed")
        assert "gone from host gpu1" in run("events", "--model", "r").out
        held = json.loads(run("status", "--json").out)["ledger"]
        assert not [e for e in held if e["deployment"] == "r"]  # its memory is given back
        key = run("key", "create", "--user", "admin").out.strip()
        again = httpx.post(
            f"{base_url}/v1/chat/completions",
            headers={"Authorization": f"Bearer {key}"},
            json={"model": "r", "messages": [{"role": "user", "content": "hi"}]},
            timeout=60,
        )
        assert again.status_code == 200, again.text  # started again on its next request
    finally:
        restarted.send_signal(signal.SIGTERM)
        restarted.wait(timeout=15)


def start_agent_expect_failure(env, data_dir, token):
    agent_env = {**env}
    agent_env.pop("CAPYCTL_DATA_DIR")
    done = subprocess.run(
        [CAPYCTL, "start", "host", "--listen", f"127.0.0.1:{free_port()}", "--data-dir",
         str(data_dir), "--join", token],
        env=agent_env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    return done.stderr


def test_the_agent_refuses_every_caller_but_the_server(joined, tmp_path):
    env, _, agent_port, agent_dir, _, _ = joined
    pki = Path(env["CAPYCTL_DATA_DIR"]) / "pki"
    ca, server_cert, server_key = pki / "ca.crt", pki / "server.crt", pki / "server.key"
    assert call_agent(agent_port, "gpu1", ca, server_cert, server_key)["gpus"]

    refused = (ssl.SSLError, httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError)
    with pytest.raises(refused):  # no client certificate
        call_agent(agent_port, "gpu1", ca)
    with pytest.raises(refused):  # a host's own certificate is not a client certificate
        call_agent(agent_port, "gpu1", ca, agent_dir / "agent.crt", agent_dir / "agent.key")

    from capyctl.hosts import pki as server_pki

    other = server_pki.pki(tmp_path / "other-ca")  # a whole other CA, with its own "server"
    with pytest.raises(refused):
        call_agent(agent_port, "gpu1", ca, other.server_cert, other.server_key)

    ours = server_pki.Pki(pki)
    key = tls.make_key()
    expired = server_pki.sign(ours, key.public_key(), tls.SERVER_NAME, client=True, days=-1)
    (tmp_path / "expired.crt").write_bytes(expired)
    tls.write_private(tmp_path / "expired.key", tls.key_pem(key))
    with pytest.raises(refused):
        call_agent(agent_port, "gpu1", ca, tmp_path / "expired.crt", tmp_path / "expired.key")

    # The server's side: an agent whose certificate names another host is not trusted.
    with pytest.raises(refused):
        call_agent(agent_port, "gpu2", ca, server_cert, server_key)


def test_a_peer_that_keeps_an_idle_connection_open_does_not_hold_up_the_agents_stop(joined):
    """A client that neither uses nor closes its keep-alive connection (a server whose
    worker is stuck) never answers TLS's close; the agent stops anyway, soon enough for
    Ctrl-C followed by a kill a few seconds later to find its engines stopped."""
    env, _, agent_port, _, agent, _ = joined
    pki = Path(env["CAPYCTL_DATA_DIR"]) / "pki"
    context = tls.client_context(pki / "ca.crt", pki / "server.crt", pki / "server.key")
    with (
        socket.create_connection(("127.0.0.1", agent_port)) as raw,
        context.wrap_socket(raw, server_hostname="gpu1") as connection,
    ):
        connection.sendall(b"GET /inventory HTTP/1.1\r\nHost: gpu1\r\n\r\n")
        assert connection.recv(65536).startswith(b"HTTP/1.1 200")
        agent.send_signal(signal.SIGINT)
        # uvicorn would wait for the connection's TLS close for 30 s
        assert agent.wait(timeout=20) in (0, 130)


@pytest.mark.django_db
def test_join_tokens_are_single_use_expire_and_survive_a_bad_request(settings, tmp_path):
    from capyctl.hosts.models import Host
    from capyctl.hosts.services import EnrolError, add_host, enrol, new_join_token

    settings.DATA_DIR = tmp_path
    host, token = add_host("gpu9", "10.0.0.9:7443")
    secret = tls.JoinToken.decode(token).secret
    csr = tls.make_csr(tls.make_key(), "something-else")
    with pytest.raises(EnrolError, match="not valid PEM"):
        enrol("gpu9", secret, b"not a request")
    cert, ca = enrol("gpu9", secret, csr)  # the bad request did not spend the token
    assert tls.fingerprint(ca) == tls.JoinToken.decode(token).fingerprint
    from cryptography import x509

    signed = x509.load_pem_x509_certificate(cert)
    names = signed.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.DNSName) == ["gpu9"]  # the registered name wins
    answers = []
    with pytest.raises(EnrolError) as used:
        enrol("gpu9", secret, csr)
    answers.append(str(used.value))

    fresh = tls.JoinToken.decode(new_join_token(host)).secret
    Host.objects.filter(pk=host.pk).update(join_expires_at=timezone.now() - timedelta(seconds=1))
    with pytest.raises(EnrolError) as expired:
        enrol("gpu9", fresh, csr)
    answers.append(str(expired.value))
    newer = tls.JoinToken.decode(new_join_token(host)).secret
    with pytest.raises(EnrolError) as replaced:
        enrol("gpu9", fresh, csr)
    answers.append(str(replaced.value))
    with pytest.raises(EnrolError) as unknown:
        enrol("gpu8", newer, csr)
    answers.append(str(unknown.value))
    # One answer for every reason: a caller cannot tell which host names exist.
    assert len(set(answers)) == 1
    assert "join token is not valid" in answers[0]
    assert "gpu8" not in answers[0]
    assert enrol("gpu9", newer, csr)


def test_host_commands_refuse_mistakes_in_one_line(program_env):
    assert "local  (in-process)  online" in run_program(program_env, "host", "list").out
    for argv, message in (
        (("host", "add", "Bad_Name", "--address", "10.0.0.1:7070"), "invalid host name"),
        (("host", "add", "gpu1", "--address", "10.0.0.1"), "invalid address"),
        (("host", "add", "local", "--address", "10.0.0.1:1"), "in-process host"),
        (("host", "remove", "ghost"), "no host named"),
        (("host", "token", "ghost"), "no host named"),
    ):
        result = run_program(program_env, *argv)
        assert result.code == 2, (argv, result.err)
        assert message in result.err
        assert len(result.err.strip().splitlines()) == 1
    assert run_program(program_env, "host", "add", "gpu1", "--address", "10.0.0.1:7070").code == 0
    duplicate = run_program(program_env, "host", "add", "gpu1", "--address", "10.0.0.2:7070")
    assert duplicate.code == 2
    assert "already exists" in duplicate.err
    assert run_program(program_env, "host", "remove", "gpu1").code == 0
    assert "gpu1" not in host_rows(program_env)
    bad_token = run_program(program_env, "start", "host", "--join", "capyjoin_%%%", "--data-dir",
                            str(Path(program_env["CAPYCTL_DATA_DIR"]) / "agent"))  # fmt: skip
    assert bad_token.code == 2
    assert "damaged" in bad_token.err


def test_a_remote_host_downloads_its_models_weights_itself(joined):
    """An http(s) source is fetched by the agent into its own cache, then started there;
    `capyctl cache` lists and prunes it through the agent."""
    from tests.fakes import FileServer

    env, _, _, agent_dir, _, _ = joined
    wait_online(env, "gpu1")
    weights = b"w" * 3_000_000
    files = FileServer({"/tiny.gguf": weights})
    try:
        run = lambda *argv: run_program(env, *argv)  # noqa: E731
        url = f"{files.url}/tiny.gguf"
        digest = hashlib.sha256(weights).hexdigest()
        assert run("engine", "add", "sim", "--kind", "vllm", "--command",
                   f"{sys.executable} -m hostagent.sim vllm").code == 0  # fmt: skip
        assert run("deployment", "add", "d", "--engine", "sim", "--host", "gpu1", "--source",
                   f"{url}#sha256={digest}", "--gpu-memory", "8GiB").code == 0  # fmt: skip
        started = run("deployment", "start", "d")
        assert started.code == 0, started.err
        cached = list((agent_dir / "models" / "http").rglob("tiny.gguf"))
        assert [p.read_bytes() == weights for p in cached] == [True]
        listed = run("cache", "list", "--host", "gpu1", "--json")
        assert [(r["host"], r["source"]) for r in json.loads(listed.out)] == [("gpu1", url)]
        row = json.loads(run("deployment", "list", "--json").out)[0]
        assert (row["observed_state"], row["source_bytes"]) == ("ready", len(weights))
        assert run("deployment", "stop", "d").code == 0
        assert run("deployment", "remove", "d").code == 0
        assert cached[0].exists()  # removing a deployment keeps its files
        pruned = run("cache", "prune", "--host", "gpu1")
        assert pruned.out.splitlines()[-1] == "removed 1 download(s), 2.9 MiB"
        assert not cached[0].exists()
    finally:
        files.close()
