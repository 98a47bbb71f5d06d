"""Turns: a busy model keeps its GPU for its turn while others wait, then the contender
that waited longest goes next (simulated 24 GiB GPU, simulated engines, in process)."""

import json
import re
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis
from django.db import connection
from prometheus_client import generate_latest

from capyctl.events.models import Event
from capyctl.hosts.models import Host
from capyctl.scheduler import actions, requests_in_progress, turns
from capyctl.web import metrics
from tests.scheduling import deployment, state, vllm_engine
from tests.waiting import wait_until


def in_background(deployment_id: int, outcome: list[object]) -> threading.Thread:
    def run() -> None:
        try:
            outcome.append(actions.ensure_ready(deployment_id).observed_state)
        except Exception as exc:  # asserted by the caller
            outcome.append(exc)
        finally:
            connection.close()

    thread = threading.Thread(target=run)
    thread.start()
    return thread


@pytest.mark.django_db(transaction=True)
def test_a_busy_model_keeps_the_gpu_for_its_turn_then_gives_way(gpu24, settings):
    """a and b do not fit together; a has a request in flight when b is asked for. On the
    old code a was drained at once (a switch per change of model); now b waits for a's 2 s
    turn, is told so, and then a is drained and parked, and b started."""
    settings.CAPYCTL = {**settings.CAPYCTL, "MAX_TURN_SECONDS": 2}
    vllm_engine()
    a, b = deployment("a"), deployment("b")
    actions.ensure_ready(a.pk)
    assert requests_in_progress.begin(a.pk)  # a is busy
    outcome: list[object] = []
    thread = in_background(b.pk, outcome)
    try:
        waiting = wait_until(
            lambda: Event.objects.filter(kind="deployment.waiting", subject="b").first(),
            "b to wait",
        )
        assert state("a") == ("ready", "")  # its turn
        wait_until(lambda: state("a")[0] == "draining", "a's turn to end")
    finally:
        requests_in_progress.end(a.pk)  # its request ends: the drain with it
        thread.join(timeout=60)
    assert outcome == ["ready"]
    assert state("a") == ("parked", "ram")
    assert waiting.message == (
        "b needs 16.0 GiB per GPU and waits for room; in the way: a (busy, its turn: 2 s left)"
    )
    parked = Event.objects.get(kind="deployment.parked", subject="a")
    assert parked.message == "parked a (ram) to make room for b, its turn over"
    # a kept the GPU for its turn (less what the wait's first try took to be written).
    assert (parked.created_at - waiting.created_at).total_seconds() >= 1.5


@pytest.mark.django_db(transaction=True)
def test_an_idle_model_gives_way_at_once(gpu24, settings):
    settings.CAPYCTL = {**settings.CAPYCTL, "MAX_TURN_SECONDS": 60}
    vllm_engine()
    a, b = deployment("a"), deployment("b")
    actions.ensure_ready(a.pk)
    assert requests_in_progress.begin(a.pk)
    requests_in_progress.end(a.pk)
    time.sleep(0.3)  # its last request ended longer ago than the busy grace (0.1 s)
    started = time.monotonic()
    assert actions.ensure_ready(b.pk).observed_state == "ready"
    assert time.monotonic() - started < 30  # not its 60 s turn
    assert not Event.objects.filter(kind="deployment.waiting").exists()


