"""``capyctl`` writing into a pipe whose reader has gone (``capyctl events | head -1``,
``capyctl host list | grep -q ...``)."""

import os
import signal
import subprocess

import pytest

from tests.conftest import CAPYCTL, run_program


@pytest.mark.parametrize("unbuffered", [True, False], ids=["unbuffered", "buffered"])
def test_a_listing_whose_reader_stopped_reading_ends_quietly(program_env, unbuffered):
    assert run_program(program_env, "host", "list").code == 0  # the data dir is made
    env = dict(program_env)
    if not unbuffered:
        env.pop("PYTHONUNBUFFERED", None)
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the listing writes its first line
    try:
        done = subprocess.run(
            [CAPYCTL, "host", "list"],
            env=env,
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
            check=False,
        )
    finally:
        os.close(write_end)
    assert done.stderr == ""
    assert done.returncode == 128 + signal.SIGPIPE
