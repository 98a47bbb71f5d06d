"""Model downloads stay in the cache: a source whose file name, repository or revision
would lead outside it is refused in one line, and nothing is written anywhere else."""

from __future__ import annotations

import pytest

from capyctl.deployments.models import Deployment
from capyctl.engines.services import add_engine
from capyctl.scheduler import actions, errors
from hostagent.sources import SourceCache, SourceError, check_syntax
from tests.fakes import FileServer
from tests.scheduling import SIM, SIM_ENV, deployment

# Each names a file on the server; percent-decoded, the name would climb out of the cache.
ATTACKS = [
    "/m/..%2F..%2F..%2Fescaped.gguf",
    "/m/..%2f..%2f..%2fescaped.gguf",
    "/m/%2e%2e%2F%2e%2e%2F%2e%2e%2Fescaped.gguf",
    "/m/%2E%2E%2F%2E%2E%2F%2E%2E%2Fescaped.gguf",
    "/m/..%5C..%5C..%5Cescaped.gguf",
    "/m/escaped.gguf%00.txt",
    "/m/%2Ebashrc",
    "/m/.part",
    "/m/%252e%252e%252fescaped.gguf",
]


@pytest.fixture
def attack_server():
    server = FileServer(dict.fromkeys(ATTACKS, b"owned\n"))
    yield server
    server.close()


def tree(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.mark.parametrize("path", ATTACKS)
def test_a_file_name_that_leaves_the_cache_is_refused_and_writes_nothing(
    attack_server, tmp_path, path
):
    root = tmp_path / "host" / "cache"
    root.mkdir(parents=True)
    before = tree(tmp_path)
    source = attack_server.url + path
    with pytest.raises(SourceError) as info:
        check_syntax(source)
    message = str(info.value)
    assert message.startswith(f"invalid source {source!r}: the file name ")
    assert "\n" not in message
    failed = SourceCache(root).fetch(source)
    assert (failed.state, failed.error) == ("failed", message)
    assert attack_server.requests == []  # refused before any download
    assert tree(tmp_path) == before  # no .part, no marker, no folder, here or above


def test_ordinary_file_names_still_download(attack_server, tmp_path):
    attack_server.files["/m/Qwen2.5-0.5B-Instruct-Q4_K_M.gguf"] = b"weights"
    attack_server.files["/m/model%2B1.gguf"] = b"plus"
    cache = SourceCache(tmp_path)
    qwen = "Qwen2.5-0.5B-Instruct-Q4_K_M.gguf"
    for path, name in [(f"/m/{qwen}", qwen), ("/m/model%2B1.gguf", "model+1.gguf")]:
        done = cache.fetch(attack_server.url + path)
        assert done.state == "done", done.error
        assert done.path.endswith("/" + name)
        assert done.path.startswith(str(tmp_path / "http"))


@pytest.mark.parametrize(
    ("source", "words"),
    [
        ("hf://acme/..", "repository"),
        ("hf://acme/.hidden", "repository"),
        ("hf://acme/a..b", "repository"),
        ("hf://acme/a--b", "repository"),
        ("hf://acme/tiny@../../../etc/x", "revision"),
        ("hf://acme/tiny@refs/../../x", "revision"),
        ("hf://acme/tiny@/etc/x", "revision"),
        ("hf://acme/tiny@main//x", "revision"),
        ("hf://acme/tiny@.git", "revision"),
    ],
)
def test_hugging_face_names_that_could_leave_the_cache_are_refused(source, words):
    with pytest.raises(SourceError, match=f"^invalid source {source!r}: .*{words}"):
        check_syntax(source)


@pytest.mark.parametrize(
    "source",
    ["hf://acme/tiny", "hf://Qwen/Qwen2.5-0.5B-Instruct@main", "hf://acme/tiny@refs/pr/1",
     "hf://acme/tiny@v1.0", "hf://acme/tiny@" + "a" * 40],
)  # fmt: skip
def test_ordinary_hugging_face_sources_pass(source):
    check_syntax(source)


@pytest.mark.django_db(transaction=True)
def test_a_stored_source_that_leaves_the_cache_fails_the_start_with_the_reason(
    gpu24, attack_server
):
    add_engine("sim-vllm", kind="vllm", command=f"{SIM} vllm", env=SIM_ENV)
    model = deployment("sneaky", source=f"{attack_server.url}/m/ok.gguf")
    attack = attack_server.url + ATTACKS[0]
    Deployment.objects.filter(pk=model.pk).update(source=attack)  # stored by an older version
    before = tree(gpu24.sources.root.parent)
    with pytest.raises(errors.SourceError, match="the file name"):
        actions.ensure_ready(model.pk)
    row = Deployment.objects.get(pk=model.pk)
    assert row.observed_state == "failed"
    assert row.state_reason.startswith(f"invalid source {attack!r}: the file name ")
    assert attack_server.requests == []
    assert tree(gpu24.sources.root.parent) == before
