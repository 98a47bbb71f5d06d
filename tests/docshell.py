"""The pages' console blocks, run as a user would type them, and their output compared.

Sybil collects the fenced blocks of ``README.md`` and ``docs/*.md`` (see the root
``conftest.py``); this module is what runs them. The rules a page follows:

- A block that shows commands (lines starting with ``$ ``) is a ``console`` block, and the
  tests run it: each command, in page order, in ``bash`` from a fresh copy of the checkout's
  layout (``/srv/capyctl`` on a page, in commands and in output, is that directory, and ``~``
  the one above it; its data dir ``.capyctl`` is new for
  each page, as after ``git clone``), with its ``.venv/bin`` on ``PATH`` as the README's
  setup has it. Shell variables, ``export``, ``cd`` and ``$?`` carry
  from one command to the next, as in one terminal.
- The lines after a command, up to the next ``$ ``, are its output (stdout and stderr as the
  terminal shows them). A line ``...`` or ``...`` inside a line stands for any text.
  Runs of spaces match any run of spaces, so table columns may be wider or narrower.
- Volatile values (keys, ids, times, ports, durations, passwords, pids) are matched by
  their pattern, and the page's value is bound to the real one: a later command that uses
  the page's value (``capyctl key revoke dks3cozu5h``) is run with the real one, and a
  later output that shows it must show the same real value.
- ``make run``, ``make demo`` and ``capyctl start ...`` serve until stopped: they run in the
  background, and the page goes on once their output begins as the page shows (a new
  server start first stops the page's earlier one with Ctrl-C, as a user would). Every
  process a page started is stopped when the page is done. A start the page shows refused
  (its output begins ``capyctl: error:``) runs like any command, and the page's server
  goes on serving, as when a second terminal tries to start one.
- A block that cannot run here (a real GPU, vLLM installed) is marked, visibly, by a
  quoted line right above it that starts ``> **Illustrative``; it is not run.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from sybil import Document, Example, Region
from sybil.parsers.markdown.lexers import RawFencedCodeBlockLexer

REPO = Path(__file__).resolve().parent.parent
DOC_ROOT = "/srv/capyctl"  # what a page shows as the directory of the checkout
COMMAND_TIMEOUT = 90.0  # a command that takes longer has hung
SERVER_TIMEOUT = 90.0  # a server start shows its output within this
# Ports the pages use; each page gets free ones in their place.
DOC_PORTS = (8000, 8080, 7070, 7071, 7072, 7443, 7444)
ILLUSTRATIVE = re.compile(r"^>\s*\*\*Illustrative")
SERVING = re.compile(
    r"^(?:[A-Z_]+=\S+\s+)*(?:make\s+(?:run|demo)\b"
    r"|(?:\S*/)?capyctl\b.*\sstart\s+(?:standalone|server|host)\b)"
)
REFUSED = re.compile(r"\s*capyctl: error:")  # a start shown refused does not serve


# --- volatile values -------------------------------------------------------------------


@dataclass(frozen=True)
class Volatile:
    """A kind of value that differs from run to run. ``page`` finds it in what a page shows
    (strict enough not to catch ordinary words); ``real`` matches it in real output."""

    name: str
    page: re.Pattern[str]
    real: str


_AFTER_HOST = r"(?<=127\.0\.0\.1:)|(?<=localhost:)|(?<=0\.0\.0\.0:)|(?<=\]:)"


def _v(name: str, page: str, real: str) -> Volatile:
    return Volatile(name, re.compile(page), real)


VOLATILES: tuple[Volatile, ...] = (
    _v("key", r"capy_[a-z0-9]{10}_[A-Za-z0-9_-]{20,}", r"capy_[a-z0-9]{10}_[A-Za-z0-9_-]{20,}"),
    _v("join token", r"capyjoin_[A-Za-z0-9_-]{16,}", r"capyjoin_[A-Za-z0-9_-]{16,}"),
    _v(
        "uuid",
        r"\b[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b",
        r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}",
    ),
    _v(
        "time",
        r"\b\d{4}-\d\d-\d\d[T ]\d\d:\d\d(?::\d\d(?:\.\d+)?)?(?:Z|[+-]\d\d:?\d\d)?",
        r"\d{4}-\d\d-\d\d[T ]\d\d:\d\d(?::\d\d(?:\.\d+)?)?(?:Z|[+-]\d\d:?\d\d)?",
    ),
    # an HTTP header's date (date: Mon, 30 Nov 2026 21:58:15 GMT)
    _v(
        "http date",
        r"\b[A-Z][a-z]{2}, \d\d [A-Z][a-z]{2} \d{4} \d\d:\d\d:\d\d GMT\b",
        r"[A-Z][a-z]{2}, \d\d [A-Z][a-z]{2} \d{4} \d\d:\d\d:\d\d GMT",
    ),
    _v("clock", r"\b\d\d:\d\d:\d\d(?:\.\d+)?\b", r"\d\d:\d\d:\d\d(?:\.\d+)?"),
    _v("epoch", r"(?<![\d.])1[789]\d{8}(?:\.\d+)?(?![\d.])", r"\d{10}(?:\.\d+)?"),
    # hex ids: chatcmpl-3df68f3ca3bc41dc, resp_9f21..., a digest; a letter and a digit in it
    _v(
        "hex id",
        r"(?<![0-9A-Za-z])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{12,}(?![0-9A-Za-z])",
        r"[0-9a-f]{12,}",
    ),
    # record ids (keys, hosts): ten lowercase letters and digits, shown with a digit in them;
    # also as a key's prefix (capy_m8x6ps774i)
    _v(
        "id",
        r"(?:(?<![\w-])|(?<=\bcapy_))(?=[a-z0-9]*\d)(?=[a-z0-9]*[a-z])[a-z0-9]{10}(?![\w-])",
        r"[a-z0-9]{10}",
    ),
    # a generated password: the banner's "admin / ...", capyctl user add's "password: ..."
    _v("password", r"(?:(?<=admin / )|(?<=^password: )|(?<=\npassword: ))\S+", r"\S+"),
    _v("pid", r"(?<=\bpid )\d+", r"\d+"),
    # seconds to wait before a retry: a Retry-After header, DRF's "available in 3 seconds"
    _v("retry wait", r"(?:(?<=retry-after: )|(?<=Retry-After: )|(?<=available in ))\d+", r"\d+"),
    # a port after a host, or the one python -m http.server is given
    _v(
        "port",
        r"(?:(?<=127\.0\.0\.1:)|(?<=localhost:)|(?<=0\.0\.0\.0:)|(?<=\]:)|(?<=http\.server ))"
        r"\d{2,5}\b",
        r"\d{2,5}",
    ),
    _v("ram", r"(?<=RAM )\d+(?:\.\d+)? [KMGT]iB", r"\d+(?:\.\d+)? [KMGT]iB"),
    _v("duration", r"(?<![\w.])\d+(?:\.\d+)? ?(?:ms|s)\b", r"\d+(?:\.\d+)? ?(?:ms|s)\b"),
)


def volatile_spans(text: str) -> list[tuple[int, int, Volatile]]:
    """The volatile values a page shows in ``text``, in order, not overlapping (the first
    kind listed wins)."""
    taken: list[tuple[int, int, Volatile]] = []
    for kind in VOLATILES:
        for match in kind.page.finditer(text):
            start, end = match.span()
            if start == end or any(s < end and start < e for s, e, _ in taken):
                continue
            taken.append((start, end, kind))
    return sorted(taken, key=lambda span: span[0])


class OutputMismatchError(AssertionError):
    pass


@dataclass
class Bindings:
    """Page values of volatile things, bound to the real values this run produced."""

    real: dict[str, str] = field(default_factory=dict)

    def command(self, text: str) -> str:
        """``text`` with the page's volatile values replaced by their real ones."""
        out, last = [], 0
        for start, end, _ in volatile_spans(text):
            out.append(text[last:start])
            value = text[start:end]
            out.append(self.real.get(value, value))
            last = end
        out.append(text[last:])
        return "".join(out)

    def match(self, expected: str, actual: str, *, more: bool = False) -> None:
        """Check ``actual`` against the page's ``expected`` output and bind what it showed;
        raise OutputMismatchError (binding nothing) if it does not match. With ``more``,
        lines after the ones shown are allowed (a server goes on logging)."""
        pattern, groups = self._pattern(expected)
        if more:
            pattern += r"(?:\n.*)?"
        found = re.fullmatch(pattern, _tidy(actual), re.DOTALL)
        if found is None:
            raise OutputMismatchError(self._difference(expected, actual))
        for group, value in groups.items():
            self.real[value] = found.group(group)

    def _pattern(self, expected: str) -> tuple[str, dict[str, str]]:
        text = _tidy(expected)
        fragments: list[str] = []  # the regex of each volatile value, by index
        groups: dict[str, str] = {}  # group name -> page value
        seen: dict[str, str] = {}  # page value -> group name
        marked, last = [], 0
        for start, end, kind in volatile_spans(text):
            value = text[start:end]
            if value in self.real:
                fragments.append(re.escape(self.real[value]))
            elif value in seen:
                fragments.append(f"(?P={seen[value]})")
            else:
                name = f"v{len(groups)}"
                seen[value], groups[name] = name, value
                fragments.append(f"(?P<{name}>{kind.real})")
            marked.append(text[last:start] + f"\0{len(fragments) - 1}\0")
            last = end
        marked.append(text[last:])
        return _lines_pattern("".join(marked), fragments), groups

    def _difference(self, expected: str, actual: str) -> str:
        import difflib

        shown = _tidy(actual)
        for page_value, real in sorted(self.real.items(), key=lambda kv: -len(kv[1])):
            # whole values only: a bound wait of 3 must not turn a 503 into a 502
            value = re.compile(rf"(?<![A-Za-z0-9]){re.escape(real)}(?![A-Za-z0-9])")
            shown = value.sub(page_value.replace("\\", "\\\\"), shown)
        diff = difflib.unified_diff(
            _tidy(expected).splitlines(), shown.splitlines(), "the page", "the run", lineterm=""
        )
        return "\n".join(diff)