@pytest.mark.django_db(transaction=True)
def test_the_contender_that_waited_longer_goes_first_and_a_gone_one_stops_counting(gpu24, settings):
    """c waits for the GPU (noted 50 s ago by a worker that then died): b, asked now,
    waits its turn behind c although the GPU's holder is idle; once c's wait is no longer
    renewed (3 s), it counts no more and b is started."""
    vllm_engine()
    a, b, c = deployment("a"), deployment("b"), deployment("c")
    actions.ensure_ready(a.pk)
    host = Host.objects.get(name="local")
    now = time.time()
    turns.note(turns.Wait(c.pk, "c", host.pk, now - 50, now, 0, ("gpu0",)))
    scraped = generate_latest(metrics.REGISTRY).decode()
    assert re.search(r'^capyctl_waiting_for_room_seconds\{host="local",model="c"\} 50\.', scraped,
                     re.M), scraped  # fmt: skip
    assert 'capyctl_turn_holder{host="local",model="a"} 1.0' in scraped  # a holds gpu0
    try:
        started = time.monotonic()
        assert actions.ensure_ready(b.pk).observed_state == "ready"
        waited = time.monotonic() - started
    finally:
        turns.done(c.pk)
    waiting = Event.objects.get(kind="deployment.waiting", subject="b")
    assert waiting.message == "b waits for its turn: c has waited longer (50 s) for the same GPUs"
    assert waited >= turns.SEEN_SECONDS - 0.5
    assert state("a") == ("parked", "ram")


@pytest.mark.django_db(transaction=True)
def test_a_wake_leaves_the_room_freed_for_a_longer_waiting_model_to_it(gpu24):
    """a is parked and the GPU free, the room b (noted as waiting 5 s for gpu0, 16 GiB)
    had it freed for. a, asked now, fits, but would leave b without room: it waits its
    turn behind b instead of waking into the room (on the old code it woke at once, and
    b's wait went on behind a: a park for nothing, then another). Once b's wait is no
    longer renewed (3 s), it counts no more and a wakes."""
    vllm_engine()
    a, b = deployment("a"), deployment("b")
    actions.ensure_ready(a.pk)
    actions.park(a.pk, "ram")
    host = Host.objects.get(name="local")
    now = time.time()
    turns.note(turns.Wait(b.pk, "b", host.pk, now - 5, now, 0, ("gpu0",), 16 * 1024**3))
    try:
        started = time.monotonic()
        assert actions.ensure_ready(a.pk).observed_state == "ready"
        waited = time.monotonic() - started
    finally:
        turns.done(b.pk)
    waiting = Event.objects.get(kind="deployment.waiting", subject="a")
    assert waiting.message == "a waits for its turn: b has waited longer (5 s) for the same GPUs"
    assert waited >= turns.SEEN_SECONDS - 0.5
    assert state("b") == ("stopped", "")


@pytest.mark.django_db(transaction=True)
def test_the_timeline_shows_who_held_the_gpu_when_and_why_it_switched(gpu24):
    """a started, then b made room by parking a: gpu0's lane holds a's start, its hold
    until the park, the park, then b's start and b's hold (still open), with the park
    marked and its cause; the queue depths the gateway noted lie beneath."""
    from capyctl.web.timeline import timeline_data

    vllm_engine()
    a, b = deployment("a"), deployment("b")
    actions.ensure_ready(a.pk)
    metrics.NOW.note_waiting("b", 3)
    actions.ensure_ready(b.pk)
    metrics.NOW.note_waiting("b", 0)
    (host,) = timeline_data()["hosts"]
    assert host["host"] == "local"
    (lane,) = host["pools"]
    assert lane["pool"] == "gpu0"
    steps = [(s["model"], s["kind"], s["to"] is None) for s in lane["spans"]]
    assert steps == [("a", "start", False), ("a", "held", False), ("a", "park", False),
                     ("b", "start", False), ("b", "held", True)]  # fmt: skip
    spans = lane["spans"]
    assert spans[0]["from"] <= spans[0]["to"] <= spans[1]["from"] + 0.01
    assert spans[1]["to"] <= spans[2]["to"] <= spans[3]["to"] <= spans[4]["from"] + 0.01
    (mark,) = lane["marks"]
    assert (mark["model"], mark["text"]) == ("a", "parked a (ram) to make room for b")
    assert [depth for _, depth in host["queue"]][-2:] == [3, 0]


