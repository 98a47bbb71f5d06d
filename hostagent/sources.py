"""Model sources on a host: local paths, Hugging Face repositories and HTTP files.

A deployment names its weights with a *source*:

- a local path (``/models/qwen``): used where it is, never copied, moved or deleted; it
  must exist on the host when the model starts;
- a bare Hugging Face id (``Qwen/Qwen2.5-7B-Instruct``): for the engines that would
  download it themselves (vLLM, SGLang, TensorFold) it is fetched as
  ``hf://Qwen/Qwen2.5-7B-Instruct`` (see :func:`engine_source`), unless the engine's
  ``engine_downloads`` option leaves it to the engine; other bare names (one word, or for
  llama.cpp and custom engines) are passed to the engine as they are;
- ``hf://ORG/NAME[@REVISION]``: downloaded with ``huggingface_hub`` into this host's
  cache (``HF_ENDPOINT``, ``HF_TOKEN`` and ``HF_HUB_OFFLINE`` are honoured);
- ``http(s)://HOST/PATH/FILE[#sha256=HEX]``: streamed into the cache, resumed from a
  partial file, and checked against the checksum before it is used.

Downloads run in a thread per source, once however many starts ask for it (and once
across processes, by a lock file). A download lands under a ``.part`` name and is renamed
only when complete and verified, so a failed or cancelled one never looks finished.
Only files under the cache are ever removed, and only by :meth:`SourceCache.prune`.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import re
import shutil
import threading
import time
from collections.abc import Collection, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.parse import unquote, urlsplit

logger = logging.getLogger("hostagent.sources")

_HF_RE = re.compile(r"hf://([^/@]+)/([^/@]+)(?:@(.+))?", re.DOTALL)
# What the Hub itself accepts in an owner or repository name; ``..`` and ``--`` are out,
# since the cache folder is made from the name.
_HF_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,95}")
# A branch, tag, commit or ``refs/pr/N``: segments that never start with a dot.
_HF_REVISION_RE = re.compile(r"[A-Za-z0-9_][\w.+-]*(?:/[A-Za-z0-9_][\w.+-]*)*", re.ASCII)
# A downloaded file's name, as it lands in the cache: no separators, no leading dot or dash.
_FILE_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+=,@~-]{0,199}")
_SHA_RE = re.compile(r"^sha256=([0-9a-fA-F]{64})$")
_CHUNK = 1024 * 1024
_WEIGHT_SUFFIXES = (".safetensors", ".gguf")
_OTHER_WEIGHT_SUFFIXES = (".bin", ".pt", ".pth")


# What a newcomer who copied a path from an example needs to read next.
LOCAL_HINT = (
    ": a source that starts with /, ~ or . is a path on the host; hf://OWNER/NAME and"
    " http(s):// URLs are downloaded, and so is a bare OWNER/NAME for vLLM, SGLang and"
    " TensorFold"
)

# The kinds whose engines take a Hugging Face id and would download it on their own: for
# them CapyCTL fetches a bare OWNER/NAME itself and runs the engine with HF_HUB_OFFLINE=1,
# unless the engine's ``engine_downloads`` option is true.
HUB_NAME_KINDS = frozenset({"vllm", "sglang", "tensorfold"})
ENGINE_DOWNLOADS_OPTION = "engine_downloads"


class SourceError(Exception):
    """A source that is malformed, missing, or could not be fetched; one line for people."""


def classify(source: str) -> str:
    """``local`` (an absolute or ``./`` path), ``hf``, ``http``, or ``engine``: a bare
    name such as ``Qwen/Qwen2.5-7B-Instruct`` (which :func:`engine_source` turns into an
    ``hf://`` source for the engines that would download it themselves)."""
    if source.startswith("hf://"):
        return "hf"
    if source.startswith(("http://", "https://")):
        return "http"
    if source.startswith(("/", "~", "./", "../")):
        return "local"
    return "engine"


def hub_id(source: str) -> str | None:
    """``source`` if it is a bare Hugging Face repository id (``OWNER/NAME``, as the Hub
    spells them), else None."""
    if classify(source) != "engine":
        return None
    owner, slash, name = source.partition("/")
    if not slash or not all(_HF_NAME_RE.fullmatch(part) for part in (owner, name)):
        return None
    if ".." in source or "--" in source:
        return None
    return source


def engine_downloads(options: Mapping[str, object]) -> bool:
    """Whether an engine's options leave bare Hugging Face ids to the engine itself."""
    return options.get(ENGINE_DOWNLOADS_OPTION) is True


def engine_source(source: str, kind: str, options: Mapping[str, object]) -> str:
    """The source CapyCTL fetches for a deployment of an engine of ``kind``: a bare
    ``OWNER/NAME`` becomes ``hf://OWNER/NAME`` for the :data:`HUB_NAME_KINDS` (the engine
    is then given the local snapshot folder), unless the engine's options set
    ``engine_downloads``; every other source is itself."""
    if kind in HUB_NAME_KINDS and not engine_downloads(options) and hub_id(source):
        return f"hf://{source}"
    return source


def parse_hf(source: str) -> tuple[str, str | None]:
    """``hf://ORG/NAME[@REVISION]`` -> (``ORG/NAME``, revision or None)."""
    match = _HF_RE.fullmatch(source)
    if match is None:
        raise SourceError(
            f"invalid source {source!r}: a Hugging Face source is hf://ORG/NAME or "
            "hf://ORG/NAME@REVISION"
        )
    for part in (match[1], match[2]):
        if not _HF_NAME_RE.fullmatch(part) or ".." in part or "--" in part:
            raise SourceError(
                f"invalid source {source!r}: {part!r} is not a repository owner or name "
                "(letters, digits, '_', '-' and '.', not starting with '.' or '-', no '..' "
                "or '--')"
            )
    revision = match[3]
    if revision is not None and (
        not _HF_REVISION_RE.fullmatch(revision) or ".." in revision or len(revision) > 200
    ):
        raise SourceError(
            f"invalid source {source!r}: {revision!r} is not a revision (a branch, tag or "
            "commit: letters, digits, '_', '-', '.', '+' and '/' between parts, no part "
            "starting with '.', no '..')"
        )
    return f"{match[1]}/{match[2]}", revision


def parse_http(source: str) -> tuple[str, str | None]:
    """``http(s)://…/FILE[#sha256=HEX]`` -> (URL without the fragment, checksum or None)."""
    url, _, fragment = source.partition("#")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise SourceError(f"invalid source {source!r}: not an http(s) URL with a host")
    name = _file_name(url)
    if not name:
        raise SourceError(f"invalid source {source!r}: the URL must name a file")
    if not _FILE_NAME_RE.fullmatch(name):
        raise SourceError(
            f"invalid source {source!r}: the file name {name!r} cannot be kept in the cache "
            "(use letters, digits and '_.+=,@~-', not starting with '.' or '-')"
        )
    checksum = None
    if fragment:
        match = _SHA_RE.match(fragment)
        if match is None:
            raise SourceError(
                f"invalid source {source!r}: the fragment must be #sha256= and 64 hex digits"
            )
        checksum = match[1].lower()
    return url, checksum


def check_syntax(source: str) -> None:
    """Raise :class:`SourceError` for a malformed hf:// or http(s):// source."""
    kind = classify(source)
    if kind == "hf":
        parse_hf(source)
    elif kind == "http":
        parse_http(source)


def _file_name(url: str) -> str:
    name = unquote(urlsplit(url).path.rsplit("/", 1)[-1])
    return "" if name in ("", ".", "..") else name


def weights_size(path: Path) -> int | None:
    """Bytes of a model's weights at ``path``: a file's size; for a directory the total of
    its safetensors and GGUF files (else .bin/.pt files, else every file)."""
    try:
        if path.is_file():
            return path.stat().st_size
        if not path.is_dir():
            return None
        files = [p for p in path.rglob("*") if p.is_file()]
        for suffixes in (_WEIGHT_SUFFIXES, _OTHER_WEIGHT_SUFFIXES):
            chosen = [p for p in files if p.name.endswith(suffixes)]
            if chosen:
                return sum(p.stat().st_size for p in chosen)
        return sum(p.stat().st_size for p in files) or None
    except OSError:
        return None


@dataclass
class FetchStatus:
    """Where a source's fetch stands, as plain data (it travels as JSON from an agent)."""

    source: str
    state: str = "running"  # running, done or failed
    done_bytes: int = 0
    total_bytes: int | None = None
    rate_bytes_per_second: float = 0.0
    eta_seconds: float | None = None
    path: str = ""
    size_bytes: int | None = None
    error: str = ""
    downloaded: bool = False  # whether this took a download (not a local path or a cache hit)
    _samples: list[tuple[float, int]] = field(default_factory=list, repr=False)

    def as_dict(self) -> dict[str, object]:
        data = asdict(self)
        data.pop("_samples")
        return data

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> FetchStatus:
        names = {f for f in cls.__dataclass_fields__ if not f.startswith("_")}
        return cls(**{k: v for k, v in data.items() if k in names})  # type: ignore[arg-type]

    def advance(self, done: int, total: int | None) -> None:
        """Record progress; the rate is over the last ~5 s."""
        now = time.monotonic()
        self.done_bytes, self.total_bytes = done, total
        self._samples.append((now, done))
        while len(self._samples) > 2 and now - self._samples[0][0] > 5:
            self._samples.pop(0)
        first_at, first_done = self._samples[0]
        if now > first_at:
            self.rate_bytes_per_second = (done - first_done) / (now - first_at)
        if total is not None and self.rate_bytes_per_second > 0:
            self.eta_seconds = max(total - done, 0) / self.rate_bytes_per_second


class SourceCache:
    """This host's downloads under ``root``, one fetch per source at a time."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._jobs: dict[str, FetchStatus] = {}
        self._lock = threading.Lock()

    # -- fetching ---------------------------------------------------------------------------

    def start(self, source: str) -> FetchStatus:
        """Begin fetching ``source`` unless a fetch of it is under way; return its status.
        A finished or failed earlier fetch is started afresh (files may have changed).
        A local path or a bare name needs no download: it is settled before this returns,
        so a start does not wait a polling interval for it."""
        if classify(source) in ("local", "engine"):
            settled = FetchStatus(source=source)
            self._run(settled)
            return settled
        with self._lock:
            under_way = self._jobs.get(source)
            if under_way is not None and under_way.state == "running":
                return under_way
            job = self._jobs[source] = FetchStatus(source=source)
        threading.Thread(target=self._run, args=(job,), name="fetch", daemon=True).start()
        return job

    def status(self, source: str) -> FetchStatus | None:
        with self._lock:
            return self._jobs.get(source)

    def fetch(self, source: str, timeout: float | None = None) -> FetchStatus:
        """Start (or join) the fetch and wait for its end."""
        job = self.start(source)
        deadline = None if timeout is None else time.monotonic() + timeout
        while job.state == "running":
            if deadline is not None and time.monotonic() > deadline:
                break
            time.sleep(0.05)
        return job

    def _run(self, job: FetchStatus) -> None:
        try:
            kind = classify(job.source)
            if kind == "engine":
                job.path = job.source  # the engine resolves it; nothing to check here
            elif kind == "local":
                path = Path(job.source).expanduser()
                if not path.exists():
                    raise SourceError(f"the local source {job.source} does not exist" + LOCAL_HINT)
                job.path = str(path)
            elif kind == "http":
                job.path = str(self._fetch_http(job))
            else:
                job.path = str(self._fetch_hf(job))
            if kind != "engine":
                job.size_bytes = weights_size(Path(job.path))
            job.state = "done"
        except SourceError as exc:
            job.error, job.state = str(exc), "failed"
        except Exception as exc:  # a bug or an unexpected library error: still one line
            logger.exception("fetching %s failed", job.source)
            job.error, job.state = f"{type(exc).__name__}: {exc}", "failed"

    @contextlib.contextmanager
    def _locked(self, directory: Path) -> Iterator[None]:
        """One fetch per download directory across processes (an agent restarted mid-way,
        or two processes sharing a cache)."""
        directory.mkdir(parents=True, exist_ok=True)
        with (directory / ".lock").open("a") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    # -- HTTP -------------------------------------------------------------------------------

    def http_dir(self, url: str) -> Path:
        return self.root / "http" / hashlib.sha256(url.encode()).hexdigest()[:20]

    def inside(self, path: Path) -> Path:
        """``path`` if it lies under the cache once resolved (links included), else a
        :class:`SourceError`: a download never writes anywhere else."""
        root = self.root.resolve()
        if not path.resolve().is_relative_to(root):
            raise SourceError(f"{path} would lie outside this host's cache ({root})")
        return path

    def _fetch_http(self, job: FetchStatus) -> Path:
        import httpx  # noqa: PLC0415 - kept off the listings' start-up, which read this module

        url, checksum = parse_http(job.source)
        directory = self.http_dir(url)
        final = self.inside(directory / _file_name(url))
        part = self.inside(final.with_name(final.name + ".part"))
        with self._locked(directory):
            (directory / ".source").write_text(url + "\n")  # the file, whatever checksum
            if final.exists():
                if checksum is not None and _file_sha256(final) != checksum:
                    # Another source with this URL downloaded it; this one expects other
                    # bytes. The file is someone's verified download: it stays.
                    raise SourceError(
                        f"checksum mismatch for {url}: expected sha256 {checksum}, got "
                        f"{_file_sha256(final)} (the file already in the cache)"
                    )
                job.advance(final.stat().st_size, final.stat().st_size)
                return final
            job.downloaded = True
            digest = hashlib.sha256()
            have = part.stat().st_size if part.exists() else 0
            if have:
                with part.open("rb") as existing:
                    for block in iter(lambda: existing.read(_CHUNK), b""):
                        digest.update(block)
            headers = {"Range": f"bytes={have}-"} if have else {}
            total: int | None = None
            try:
                with httpx.stream("GET", url, headers=headers, follow_redirects=True,
                                  timeout=httpx.Timeout(30.0, read=120.0)) as answer:  # fmt: skip
                    if answer.status_code == 416 and have:  # the part is already whole
                        total = have
                    elif answer.status_code not in (200, 206):
                        raise SourceError(f"downloading {url} failed: HTTP {answer.status_code}")
                    else:
                        if answer.status_code == 200 and have:  # no resume: start over
                            have, digest = 0, hashlib.sha256()
                        length = answer.headers.get("content-length")
                        total = have + int(length) if length and length.isdigit() else None
                        with part.open("ab" if have else "wb") as out:
                            done = have
                            for block in answer.iter_bytes():  # as it arrives
                                out.write(block)
                                digest.update(block)
                                done += len(block)
                                job.advance(done, total)
                        if total is not None and done != total:
                            raise SourceError(
                                f"downloading {url} stopped at {done} of {total} bytes; "
                                "the next start resumes it"
                            )
            except httpx.HTTPError as exc:
                raise SourceError(
                    f"downloading {url} failed: {type(exc).__name__}: {exc}; the next start "
                    "resumes it"
                ) from None
            if checksum is not None and digest.hexdigest() != checksum:
                part.unlink(missing_ok=True)  # ours, and wrong: nothing usable is left
                raise SourceError(
                    f"checksum mismatch for {url}: expected sha256 {checksum}, got "
                    f"{digest.hexdigest()}; the download was discarded"
                )
            final.with_name(final.name + ".sha256").write_text(digest.hexdigest() + "\n")
            part.replace(final)
            job.advance(final.stat().st_size, final.stat().st_size)
            return final

    # -- Hugging Face -------------------------------------------------------------------------

    def _fetch_hf(self, job: FetchStatus) -> Path:
        from huggingface_hub import snapshot_download  # noqa: PLC0415 - heavy: loaded only for hf:// sources
        from huggingface_hub.errors import (  # noqa: PLC0415 - heavy: loaded only for hf:// sources
            DryRunError,
            GatedRepoError,
            LocalEntryNotFoundError,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )
        from huggingface_hub.utils import disable_progress_bars  # type: ignore[attr-defined]  # noqa: PLC0415 - heavy: loaded only for hf:// sources

        repo, revision = parse_hf(job.source)
        cache = self.root / "hf"
        folder = self.inside(cache / f"models--{repo.replace('/', '--')}")
        endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
        disable_progress_bars()  # progress goes to the status, not to stderr
        try:
            total: int | None = None
            try:
                planned = snapshot_download(repo, revision=revision, cache_dir=cache, dry_run=True)
            except DryRunError as exc:  # the Hub is unreachable, or said why not
                if isinstance(exc.__cause__, (RepositoryNotFoundError, RevisionNotFoundError)):
                    raise exc.__cause__ from None
            else:
                missing = (
                    [f for f in planned if f.will_download] if isinstance(planned, list) else []
                )
                total = sum(f.file_size or 0 for f in missing)
                job.downloaded = bool(missing)
            with self._locked(cache / ".locks" / folder.name):
                watcher = _SizeWatcher(folder, job, total)
                watcher.start()
                try:
                    path = snapshot_download(repo, revision=revision, cache_dir=cache)
                finally:
                    watcher.stop()
        except GatedRepoError:  # before its base class, RepositoryNotFoundError
            raise SourceError(
                f"{job.source}: the repository is gated; accept its terms and set HF_TOKEN"
            ) from None
        except RepositoryNotFoundError:
            raise SourceError(
                f"{job.source}: no such repository at {endpoint} (or it is private and "
                "HF_TOKEN is missing)"
            ) from None
        except RevisionNotFoundError:
            raise SourceError(f"{job.source}: no such revision in the repository") from None
        except LocalEntryNotFoundError:
            raise SourceError(
                f"{job.source}: not in this host's cache, and the Hub cannot be reached "
                "(offline mode or no connection)"
            ) from None
        result = Path(str(path))
        size = weights_size(result) or 0
        job.advance(size, size)
        return result

    # -- removing downloads -----------------------------------------------------------------

    def downloads(self) -> list[tuple[str, Path, int]]:
        """Every download in the cache: (source, directory, bytes)."""
        found: list[tuple[str, Path, int]] = []
        http = self.root / "http"
        if http.is_dir():
            for directory in sorted(p for p in http.iterdir() if p.is_dir()):
                marker = directory / ".source"
                source = marker.read_text().strip() if marker.exists() else ""
                found.append((source, directory, _tree_size(directory)))
        hf = self.root / "hf"
        if hf.is_dir():
            for directory in sorted(hf.glob("models--*")):
                repo = directory.name[len("models--") :].replace("--", "/", 1)
                found.append((f"hf://{repo}", directory, _tree_size(directory)))
        return found

    def prune(self, keep: Collection[str], *, dry_run: bool = False) -> list[tuple[str, str, int]]:
        """Remove downloads no source in ``keep`` uses (hf:// sources match at any
        revision). Returns (source, path, bytes) of what was (or would be) removed; never
        touches anything outside the cache."""
        kept_http = {parse_http(s)[0] for s in keep if classify(s) == "http"}
        kept_hf = {parse_hf(s)[0] for s in keep if classify(s) == "hf"}
        removed: list[tuple[str, str, int]] = []
        for source, directory, size in self.downloads():
            if classify(source) == "http" and parse_http(source)[0] in kept_http:
                continue
            if classify(source) == "hf" and parse_hf(source)[0] in kept_hf:
                continue
            with self._locked_if_idle(directory) as idle:
                if not idle:
                    continue  # a fetch is using it now
                if not dry_run:
                    shutil.rmtree(directory)
            removed.append((source, str(directory), size))
        return removed

    def listing(self) -> list[dict[str, object]]:
        """:meth:`downloads` as plain data."""
        return [{"source": s, "path": str(p), "bytes": n} for s, p, n in self.downloads()]

    def prune_listing(self, keep: Collection[str], dry_run: bool) -> list[dict[str, object]]:
        """:meth:`prune` as plain data."""
        removed = self.prune(keep, dry_run=dry_run)
        return [{"source": s, "path": p, "bytes": n} for s, p, n in removed]

    @contextlib.contextmanager
    def _locked_if_idle(self, directory: Path) -> Iterator[bool]:
        lock = directory / ".lock"
        if directory.parent.name == "hf":
            lock = directory.parent / ".locks" / directory.name / ".lock"
        if not lock.exists():
            yield True
            return
        with lock.open("a") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                yield False
                return
            try:
                yield True
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)


def _file_sha256(path: Path) -> str:
    """A downloaded file's sha256, from the note written when it was downloaded (else
    computed, and noted)."""
    note = path.with_name(path.name + ".sha256")
    if note.exists() and note.stat().st_mtime >= path.stat().st_mtime:
        return note.read_text().strip()
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(_CHUNK), b""):
            digest.update(block)
    note.write_text(digest.hexdigest() + "\n")
    return digest.hexdigest()


def _tree_size(directory: Path) -> int:
    total = 0
    for path in directory.rglob("*"):
        with contextlib.suppress(OSError):
            if path.is_file() and not path.is_symlink():
                total += path.stat().st_size
    return total


class _SizeWatcher:
    """Progress of a Hugging Face download, read from the bytes landing in its folder."""

    def __init__(self, folder: Path, job: FetchStatus, total: int | None) -> None:
        self.folder, self.job, self.total = folder, job, total
        self._stop = threading.Event()
        self._base = _tree_size(folder) if folder.exists() else 0
        self._thread = threading.Thread(target=self._watch, name="fetch-progress", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        while not self._stop.wait(0.5):
            landed = _tree_size(self.folder) if self.folder.exists() else 0
            self.job.advance(max(landed - self._base, 0), self.total)