def _tidy(text: str) -> str:
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    while lines and not lines[0]:
        lines.pop(0)
    return "\n".join(lines)


def _lines_pattern(text: str, fragments: list[str]) -> str:
    """A regex for page output whose volatile values are marked ``\0N\0``: a line ``...``
    is any lines (or none), ``...`` in a line any text, a run of spaces any run of spaces."""
    lines = text.split("\n") if text else []
    parts: list[str] = []
    for index, line in enumerate(lines):
        last = index == len(lines) - 1
        if line.strip() == "...":
            if index == 0:
                parts.append(".*" if last else r"(?:.*?\n)?")
            else:
                parts.append(r"(?:\n.*)?" if last else r"(?:\n.*?)?")
            continue
        if index > 0 and not (index == 1 and lines[0].strip() == "..."):
            parts.append(r"\n")
        for piece in re.split(r"(\0\d+\0|\.\.\.| {2,})", line):
            if piece.startswith("\0"):
                parts.append(fragments[int(piece.strip("\0"))])
            elif piece == "...":
                parts.append(r"[^\n]*?")
            elif piece and not piece.strip(" "):
                parts.append(" +")
            else:
                parts.append(re.escape(piece))
    return "".join(parts)


# --- commands in a block ---------------------------------------------------------------


@dataclass
class Step:
    command: str
    expected: str
    line: int  # 1-based line of the command in the page