def test_status_shows_who_waits_for_room_and_who_holds_the_gpu(program_env):
    """A stream holds chat (turns of 60 s) when code is asked for: `capyctl status` (its
    own process) says code waits for room while chat holds its GPU, and, once code is
    answered after the turn was cut short by the stream's end, that nothing waits."""
    import httpx

    from tests.conftest import run_program, run_programs, start_server, stop_server

    program_env["CAPYCTL_SIM_GPUS"] = "24GiB"
    program_env["CAPYCTL_MIN_READY_SECONDS"] = "0"
    sim = f"{sys.executable} -m hostagent.sim vllm"
    setup = [
        ["engine", "add", "paced", "--kind", "vllm", "--command", sim, "--env",
         "CAPYCTL_SIM_TOKENS_PER_SECOND=2", "--env", "CAPYCTL_SIM_COMPLETION_TOKENS=10"],
        ["deployment", "add", "chat", "--engine", "paced", "--source", "chat", "--gpu-memory",
         "16GiB", "--max-turn-seconds", "60"],
        ["deployment", "add", "code", "--engine", "paced", "--source", "code", "--gpu-memory",
         "16GiB"],
        ["key", "create", "--user", "admin"],
    ]  # fmt: skip
    results = run_programs(program_env, *setup)
    assert all(r.code == 0 for r in results), [r.err for r in results]
    key = results[-1].out.strip()
    server = start_server(program_env)
    url = f"{server.base_url}/v1/chat/completions"
    auth = {"Authorization": f"Bearer {key}"}

    def ask(model: str, stream: bool = False) -> httpx.Response:
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 10, "stream": stream}  # fmt: skip
        return httpx.post(url, json=body, headers=auth, timeout=120)

    try:
        assert ask("chat").status_code == 200  # started; then a 5 s stream holds it
        with ThreadPoolExecutor(2) as pool:
            streaming = pool.submit(ask, "chat", True)
            time.sleep(1)
            waiting = pool.submit(ask, "code")

            def said() -> str | None:
                out = run_program(program_env, "status").out
                return out if "code: 1 request(s); for room" in out else None

            shown = wait_until(said, "status to show code waiting")
            assert re.search(r"^  code: 1 request\(s\); for room \d+ s, while chat hold\(s\) "
                             r"its GPUs \(a turn\)$", shown, re.M), shown  # fmt: skip
            (queue,) = json.loads(run_program(program_env, "status", "--json").out)["queues"]
            assert (queue["model"], queue["waiting"], queue["holders"]) == ("code", 1, ["chat"])
            assert streaming.result().status_code == 200
            assert waiting.result().status_code == 200
        wait_until(lambda: "waiting:" not in run_program(program_env, "status").out,
                   "the queue to be shown empty")  # fmt: skip
    finally:
        stop_server(server, signal.SIGTERM)


def test_server_mode_shares_waits_between_processes_through_redis(redis_url):
    """Two workers (two registries on one Redis): a wait one notes is the other's
    contender, with the same start; forgotten when done; one not renewed for 3 s (its
    worker died) counts no more; with Redis away each goes on with its own waits, without
    waiting on Redis under the host lock."""
    first, second = turns.RedisRegistry(redis_url), turns.RedisRegistry(redis_url)
    now = time.time()
    assert first.note(turns.Wait(7, "b", 1, now - 20, now, 1, ("gpu0",))) == now - 20
    (seen,) = second.contenders(1)
    assert (seen.name, seen.priority, seen.pools) == ("b", 1, ("gpu0",))
    assert 19.5 < seen.waited_seconds < 30
    assert second.contenders(2) == []
    # The same model's wait noted again by another worker keeps its first start.
    assert second.note(turns.Wait(7, "b", 1, time.time(), time.time())) == now - 20
    assert second.waited(7) >= 20
    first.done(7)
    assert [c.name for c in turns.RedisRegistry(redis_url).contenders(1)] == []
    old = time.time() - turns.SEEN_SECONDS - 1  # as a worker that died left it
    left = {"name": "c", "since": old - 60, "seen": old, "priority": 0, "pools": []}
    redis.Redis.from_url(redis_url).hset("capyctl:turns:1", "8", json.dumps(left))
    assert turns.RedisRegistry(redis_url).contenders(1) == []
    away = turns.RedisRegistry("redis://127.0.0.1:9/0")  # nothing listens there
    started = time.monotonic()
    away.note(turns.Wait(9, "d", 1, time.time(), time.time()))
    assert [c.name for c in away.contenders(1)] == ["d"]
    away.done(9)
    assert away.contenders(1) == []
    assert time.monotonic() - started < 2.0  # one short try, then quiet


