"""What a new user meets first at the command line: sizes as they type them, setups that can
never run, and a park that stops a model instead; each test does what the user did."""

import signal
import sys

import pytest

from capyctl.deployments.models import Deployment
from capyctl.engines.models import Engine
from capyctl.hosts.models import Host
from tests.conftest import run_program, start_server, stop_server, table_counts

GIB = 1024**3
SIM = f"{sys.executable} -m hostagent.sim"


@pytest.fixture
def sim_engine(cli):
    added = cli("engine", "add", "sim", "--kind", "vllm", "--command", f"{SIM} vllm")
    assert added.code == 0, added.err


def _add(cli, name, *flags):
    return cli("deployment", "add", name, "--engine", "sim", "--source", name, *flags)


# --- sizes -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (("--gpu-memory", "16"), "'16': a size needs a unit: write 16GiB"),
        (("--weights-size", "4"), "'4': a size needs a unit: write 4GiB"),
        (("--gpu-memory", "1.5"), "'1.5': a fraction must lie in (0, 1]; for a size write 1.5GiB"),
        (("--gpu-memory", "1"), "'1': a size needs a unit: write 1GiB (or 1.0 for all of it)"),
        (("--gpu-memory", "16", "GB"), "a size is one word: write 16GB, not 16 GB"),
        (("--weights-size", "4", "GiB"), "a size is one word: write 4GiB, not 4 GiB"),
    ],
)
def test_a_size_without_its_unit_is_refused_with_a_hint(cli, sim_engine, flags, says):
    before = table_counts()
    result = _add(cli, "chat", *flags)
    assert result.code == 2
    assert says in result.err
    assert len(result.err.strip().splitlines()) == 1
    assert table_counts() == before


def test_the_add_line_echoes_every_size_it_stored(cli, sim_engine):
    result = _add(cli, "chat", "--gpu-memory", "16GB", "--weights-size", "4GiB")
    assert result.code == 0, result.err
    # GB is 10^9 bytes: the user sees what that is in GiB.
    assert result.out.strip() == (
        "deployment chat added (engine sim, desired running; gpu memory 14.9 GiB per GPU, "
        "weights copy 4.0 GiB)"
    )
    chat = Deployment.objects.get(name="chat")
    assert (chat.gpu_memory_bytes, chat.weights_bytes) == (16 * 1000**3, 4 * GIB)
    fraction = _add(cli, "code", "--gpu-memory", "0.5")
    assert fraction.out.strip() == (
        "deployment code added (engine sim, desired running; gpu memory 0.5 of each GPU)"
    )
    updated = cli("deployment", "update", "chat", "--gpu-memory", "20GiB")
    assert updated.code == 0, updated.err
    assert updated.out.strip() == (
        "deployment chat updated: gpu_memory_bytes, gpu_memory_fraction (gpu memory 20.0 GiB "
        "per GPU)"
    )


def test_rest_sizes_take_bytes_as_numbers_and_strings_with_a_unit(admin_client, db):
    from capyctl.engines.services import add_engine

    add_engine("sim", kind="vllm", command=f"{SIM} vllm")
    body = {"name": "chat", "engine": "sim", "source": "chat"}
    as_int = admin_client.post(
        "/api/deployments/", {**body, "gpu_memory": 16 * GIB, "weights_size": 4 * GIB},
        content_type="application/json",
    )  # fmt: skip
    assert as_int.status_code == 201, as_int.content
    chat = Deployment.objects.get(name="chat")
    assert (chat.gpu_memory_bytes, chat.weights_bytes) == (16 * GIB, 4 * GIB)
    bare = admin_client.post(
        "/api/deployments/", {**body, "name": "code", "gpu_memory": "16"},
        content_type="application/json",
    )  # fmt: skip
    assert bare.status_code == 400
    assert "write 16GiB" in bare.content.decode()
    assert not Deployment.objects.filter(name="code").exists()