def steps(source: str, first_line: int) -> list[Step]:
    """The commands of a console block with the output shown after each. A command ending
    in a backslash goes on on the next line (kept as typed: bash joins them)."""
    found: list[Step] = []
    lines = source.split("\n")
    index = 0
    while index < len(lines):
        line = lines[index]
        if not line.startswith("$ "):
            if line.strip():
                raise ValueError(f"line {first_line + index}: output before any command")
            index += 1
            continue
        start = index
        command = line[2:]
        while command.endswith("\\") and index + 1 < len(lines):
            index += 1
            command = command + "\n" + lines[index]
        output = []
        index += 1
        while index < len(lines) and not lines[index].startswith("$ "):
            output.append(lines[index])
            index += 1
        found.append(Step(command, "\n".join(output), first_line + start))
    return found


# --- a page: its directory, environment and servers -------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _not_copied(directory: str, names: list[str]) -> set[str]:
    """What a fresh clone does not have: the venv, the data dir, build and cache output."""
    return {
        name
        for name in names
        if name in {".git", ".venv", ".capyctl", "build", "__pycache__", "node_modules"}
        or name.endswith((".egg-info", "_cache"))
    }


def not_newer_than_venv(copy: Path, venv: Path) -> None:
    """Date back the copy's files that are newer than the venv's install stamps, so that
    ``make run`` in the copy finds the shared venv up to date: a reinstall there would
    point the checkout's venv (``pip install -e .``) at the copy, which is deleted after
    the page."""
    stamps = [path.stat().st_mtime_ns for path in venv.glob(".*-installed")]
    if not stamps:
        return
    # A second before the oldest stamp, in whole nanoseconds: a float's rounding could
    # leave a file a few nanoseconds newer than the stamp, and make would reinstall.
    oldest = min(stamps) - 1_000_000_000
    for directory, _, files in os.walk(copy):
        for name in files:
            path = Path(directory) / name
            if path.lstat().st_mtime_ns > oldest:
                os.utime(path, ns=(oldest, oldest), follow_symlinks=False)