@pytest.mark.django_db(transaction=True)
def test_busy_in_server_mode_is_read_from_the_shared_counts_and_the_last_request(gpu24, redis_url):
    """In server mode a worker sees requests in flight through Redis (another process
    counts them) and, when none is, the last request's end to a second or so."""
    from datetime import timedelta

    from django.utils import timezone

    from capyctl.deployments.models import Deployment
    from capyctl.scheduler import snapshots

    vllm_engine()
    a = deployment("a")
    api = requests_in_progress.RedisInFlight(redis_url)  # the API process that counts
    worker = requests_in_progress.RedisInFlight(redis_url)
    before = requests_in_progress._tracker
    requests_in_progress._tracker = worker
    try:
        api.check_in()
        worker.check_in()
        # A Redis with no counts yet is not trusted for its first seconds (busy, unknown).
        wait_until(lambda: worker.count(a.pk) == 0 if _trusted(worker, a.pk) else None,
                   "the shared counts to be trusted", timeout=15)  # fmt: skip
        row = Deployment.objects.get(pk=a.pk)
        assert api.begin(a.pk)
        assert worker.count(a.pk) == 1
        assert snapshots.busy(row, time.time())
        api.end(a.pk)
        assert not snapshots.busy(row, time.time())  # never a request's end on record
        Deployment.objects.filter(pk=a.pk).update(last_request_at=timezone.now())
        assert snapshots.busy(Deployment.objects.get(pk=a.pk), time.time())
        long_ago = timezone.now() - timedelta(seconds=5)
        Deployment.objects.filter(pk=a.pk).update(last_request_at=long_ago)
        assert not snapshots.busy(Deployment.objects.get(pk=a.pk), time.time())
    finally:
        requests_in_progress._tracker = before
        api.stop()
        worker.stop()


def _trusted(tracker: requests_in_progress.RedisInFlight, deployment_id: int) -> bool:
    try:
        tracker.count(deployment_id)
    except requests_in_progress.CountsUnknown:
        return False
    return True


def test_a_queue_view_left_by_a_gone_process_or_garbled_counts_for_nothing(tmp_path, settings):
    """``capyctl status`` reads queues.json from the data dir: a view its process stopped
    renewing (it died while requests waited) is not shown, and a file that is not a view
    (garbled, the wrong types) is read as no queue at all, never a traceback."""
    from capyctl.gateway import queueview

    settings.DATA_DIR = tmp_path
    queueview.publish({"chat": {"waiting": 3, "room_since": time.time() - 4}}, "p1")
    assert queueview.read()["chat"]["waiting"] == 3
    stale = {"at": time.time() - queueview.STALE_SECONDS - 1,
             "models": {"chat": {"waiting": 3, "room_since": None}}}  # fmt: skip
    (tmp_path / queueview.FILE).write_text(json.dumps(stale))
    assert queueview.read() == {}
    for garbled in ("{not json", '["at"]', '{"at": "soon", "models": {}}',
                    json.dumps({"at": time.time(), "models": {"chat": {"waiting": "many"}}}),
                    json.dumps({"at": time.time(), "models": ["chat"]})):  # fmt: skip
        (tmp_path / queueview.FILE).write_text(garbled)
        assert queueview.read() == {}, garbled
