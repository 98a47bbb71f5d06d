"""The host agent: joins a server once with a token, then serves its API over mutual TLS.

``capyctl start host --join TOKEN --listen ADDR`` runs :func:`join` (first time only) and
:func:`serve`. The agent's data dir keeps ``agent.key`` (0600), ``agent.crt``, ``ca.crt``
and ``agent.json`` (its host name and server); a restart needs no token. The API answers
only a caller whose client certificate chains to the server's CA and is made for client
authentication, which the CA grants the server's certificate and no host's.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import ssl
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, cast
from urllib.parse import quote

import aiohttp
import httpx
from aiohttp.client_exceptions import UnixClientConnectorError
from aiohttp.client_proto import ResponseHandler
from aiohttp.client_reqrep import ClientRequest
from aiohttp.tracing import Trace
from yarl import URL

from hostagent import routes, tls, wire
from hostagent.asgi import HOP_BY_HOP, cancel_on_disconnect, lifespan, send_json, tls_server
from hostagent.datadir import make_private_dir
from hostagent.errors import EngineError
from hostagent.host import HostRuntime
from hostagent.probe import Probe, make_probe
from hostagent.runtime import DEFAULT_RELEASE_SECONDS
from hostagent.simgpu import SIM_PIDS, SIM_PIDS_ENV, parse_sim_gpus
from hostagent.unixsock import connect_unix

logger = logging.getLogger("hostagent.agent")
_QUERY_SAFE = "".join(chr(c) for c in range(0x21, 0x7F) if chr(c) != "#")


class AgentError(Exception):
    """A mistake or refusal, said in one line (the token, the server, the files)."""


@dataclass(frozen=True)
class AgentFiles:
    directory: Path

    @property
    def key(self) -> Path:
        return self.directory / "agent.key"

    @property
    def cert(self) -> Path:
        return self.directory / "agent.crt"

    @property
    def ca(self) -> Path:
        return self.directory / "ca.crt"

    @property
    def identity(self) -> Path:
        return self.directory / "agent.json"

    def joined(self) -> bool:
        return self.identity.exists() and self.cert.exists() and self.key.exists()

    def host_name(self) -> str:
        return str(json.loads(self.identity.read_text())["host"])


def join(token_text: str, files: AgentFiles) -> str:
    """Enrol with the server named in the token; returns this host's name."""
    try:
        token = tls.JoinToken.decode(token_text)
    except ValueError as exc:
        raise AgentError(str(exc)) from None
    # The CA is fetched without trust, then trusted only if it is the one the token pins.
    unverified = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    unverified.check_hostname = False
    unverified.verify_mode = ssl.CERT_NONE
    try:
        ca_pem = httpx.get(f"{token.url}/ca", verify=unverified, timeout=15).content
    except httpx.HTTPError as exc:
        raise AgentError(f"cannot reach the server at {token.url}: {exc}") from None
    try:
        seen = tls.fingerprint(ca_pem)
    except ValueError:
        raise AgentError(f"{token.url}/ca did not answer with a certificate") from None
    if seen != token.fingerprint:
        raise AgentError(
            f"the server at {token.url} shows a CA with fingerprint {seen[:16]}…, not the "
            f"{token.fingerprint[:16]}… the token pins: refusing to trust it"
        )
    make_private_dir(files.directory)
    tls.write_private(files.ca, ca_pem)
    key = tls.make_key()
    body = {
        "host": token.host,
        "secret": token.secret,
        "csr": tls.make_csr(key, token.host).decode(),
    }
    try:
        with httpx.Client(verify=tls.client_context(files.ca), timeout=30) as client:
            answer = client.post(
                f"{token.url}/enrol", json=body, extensions={"sni_hostname": tls.SERVER_NAME}
            )
    except httpx.HTTPError as exc:
        raise AgentError(f"enrolment at {token.url} failed: {exc}") from None
    if answer.status_code != 200:
        try:
            reason = str(answer.json()["error"])
        except (ValueError, KeyError, TypeError):
            reason = f"HTTP {answer.status_code}"
        raise AgentError(f"the server refused to enrol {token.host}: {reason}")
    tls.write_private(files.key, tls.key_pem(key))
    tls.write_private(files.cert, str(answer.json()["certificate"]).encode())
    identity = json.dumps({"host": token.host, "server": token.url}) + "\n"
    tls.write_private(files.identity, identity.encode())
    return token.host