@dataclass
class Background:
    process: subprocess.Popen[bytes]
    log: Path
    serving: bool  # a standalone or server start (not a host agent)

    def output(self) -> str:
        return self.log.read_text(errors="replace")


class Page:
    """One page's run: a directory laid out like the checkout, one terminal's environment,
    and the servers the page started."""

    def __init__(self, redis_url: str) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="capyctl-docs-")
        self.root = Path(self._tmp.name)
        self.cwd = self.root / "capyctl"
        self.checkout = self.cwd  # what the page shows as /srv/capyctl, wherever it cd's
        self.cwd.mkdir()
        shutil.copytree(REPO, self.cwd, symlinks=True, ignore=_not_copied, dirs_exist_ok=True)
        (self.cwd / ".venv").symlink_to(REPO / ".venv")
        not_newer_than_venv(self.cwd, REPO / ".venv")
        self.env = {
            key: value
            for key, value in os.environ.items()
            if not key.startswith(("CAPYCTL_", "MAKE", "PYTEST_", "DJANGO_")) and key != "MFLAGS"
        }
        self.env.update(HOME=str(self.root), PYTHONUNBUFFERED="1", TERM="dumb", COLUMNS="200")
        self.env["PATH"] = os.pathsep.join(
            [str(self.cwd / ".venv" / "bin")]
            + [part for part in self.env.get("PATH", "").split(os.pathsep) if ".venv" not in part]
        )
        self.bindings = Bindings()
        for port in DOC_PORTS:
            self.bindings.real[str(port)] = str(_free_port())
        # The one Redis database this test run owns stands for any the page names.
        self.redis_url = redis_url
        self.status = 0
        self.background: list[Background] = []

    def close(self) -> None:
        for job in reversed(self.background):
            _stop(job.process)
        self.background.clear()
        _end_strays(self.root)
        self._tmp.cleanup()

    # -- running --

    def run_block(self, source: str, first_line: int, page: str) -> None:
        for step in steps(source, first_line):
            where = f"{page} line {step.line}: $ {step.command.splitlines()[0]}"
            command = self._real_command(step.command)
            serving = bool(SERVING.match(step.command)) and not REFUSED.match(step.expected)
            actual = self._serve(command, step.expected) if serving else self._run(command)
            try:
                self.bindings.match(step.expected, self._as_page(actual), more=serving)
            except OutputMismatchError as exc:
                raise OutputMismatchError(
                    f"{where}\noutput differs from the page:\n{exc}"
                ) from None

    def _real_command(self, command: str) -> str:
        command = self.bindings.command(command)
        command = re.sub(r"redis://127\.0\.0\.1:6379/\d+", self.redis_url, command)
        command = command.replace(DOC_ROOT, str(self.checkout))
        if (
            re.match(r"^(?:[A-Z_]+=\S+\s+)*make\s+(?:run|demo)\b", command)
            and "ARGS=" not in command
        ):
            command += f" ARGS='--listen 127.0.0.1:{self.bindings.real['8000']}'"
        return command

    def _as_page(self, text: str) -> str:
        """Real output in the page's terms: the checkout directory and the Redis database."""
        text = text.replace(str(self.checkout), DOC_ROOT).replace(str(self.root), "/srv")
        return text.replace(self.redis_url, "redis://127.0.0.1:6379/11")

    def _script(self, command: str) -> str:
        state = self.root / ".state"
        return (
            f"set -a\n(exit {self.status})\n{command}\n__status=$?\n"
            f"{{ env -0; printf 'PWD_AT_END=%s\\0' \"$PWD\"; }} > {shlex.quote(str(state))}\n"
            "exit $__status\n"
        )

    def _run(self, command: str) -> str:
        done = subprocess.run(
            ["bash", "-c", self._script(command)],
            cwd=self.cwd,
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            timeout=COMMAND_TIMEOUT,
            check=False,
        )
        self.status = done.returncode
        self._keep_state()
        return done.stdout.decode(errors="replace")

    def _keep_state(self) -> None:
        state = self.root / ".state"
        if not state.exists():
            return
        env = dict(item.split("=", 1) for item in state.read_text().split("\0") if "=" in item)
        state.unlink()
        cwd = env.pop("PWD_AT_END", str(self.cwd))
        for name in ("PWD", "OLDPWD", "SHLVL", "_", "__status"):
            env.pop(name, None)
        self.env = env
        self.cwd = Path(cwd)

    def _serve(self, command: str, expected: str) -> str:
        serving = "start host" not in command
        if serving:
            for job in [job for job in self.background if job.serving]:
                _stop(job.process)
                self.background.remove(job)
        log = self.root / f"background-{len(list(self.root.glob('background-*.log')))}.log"
        with log.open("wb") as sink:
            process = subprocess.Popen(
                ["bash", "-c", f"set -a\n{command}"],
                cwd=self.cwd,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=sink,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        job = Background(process, log, serving)
        self.background.append(job)
        deadline = time.monotonic() + SERVER_TIMEOUT
        trial = Bindings(dict(self.bindings.real))
        while True:
            output = self._as_page(job.output())
            try:
                trial.match(expected, output, more=True)
                return job.output()
            except OutputMismatchError:
                if process.poll() is not None or time.monotonic() > deadline:
                    return job.output()
            time.sleep(0.1)


def _end_strays(root: Path) -> None:
    """End what a page left running on its own (``python -m http.server ... &`` when a
    later step failed): every process whose working directory or program is in the page's
    directory."""
    import psutil

    inside = str(root) + os.sep
    strays = []
    for process in psutil.process_iter(["cwd", "cmdline"]):
        where = [process.info.get("cwd") or "", *(process.info.get("cmdline") or [])[:2]]
        if process.pid != os.getpid() and any(p.startswith(inside) for p in where):
            strays.append(process)
    for process in strays:
        with contextlib.suppress(psutil.Error):
            process.kill()
    psutil.wait_procs(strays, timeout=5)


def _stop(process: subprocess.Popen[bytes]) -> None:
    """Ctrl-C, as a user stops a server; then SIGTERM, then SIGKILL to what is left."""
    for sig, wait in ((signal.SIGINT, 15), (signal.SIGTERM, 5), (signal.SIGKILL, 5)):
        if process.poll() is not None:
            break
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            break
        try:
            process.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
    with contextlib.suppress(ProcessLookupError, PermissionError):  # what is left in its group
        os.killpg(process.pid, signal.SIGKILL)


# --- Sybil: which blocks are examples ---------------------------------------------------


class ConsoleBlocks:
    """A Sybil parser: every fenced block that shows commands is run, unless the quoted
    line above it says it is illustrative; a block of commands not marked ``console`` is
    an error, so no page can show commands the tests skip without saying so."""

    def __init__(self) -> None:
        self.lexer = RawFencedCodeBlockLexer(
            info_pattern=re.compile(r"(?P<language>[^\n]*)$\n", re.MULTILINE)
        )

    def __call__(self, document: Document) -> Iterable[Region]:
        for region in self.lexer(document):
            source = str(region.lexemes["source"])
            if not any(line.startswith("$ ") for line in source.split("\n")):
                continue
            above = document.text[: region.start].rstrip().rsplit("\n", 1)[-1]
            if ILLUSTRATIVE.match(above):
                continue
            language = str(region.lexemes["language"]).strip()
            first_line = document.text.count("\n", 0, region.start) + 2
            region.parsed = (language, source, first_line)
            region.evaluator = evaluate
            yield region


def evaluate(example: Example) -> None:
    language, source, first_line = example.parsed
    page_name = os.path.relpath(example.path, REPO)
    if language != "console":
        raise OutputMismatchError(
            f"{page_name} line {first_line - 1}: a block of commands must be ```console (the "
            "tests run it) or have a '> **Illustrative**' line above it"
        )
    page = example.namespace.get("page")
    if page is None:  # the page's first block: the fixtures are in the namespace now
        page = example.namespace["page"] = Page(example.namespace["redis_run"].url)
    page.run_block(source, first_line, page_name)


def page_teardown(namespace: dict[str, object]) -> None:
    page = namespace.pop("page", None)
    if isinstance(page, Page):
        page.close()


def all_examples(path: Path) -> Iterator[Example]:
    """The examples of one page (for tests of this module)."""
    document = Document.parse(str(path), ConsoleBlocks())
    yield from document.examples()
