"""The runner of the pages' console blocks: what it matches, binds and refuses."""

from __future__ import annotations

import re
from pathlib import Path

import psutil
import pytest

from tests.docshell import (
    SERVING,
    Bindings,
    OutputMismatchError,
    Page,
    all_examples,
    not_newer_than_venv,
    steps,
)
from tests.redis_db import RedisDb


def test_a_volatile_value_is_bound_and_must_stay_the_same():
    bindings = Bindings()
    bindings.match(
        "capyctl: key created (id dks3cozu5h, user admin)",
        "capyctl: key created (id 8q0vx1mm2a, user admin)",
    )
    assert bindings.command("capyctl key revoke dks3cozu5h") == "capyctl key revoke 8q0vx1mm2a"
    bindings.match("key dks3cozu5h revoked", "key 8q0vx1mm2a revoked")
    with pytest.raises(OutputMismatchError):
        bindings.match("key dks3cozu5h revoked", "key 7a7a7a7a7a revoked")


def test_a_keys_prefix_is_its_id():
    bindings = Bindings()
    bindings.match(
        '{"id": "m8x6ps774i", "prefix": "capy_m8x6ps774i"}',
        '{"id": "2gn2t318xx", "prefix": "capy_2gn2t318xx"}',
    )
    assert bindings.command("capyctl key revoke capy_m8x6ps774i") == (
        "capyctl key revoke capy_2gn2t318xx"
    )
    with pytest.raises(OutputMismatchError):
        Bindings().match(
            '{"id": "m8x6ps774i", "prefix": "capy_m8x6ps774i"}',
            '{"id": "2gn2t318xx", "prefix": "capy_7a7a7a7a7a"}',
        )


def test_an_http_date_and_a_retry_wait_are_volatile():
    page = "date: Mon, 30 Nov 2026 21:58:15 GMT\nretry-after: 3\nExpected available in 3 seconds."
    real = "date: Tue, 01 Dec 2026 08:00:02 GMT\nretry-after: 2\nExpected available in {} seconds."
    Bindings().match(page, real.format(2))
    with pytest.raises(OutputMismatchError):  # one wait, shown twice: the same both times
        Bindings().match(page, real.format(3))
    with pytest.raises(OutputMismatchError):  # any other number is still compared
        Bindings().match("content-length: 172", "content-length: 171")


def test_a_difference_shows_the_run_in_page_terms_value_by_value():
    bindings = Bindings()
    bindings.match("retry-after: 2", "retry-after: 3")
    with pytest.raises(OutputMismatchError) as failure:
        bindings.match("200\nretry-after: 2", "503\nretry-after: 3")
    lines = str(failure.value).splitlines()
    assert "+503" in lines
    assert " retry-after: 2" in lines


def test_a_value_shown_twice_in_one_output_must_be_the_same_value_twice():
    bindings = Bindings()
    bindings.match(
        "resp_9f21365d1b2c ok resp_9f21365d1b2c", "resp_0a1b2c3d4e5f ok resp_0a1b2c3d4e5f"
    )
    with pytest.raises(OutputMismatchError):
        Bindings().match(
            "resp_9f21365d1b2c ok resp_9f21365d1b2c", "resp_0a1b2c3d4e5f ok resp_1111aaaa2222"
        )


def test_columns_may_change_width_but_not_name():
    page = "NAME  ALIASES  ENGINE  STATE\nchat  -        sim     ready"
    Bindings().match(page, "NAME      ALIASES  ENGINE  STATE\nchat      -        sim     ready")
    with pytest.raises(OutputMismatchError) as failure:
        Bindings().match(page, "NAME  ALIAS  ENGINE  STATE\nchat  -      sim     ready")
    assert "-NAME  ALIASES  ENGINE  STATE" in str(failure.value)
    assert "+NAME  ALIAS  ENGINE  STATE" in str(failure.value)


def test_an_ellipsis_stands_for_lines_or_text_and_nothing_else_is_skipped():
    Bindings().match("first\n...\nlast", "first\nlast")
    Bindings().match("first\n...\nlast", "first\na\nb\nlast")
    Bindings().match("...\nlast", "a\nb\nlast")
    Bindings().match("first\n...", "first\na")
    Bindings().match("took ... here", "took a while here")
    with pytest.raises(OutputMismatchError):
        Bindings().match("first\n...\nlast", "first\na\nlast but one")
    with pytest.raises(OutputMismatchError):
        Bindings().match("first", "first\nand more")