class AgentApp:
    """The agent's API (JSON over mTLS): the host runtime's calls, by instance id."""

    def __init__(self, host_name: str, host: HostRuntime) -> None:
        self.host_name = host_name
        self.host = host
        self.relay = Relay(host)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        method, path = scope["method"], str(scope["path"])
        if path.startswith("/relay/"):
            await self.relay.forward(scope, receive, send)
            return
        try:
            body = await _read_json(receive) if method == "POST" else {}
            status, answer = await self._route(method, path, body, scope)
        except EngineError as exc:
            status, answer = 409, {"error": wire.error_to_json(exc)}
        except (ValueError, KeyError, TypeError) as exc:
            status, answer = 400, {"error": {"type": "BadRequest", "message": str(exc)}}
        await send_json(send, status, answer)

    async def _route(  # noqa: PLR0911 - one answer a route
        self, method: str, path: str, body: dict[str, Any], scope: dict[str, Any]
    ) -> tuple[int, Any]:
        host = self.host
        run = asyncio.to_thread
        if (method, path) == ("GET", "/health"):
            return 200, {"host": self.host_name}
        if (method, path) == ("GET", "/inventory"):
            return 200, (await run(host.inventory)).as_dict()
        if (method, path) == ("GET", "/devices"):
            return 200, {"devices": [asdict(r) for r in await run(host.devices)]}
        if (method, path) == ("GET", "/foreign"):
            unified = scope.get("query_string", b"") == b"unified=1"
            return 200, await run(host.foreign, unified)
        if (method, path) == ("GET", "/instances"):
            return 200, {"ids": host.instance_ids()}
        if (method, path) == ("POST", "/instances"):
            return 200, (await run(host.launch, wire.request_from_json(body))).as_dict()
        if (method, path) == ("POST", "/sources/fetch"):
            return 200, (await run(host.fetch_start, str(body["source"]))).as_dict()
        if (method, path) == ("POST", "/sources/status"):
            job = host.fetch_status(str(body["source"]))
            return 200, {"status": job.as_dict() if job is not None else None}
        if (method, path) == ("GET", "/sources"):
            return 200, {"downloads": await run(host.downloads)}
        if (method, path) == ("POST", "/sources/prune"):
            keep = [str(s) for s in body["keep"]]
            return 200, {"removed": await run(host.prune, keep, bool(body["dry_run"]))}
        parts = path.strip("/").split("/")
        if len(parts) < 2 or parts[0] != "instances":
            return 404, {"error": {"type": "NotFound", "message": f"no route {method} {path}"}}
        return await self._instance_route(method, parts[1], "/".join(parts[2:]), body)

    async def _instance_route(  # noqa: PLR0911 - one answer a route
        self, method: str, ident: str, action: str, body: dict[str, Any]
    ) -> tuple[int, Any]:
        host = self.host
        run = asyncio.to_thread
        if (method, action) == ("GET", ""):
            code, tail = await run(host.exit_report, ident)
            return 200, {"known": host.known(ident), "alive": host.alive(ident),
                         "exit_code": code, "log_tail": tail}  # fmt: skip
        if (method, action) == ("GET", "usage"):
            return 200, wire.usage_to_json(await run(host.usage, ident))
        if (method, action) == ("GET", "asleep"):
            return 200, {"asleep": await run(host.asleep, ident)}
        if (method, action) == ("POST", "wait_ready"):
            return 200, {"seconds": await run(host.wait_ready, ident, float(body["timeout"]))}
        if (method, action) == ("POST", "park"):
            left = await run(host.park, ident, str(body["mode"]), float(body["timeout"]))
            return 200, wire.usage_to_json(left)
        if (method, action) == ("POST", "wake"):
            seconds = await run(host.wake, ident, str(body["mode"]), float(body["timeout"]))
            return 200, {"seconds": seconds}
        if (method, action) == ("POST", "stop"):
            return 200, {"exit_code": await run(host.stop, ident, float(body["grace_seconds"]))}
        if (method, action) == ("POST", "adapters/load"):
            name, source = str(body["name"]), str(body["source"])
            seconds = await run(host.load_adapter, ident, name, source, float(body["timeout"]))
            return 200, {"seconds": seconds}
        if (method, action) == ("POST", "adapters/unload"):
            await run(host.unload_adapter, ident, str(body["name"]))
            return 200, {}
        if (method, action) == ("GET", "adapters"):
            return 200, {"loaded": await run(host.loaded_adapters, ident)}
        message = f"no route {method} /instances/{ident}/{action}"
        return 404, {"error": {"type": "NotFound", "message": message}}


