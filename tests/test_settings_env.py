"""CAPYCTL_* variables: typed, and a bad one stops start-up with a clear line."""

import pytest

from capyctl.conf import (
    ConfigError,
    env_bool,
    env_choice,
    env_int,
    env_size,
    parse_sim_gpus,
)
from hostagent.runtime import free_port
from hostagent.simgpu import SimSpec
from tests.conftest import run_program

GIB = 1024**3


def test_typed_readers_accept_good_values():
    env = {"A": "yes", "B": "42", "C": "24GiB", "D": "ram"}
    assert env_bool("A", False, environ=env) is True
    assert env_int("B", 0, environ=env) == 42
    assert env_size("C", 0, environ=env) == 24 * GIB
    assert env_choice("D", "auto", ("auto", "ram"), environ=env) == "ram"
    assert env_int("MISSING", 7, environ=env) == 7


@pytest.mark.parametrize(
    ("reader", "value"),
    [
        (lambda env: env_bool("CAPYCTL_X", False, environ=env), "maybe"),
        (lambda env: env_int("CAPYCTL_X", 1, minimum=0, environ=env), "-3"),
        (lambda env: env_int("CAPYCTL_X", 1, environ=env), "ten"),
        (lambda env: env_size("CAPYCTL_X", 1, environ=env), "lots"),
        (lambda env: env_choice("CAPYCTL_X", "a", ("a", "b"), environ=env), "c"),
    ],
)
def test_bad_values_name_the_variable(reader, value):
    with pytest.raises(ConfigError) as info:
        reader({"CAPYCTL_X": value})
    assert "CAPYCTL_X" in str(info.value)


def test_simulated_gpus_are_parsed():
    assert parse_sim_gpus("V", "24GiB") == SimSpec(unified=False, sizes=[24 * GIB])
    assert parse_sim_gpus("V", "2x80GiB") == SimSpec(unified=False, sizes=[80 * GIB, 80 * GIB])
    assert parse_sim_gpus("V", "24GiB,48GiB") == SimSpec(unified=False, sizes=[24 * GIB, 48 * GIB])
    assert parse_sim_gpus("V", "unified:128GiB") == SimSpec(unified=True, sizes=[128 * GIB])
    assert parse_sim_gpus("V", "") is None
    for bad in ("x80GiB", "0x24GiB", "unified:lots", "24 parsecs"):
        with pytest.raises(ConfigError, match="V="):
            parse_sim_gpus("V", bad)


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("CAPYCTL_SIM_GPUS", "2xlots"),
        ("CAPYCTL_DATABASE_URL", "mysql://nobody@127.0.0.1/x"),
        ("CAPYCTL_WAKE_TIMEOUT", "soon"),
        ("CAPYCTL_SECRET_KEY", "short"),
        ("CAPYCTL_REDIS_URL", "http://127.0.0.1:6379"),
        ("CAPYCTL_DEBUG", "perhaps"),
        ("CAPYCTL_PARK_CONFIRM_SECONDS", "0"),
        ("CAPYCTL_SIM_PIDS", "hidden"),
    ],
)
def test_a_bad_variable_stops_the_program_with_one_line(program_env, variable, value):
    program_env[variable] = value
    result = run_program(program_env, "status")
    assert result.code == 2
    lines = result.err.strip().splitlines()
    assert len(lines) == 1, result.err
    assert variable in lines[0]
    assert "Traceback" not in result.err


@pytest.mark.e2e
def test_a_database_that_cannot_be_reached_exits_1_with_one_line(program_env):
    port = free_port()  # nothing listens there
    program_env["CAPYCTL_DATABASE_URL"] = f"postgres://postgres@127.0.0.1:{port}/capyctl"
    for argv in (
        ["status"],
        ["engine", "add", "v1", "--kind", "vllm", "--command", "vllm"],
        ["start", "standalone", "--listen", f"127.0.0.1:{free_port()}"],
    ):
        result = run_program(program_env, *argv)
        assert result.code == 1, (argv, result.err)
        lines = result.err.strip().splitlines()
        assert len(lines) == 1, result.err
        assert lines[0].startswith("capyctl: error: database error: "), lines[0]
        assert f"port {port} failed: Connection refused" in lines[0]


@pytest.mark.e2e
def test_a_host_agent_refuses_a_bad_park_bound_in_one_line(program_env, tmp_path):
    from hostagent.runtime import free_port

    env = {k: v for k, v in program_env.items() if k != "CAPYCTL_DATA_DIR"}
    env["CAPYCTL_PARK_CONFIRM_SECONDS"] = "soon"
    result = run_program(env, "start", "host", "--listen", f"127.0.0.1:{free_port()}",
                         "--data-dir", str(tmp_path / "agent"))  # fmt: skip
    assert result.code == 2
    assert (
        result.err.strip() == "capyctl: error: CAPYCTL_PARK_CONFIRM_SECONDS='soon' is not a number"
    )