def test_a_server_may_log_more_than_the_page_shows():
    Bindings().match("serving\nStop with Ctrl-C.", "serving\nStop with Ctrl-C.\nGET /", more=True)
    with pytest.raises(OutputMismatchError):
        Bindings().match("serving\nStop with Ctrl-C.", "serving\nStop with Ctrl-C.\nGET /")


def test_a_generated_password_is_volatile():
    bindings = Bindings()
    bindings.match(
        "user bob added\npassword: EIVEBRtR1wG4odL8  (shown only now)",
        "user bob added\npassword: JBBtzrJC6-n7Q9gT  (shown only now)",
    )
    assert bindings.real == {"EIVEBRtR1wG4odL8": "JBBtzrJC6-n7Q9gT"}


def test_steps_split_commands_output_and_continued_lines():
    block = "$ capyctl engine add mine \\\n    --kind custom\nengine mine added\n$ echo hi\nhi\n"
    found = steps(block, 10)
    assert [(s.command, s.expected, s.line) for s in found] == [
        ("capyctl engine add mine \\\n    --kind custom", "engine mine added", 10),
        ("echo hi", "hi\n", 13),
    ]


@pytest.fixture
def page_file(tmp_path: Path) -> Path:
    return tmp_path / "page.md"


def run_page(path: Path, redis_run: RedisDb) -> None:
    namespace: dict[str, object] = {}
    try:
        for example in all_examples(path):
            example.namespace.setdefault("redis_run", redis_run)
            example.evaluate()
            namespace = example.namespace
    finally:
        page = namespace.get("page")
        if isinstance(page, Page):
            page.close()


def test_a_renamed_column_fails_the_page_naming_its_line(page_file, redis_run):
    """The documented listing runs for real; the page shows a column the CLI does not
    print, and the failure names the page's file and the command's line."""
    page_file.write_text(
        "# A page\n\n```console\n"
        "$ capyctl init >/dev/null && capyctl engine add sim --kind vllm"
        ' --command "python -m hostagent.sim vllm" >/dev/null 2>&1\n'
        "$ capyctl deployment add chat --engine sim --source chat --gpus 0\n...\n"
        "$ capyctl deployment list\nNAME  ALIASES  ENGINE  HOST  WANTED  STATE  GPU MEMORY  PARK\n"
        "...\n```\n"
    )
    with pytest.raises(OutputMismatchError) as failure:
        run_page(page_file, redis_run)
    message = str(failure.value)
    assert "page.md line 7: $ capyctl deployment list" in message
    assert "-NAME  ALIASES  ENGINE  HOST  WANTED  STATE" in message
    assert re.search(r"\+NAME +ALIASES +ENGINE +HOST +DESIRED +STATE", message)


def test_a_command_continued_on_the_next_line_runs_as_one(page_file, redis_run):
    page_file.write_text("```console\n$ echo one \\\n    two\none two\n```\n")
    run_page(page_file, redis_run)


def test_a_start_shown_refused_leaves_the_pages_server_serving(page_file, redis_run):
    page_file.write_text(
        "```console\n$ capyctl start standalone --listen 127.0.0.1:8000\n...\n"
        "INFO:     Uvicorn running on http://127.0.0.1:8000 (Press CTRL+C to quit)\n"
        "$ capyctl start standalone --listen 127.0.0.1:8000\n"
        "capyctl: error: cannot listen on 127.0.0.1:8000: address already in use\n"
        "$ echo $?; curl -s http://127.0.0.1:8000/healthz\n2\n...ok...\n```\n"
    )
    run_page(page_file, redis_run)


def test_each_process_a_page_starts_logs_to_a_file_of_its_own(page_file, redis_run):
    """A host agent started after a server keeps its log when that server is replaced (the
    new server was given the agent's log file, emptied it, and both wrote into it)."""
    page_file.write_text(
        "```console\n"
        "$ mkdir fake && printf '#!/bin/sh\\necho \"$2 $3\"\\nexec sleep 60\\n' > fake/capyctl\n"
        "$ chmod +x fake/capyctl\n$ fake/capyctl start standalone one\nstandalone one\n"
        "$ fake/capyctl start host two\nhost two\n"
        "$ fake/capyctl start server three\nserver three\n"
        "$ cat ../background-*.log\nstandalone one\nhost two\nserver three\n```\n"
    )
    run_page(page_file, redis_run)