class PatientUnixConnector(aiohttp.UnixConnector):
    """aiohttp's connector to a Unix socket, waiting while the engine's accept queue is
    full (:mod:`hostagent.unixsock`) instead of failing the request at once."""

    async def _create_connection(
        self, req: ClientRequest, traces: list[Trace], timeout: aiohttp.ClientTimeout
    ) -> ResponseHandler:
        try:
            sock = await connect_unix(self.path, timeout.sock_connect or 10.0)
        except OSError as exc:
            raise UnixClientConnectorError(self.path, req.connection_key, exc) from exc
        try:
            _, protocol = await self._loop.create_unix_connection(self._factory, sock=sock)
        except OSError as exc:
            sock.close()
            raise UnixClientConnectorError(self.path, req.connection_key, exc) from exc
        return protocol


class Relay:
    """``/relay/{instance}/v1/...``: the server's ``/v1`` requests, streamed to the
    instance's Unix socket or loopback port and back unbuffered (the gateway's data-path
    rules: aiohttp, no decompression, no retries; a server that hangs up cancels the
    engine's request).

    The path is checked again against the OpenAI routes (:mod:`hostagent.routes`), so not
    even the server, compromised or wrong, reaches an engine's other routes through it."""

    MAX_BODY = 64 * 1024 * 1024

    def __init__(self, host: HostRuntime) -> None:
        self.host = host
        # One session for loopback ports, one per engine socket ("" is the TCP one's key).
        self._sessions: dict[str, aiohttp.ClientSession] = {}
        self._closing: set[asyncio.Future[None]] = set()

    def _client(self, socket_path: str = "") -> aiohttp.ClientSession:
        session = self._sessions.get(socket_path)
        if session is None or session.closed:
            if socket_path:
                self._forget_ended()
            connector: aiohttp.BaseConnector = (
                PatientUnixConnector(path=socket_path, limit=0)
                if socket_path
                else aiohttp.TCPConnector(limit=0)
            )
            session = self._sessions[socket_path] = aiohttp.ClientSession(
                connector=connector,
                auto_decompress=False,
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
            )
        return session

    def _forget_ended(self) -> None:
        """Close the sessions of sockets no engine here listens on any more."""
        live = {str(i.socket_path) for i in self.host.instances() if i.socket_path}
        for path in [p for p in self._sessions if p and p not in live]:
            session = self._sessions.pop(path)
            closing = asyncio.ensure_future(session.close())
            self._closing.add(closing)
            closing.add_done_callback(self._closing.discard)

    async def forward(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        path = str(scope["path"])
        raw = scope.get("raw_path") or path.encode()
        raw_parts = raw.split(b"/", 3)  # "", "relay", instance, "v1/..."
        parts = path.split("/", 3)
        ident = parts[2] if len(parts) > 2 else ""
        try:
            if len(raw_parts) < 4 or len(parts) < 4 or raw_parts[2] != ident.encode():
                raise routes.RouteError(400, "invalid_path", "Not /relay/INSTANCE/v1/...")
            target = routes.resolve(b"/" + raw_parts[3], "/" + parts[3])
            if target.kind == "models":  # the server answers it; engines are not asked
                message = f"`{routes.MODELS}` is the server's to answer: not relayed."
                raise routes.RouteError(404, "unknown_route", message)
        except routes.RouteError as refused:
            await send_json(send, refused.status, refused.as_json())
            return
        instance = self.host.instance(ident)
        if instance is None:
            error = routes.RouteError(404, "unknown_instance", f"No instance {ident} here.")
            await send_json(send, 404, error.as_json())
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if len(body) > self.MAX_BODY:
                too_large = routes.RouteError(413, "request_too_large", "The body is too large.")
                await send_json(send, 413, too_large.as_json())
                return
            if not message.get("more_body"):
                break
        # Built from the checked route, marked as encoded: aiohttp re-reads nothing.
        query = quote(scope.get("query_string", b"").decode("latin-1"), safe=_QUERY_SAFE)
        socket_path = str(instance.socket_path or "")
        if socket_path:  # the host name only fills the Host header
            url = URL.build(scheme="http", host="localhost", path=target.path,
                            query_string=query, encoded=True)  # fmt: skip
        else:
            url = URL.build(scheme="http", host="127.0.0.1", port=instance.port,
                            path=target.path, query_string=query, encoded=True)  # fmt: skip
        given = {k.lower(): v for k, v in scope["headers"]}
        headers = [(k.decode("latin-1"), v.decode("latin-1"))
                   for k, v in routes.forwarded_headers(given)]  # fmt: skip
        this = cast("asyncio.Task[None]", asyncio.current_task())
        gone = asyncio.Event()
        watcher = asyncio.ensure_future(cancel_on_disconnect(receive, this, gone))
        try:
            await self._stream(scope["method"], url, headers, body, send, socket_path=socket_path)
        except asyncio.CancelledError:
            if not gone.is_set():
                raise
            this.uncancel()
        finally:
            watcher.cancel()

    async def _stream(
        self,
        method: str,
        url: URL,
        headers: list[tuple[str, str]],
        body: bytes,
        send: Any,
        *,
        socket_path: str = "",
    ) -> None:
        try:
            request = self._client(socket_path).request(method, url, data=body, headers=headers)
            upstream = await request.__aenter__()
        except (aiohttp.ClientError, TimeoutError) as exc:
            logger.warning("%s %s: the engine did not answer: %s", method, url, exc)
            error = routes.RouteError(
                502, "engine_failed", "The engine did not answer.", "server_error"
            )
            await send_json(send, 502, error.as_json())
            return
        try:
            out = [(k, v) for k, v in upstream.raw_headers if k.lower() not in HOP_BY_HOP]
            await send({"type": "http.response.start", "status": upstream.status, "headers": out})
            async for chunk in upstream.content.iter_any():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            upstream.release()

    async def close(self) -> None:
        sessions, self._sessions = self._sessions, {}
        for session in sessions.values():
            await session.close()


async def _read_json(receive: Any) -> dict[str, Any]:
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    data = json.loads(body or b"{}")
    if not isinstance(data, dict):
        raise ValueError("the body must be a JSON object")
    return data


def probe_from_env(files: AgentFiles) -> Probe:
    """Simulated GPUs with ``CAPYCTL_SIM_GPUS`` (tests, demos; ``CAPYCTL_SIM_PIDS``: how
    their processes are listed), else NVML, else none.

    The simulation is kept in ``CAPYCTL_SIM_STATE_DIR``, by default ``sim-gpus`` in the
    agent's data dir: two agents on one machine each have their own devices."""
    sim = os.environ.get("CAPYCTL_SIM_GPUS")
    state_dir = os.environ.get("CAPYCTL_SIM_STATE_DIR")
    pids = os.environ.get(SIM_PIDS_ENV) or "own"
    if pids not in SIM_PIDS:
        raise AgentError(f"{SIM_PIDS_ENV}={pids!r} must be one of: {', '.join(SIM_PIDS)}")
    try:
        spec = parse_sim_gpus(sim, pids) if sim else None
    except ValueError as exc:
        raise AgentError(f"CAPYCTL_SIM_GPUS: {exc}") from None
    return make_probe(spec, Path(state_dir) if state_dir else files.directory / "sim-gpus")


def serve(
    files: AgentFiles, host: str, port: int, *, release_timeout: float = DEFAULT_RELEASE_SECONDS
) -> None:
    """Serve the agent API on ``host:port`` with mutual TLS until SIGTERM or Ctrl-C."""
    if not files.joined():
        raise AgentError(f"{files.directory} holds no enrolment: start with --join TOKEN")
    name = files.host_name()
    context = tls.server_context(files.cert, files.key, files.ca, require_client=True)
    runtime = HostRuntime(
        probe_from_env(files),
        files.directory / "logs",
        state_file=files.directory / "instances.json",
        release_timeout=release_timeout,
    )
    for ident in runtime.restore():  # engines outlive a crashed or killed agent
        logger.warning("serving engine %s again after a restart", ident)
    server = tls_server(AgentApp(name, runtime), host, port, context)
    logger.warning("host agent %s serving on %s:%d (mutual TLS)", name, host, port)
    # uvicorn re-raises the stopping signal after its shutdown; a no-op handler for
    # SIGTERM lets run() return, so a stopped agent exits 0.
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        server.run()
    finally:
        signal.signal(signal.SIGTERM, previous)
        runtime.stop_all()