def test_the_admin_form_shows_a_stored_size_exactly(admin_client, db):
    """A size in GB is shown as it was stored, so saving the form again keeps it."""
    from capyctl.deployments.services import DeploymentSpec, add_deployment
    from capyctl.engines.services import add_engine

    add_engine("sim", kind="vllm", command=f"{SIM} vllm")
    chat = add_deployment(
        DeploymentSpec(name="chat", engine="sim", source="chat", gpu_memory_bytes=16 * 1000**3)
    )
    page = admin_client.get(f"/admin/deployments/deployment/{chat.pk}/change/").content.decode()
    assert 'value="16GB"' in page


# --- setups that can never run -----------------------------------------------------------


@pytest.fixture
def gpu_host(cli):
    """The local host as a server with one 24 GiB GPU reports it (23.5 GiB after reserve)."""
    assert cli("status").code == 0  # the first command makes the local host
    Host.objects.filter(name="local").update(
        inventory={
            "gpus": [{"index": 0, "name": "GPU 0", "total_bytes": 24 * GIB}],
            "ram_total_bytes": 64 * GIB,
        }
    )
    return Host.objects.get(name="local")


def test_a_deployment_larger_than_any_gpu_is_stored_with_a_warning(cli, sim_engine, gpu_host):
    result = _add(cli, "huge", "--gpu-memory", "100GiB")
    assert result.code == 0, result.err
    assert result.err.strip() == (
        "capyctl: warning: huge needs 100.0 GiB per GPU; the largest GPU pool holds 23.5 GiB, "
        "so it cannot start until a host with room for it joins"
    )
    assert Deployment.objects.filter(name="huge", desired_state="running").exists()
    status = cli("status")
    row = next(line for line in status.out.splitlines() if line.startswith("huge "))
    assert "needs 100.0 GiB per GPU; the largest GPU pool holds 23.5 GiB" in row
    fits = _add(cli, "small", "--gpu-memory", "16GiB")
    assert (fits.code, fits.err) == (0, "")
    too_many = _add(cli, "wide", "--gpu-memory", "16GiB", "--gpus", "2")
    assert "wide needs 2 GPUs; the most one host has is 1" in too_many.err


def test_an_engine_whose_program_is_missing_is_stored_with_a_warning(cli, gpu_host):
    result = cli("engine", "add", "v1", "--kind", "vllm", "--command", "/nonexistent/vllm")
    assert result.code == 0
    assert result.err.strip() == (
        "capyctl: warning: engine v1: its program /nonexistent/vllm is not found on this "
        "host; its models cannot start until it is installed"
    )
    assert Engine.objects.filter(name="v1").exists()
    added = cli("deployment", "add", "chat", "--engine", "v1", "--source", "c",
                "--gpu-memory", "16GiB")  # fmt: skip
    assert added.code == 0
    assert "engine v1's program /nonexistent/vllm is not found on this host" in added.err
    status = cli("status")
    row = next(line for line in status.out.splitlines() if line.startswith("chat "))
    assert "engine v1's program /nonexistent/vllm is not found" in row


# --- a park that stops ---------------------------------------------------------------------


@pytest.mark.e2e
def test_parking_a_model_whose_engine_cannot_park_says_why(program_env):
    program_env["CAPYCTL_SIM_GPUS"] = "24GiB"
    program_env["CAPYCTL_MIN_READY_SECONDS"] = "0"
    run = lambda *argv: run_program(program_env, *argv)  # noqa: E731
    assert run("engine", "add", "llama", "--kind", "llamacpp",
               "--command", f"{SIM} llamacpp").code == 0  # fmt: skip
    assert run("deployment", "add", "smollm2", "--engine", "llama", "--source", "smollm2",
               "--gpu-memory", "2GiB").code == 0  # fmt: skip
    server = start_server(program_env)
    try:
        started = run("deployment", "start", "smollm2")
        assert started.code == 0, started.err
        parked = run("deployment", "park", "smollm2")
        assert parked.code == 0, parked.err
        assert parked.out.startswith(
            "smollm2 is stopped, not parked: its engine cannot park, so it was stopped ("
        )
    finally:
        stop_server(server, signal.SIGTERM)
    lines = [line for line in server.log().splitlines() if "cannot park" in line]
    assert lines
    assert all("smollm2" in line for line in lines), lines