def test_commands_share_one_terminal_and_leave_the_checkout_alone(page_file, redis_run):
    page_file.write_text(
        "```console\n$ KEY=abc; cd docs\n$ echo $KEY $(basename $PWD); false\nabc docs\n"
        "$ echo $?\n1\n$ touch made-by-page && ls made-by-page\nmade-by-page\n```\n"
    )
    run_page(page_file, redis_run)
    assert not (Path(__file__).parent.parent / "docs" / "made-by-page").exists()


def test_a_block_of_commands_must_be_console_or_marked_illustrative(page_file, redis_run):
    page_file.write_text(
        "> **Illustrative** (needs a GPU)\n\n```\n$ nvidia-smi\nGPU 0\n```\n\n"
        "```\n$ echo hi\nhi\n```\n"
    )
    examples = list(all_examples(page_file))
    assert len(examples) == 1  # the illustrative one is not run
    with pytest.raises(OutputMismatchError, match=r"page.md line 8: a block of commands must be"):
        run_page(page_file, redis_run)


def test_make_in_a_pages_copy_does_not_reinstall_the_shared_venv(tmp_path):
    """A page's copy shares the checkout's venv; a file changed after the last install
    must not make ``make`` in the copy reinstall into it (``pip install -e`` from the copy
    would point the checkout's venv at a directory deleted after the page)."""
    import os
    import subprocess

    venv, copy = tmp_path / "venv", tmp_path / "copy"
    venv.mkdir()
    (venv / ".runtime-installed").touch()
    os.utime(venv / ".runtime-installed", (1_000_000, 1_000_000))
    (copy / "src").mkdir(parents=True)
    (copy / "src" / "pyproject.toml").write_text("changed since the install\n")
    (copy / ".venv").symlink_to(venv)
    (copy / "Makefile").write_text(
        "run: .venv/.runtime-installed\n\t@echo serving\n"
        ".venv/.runtime-installed: src/pyproject.toml\n\t@echo reinstalling\n"
    )
    not_newer_than_venv(copy, venv)
    made = subprocess.run(
        ["make", "-s", "run"], cwd=copy, capture_output=True, text=True, check=True
    )
    assert made.stdout == "serving\n"
    assert (venv / ".runtime-installed").stat().st_mtime == 1_000_000


def test_only_a_server_start_runs_in_the_background():
    for serving in (
        "make run",
        "CAPYCTL_SIM_GPUS=24GiB make demo",
        "capyctl start standalone --listen 127.0.0.1:8080",
        ".venv/bin/capyctl --data-dir /srv/x start server",
        "capyctl start host --join capyjoin_abc",
    ):
        assert SERVING.match(serving), serving
    for command in ("capyctl deployment start qwen", "capyctl deployment start a; echo $?"):
        assert not SERVING.match(command), command


def test_a_file_servers_port_is_the_pages_port_as_in_its_urls():
    bindings = Bindings({"8000": "41234"})
    assert (
        bindings.command("python -m http.server 8000 --bind 127.0.0.1 & curl 127.0.0.1:8000/f")
        == "python -m http.server 41234 --bind 127.0.0.1 & curl 127.0.0.1:41234/f"
    )


def test_what_a_page_left_running_is_ended_with_the_page(page_file, redis_run):
    page_file.write_text("```console\n$ sleep 300 >/dev/null 2>&1 & echo $! > sleeper.pid\n```\n")
    example = next(iter(all_examples(page_file)))
    example.namespace["redis_run"] = redis_run
    example.evaluate()
    page = example.namespace["page"]
    assert isinstance(page, Page)
    pid = int((page.cwd / "sleeper.pid").read_text())
    assert psutil.pid_exists(pid)
    page.close()
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_a_pages_copy_is_never_newer_than_the_venvs_stamps(tmp_path):
    """A page's copy of the checkout is dated back so ``make run`` there finds the shared
    venv up to date; dated back through a float, a file could land 116 ns after the stamp,
    and make reinstalled the venv into the copy (which is deleted after the page)."""
    import os

    venv, copy = tmp_path / "venv", tmp_path / "copy"
    venv.mkdir()
    copy.mkdir()
    stamp = venv / ".runtime-installed"
    stamp.touch()
    when = 1700000000000000122  # in 2023, and a time whose float rounds up
    os.utime(stamp, ns=(when, when))
    changed = copy / "pyproject.toml"
    changed.touch()  # edited after the venv was made
    not_newer_than_venv(copy, venv)
    assert changed.stat().st_mtime_ns <= when
