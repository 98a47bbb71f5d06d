"""The control client of one engine: its calls over a Unix socket or the loopback port."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hostagent.errors import EngineCallError

if TYPE_CHECKING:
    import httpx

LOOPBACK = "127.0.0.1"

# Engine control calls whose whole URL a client keeps (EngineClient._url): paths and
# parameter values of these characters only, and at most this many.
_PLAIN_PATH = re.compile(r"(/[A-Za-z0-9_.-]+)+")
_PLAIN_VALUE = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_KEPT_URLS = 32


class EngineClient:
    """Control calls to one engine on its Unix socket or loopback port (httpx: few calls,
    no hot path)."""

    def __init__(
        self,
        port: int,
        api_key: str,
        *,
        timeout: float = 30.0,
        socket_path: Path | None = None,
    ) -> None:
        import httpx  # noqa: PLC0415 - kinds are read by every command, calls are rare

        # Over a socket the host name is only what the Host header says.
        self.base_url = "http://localhost" if socket_path else f"http://{LOOPBACK}:{port}"
        self.socket_path = socket_path
        self.api_key = api_key
        self.closed = False
        self._urls: dict[tuple[Any, ...], httpx.URL] = {}
        self._client = httpx.Client(
            base_url=self.base_url,
            timeout=timeout,
            headers={"Authorization": f"Bearer {api_key}"},
            trust_env=False,
            # Engines speak plain HTTP on loopback. Skipping the CA bundle makes a client
            # cost about 1 ms instead of about 90 ms, which a switch would otherwise pay.
            verify=False,  # noqa: S501 - no TLS is ever used on this client
            transport=httpx.HTTPTransport(uds=str(socket_path)) if socket_path else None,
        )

    @property
    def http(self) -> httpx.Client:
        """The underlying client (its base URL, key and transport set)."""
        return self._client

    @contextlib.contextmanager
    def default_timeout(self, seconds: float) -> Iterator[None]:
        """Calls without their own timeout give up after ``seconds`` inside the block."""
        import httpx  # noqa: PLC0415 - kinds are read by every command, calls are rare

        previous = self._client.timeout
        self._client.timeout = httpx.Timeout(seconds)
        try:
            yield
        finally:
            self._client.timeout = previous

    def close(self) -> None:
        self.closed = True
        self._client.close()

    def request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: dict[str, Any] | None = None,
        timeout: float | None = None,
        expect: tuple[int, ...] = (200,),
        headers: dict[str, str] | None = None,
    ) -> httpx.Response:
        import httpx  # noqa: PLC0415 - kinds are read by every command, calls are rare

        if self.closed:
            raise EngineCallError(f"{method} {path}: the engine was stopped meanwhile")
        url, params = self._url(path, params)
        try:
            response = self._client.request(
                method,
                url,
                json=json,
                params=params,
                headers=headers,
                timeout=timeout if timeout is not None else httpx.USE_CLIENT_DEFAULT,
            )
        except httpx.HTTPError as exc:
            raise EngineCallError(f"{method} {path} failed: {type(exc).__name__}: {exc}") from exc
        except RuntimeError as exc:  # closed by a concurrent stop between the check and here
            raise EngineCallError(f"{method} {path}: the engine was stopped meanwhile") from exc
        if response.status_code not in expect:
            body = response.text[:300].strip()
            raise EngineCallError(
                f"{method} {path} answered {response.status_code}: {body}", response.status_code
            )
        return response

    def _url(self, path: str, params: dict[str, Any] | None) -> tuple[Any, dict[str, Any] | None]:
        """The call's URL and the parameters still to add: a plain path with plain
        parameters (``/sleep?level=1``) gets its whole URL made once (httpx parses a relative
        path against the base URL and merges the parameters at every call: a good part of a
        park's own time); anything else goes to httpx as given."""
        given = params or {}
        if not all(type(v) in (int, str) for v in given.values()):
            return path, params  # True, 1.0, lists: httpx writes each its own way
        key = (path, *sorted((k, type(v).__name__, v) for k, v in given.items()))
        url = self._urls.get(key)
        if url is not None:
            return url, None
        plain = _PLAIN_PATH.fullmatch(path) and all(
            _PLAIN_VALUE.fullmatch(str(v)) for v in given.values()
        )
        if not plain or len(self._urls) >= _KEPT_URLS:
            return path, params
        url = self._client.base_url.copy_with(raw_path=path.encode("ascii"))
        if params:
            url = url.copy_merge_params(params)
        self._urls[key] = url
        return url, None

    def healthy(self, path: str) -> bool:
        """Whether ``GET path`` answers 200 now (a refused connection is just "not yet")."""
        import httpx  # noqa: PLC0415 - kinds are read by every command, calls are rare

        if self.closed:
            return False
        try:
            return self._client.get(self._url(path, None)[0], timeout=2.0).status_code == 200
        except (httpx.HTTPError, RuntimeError):  # RuntimeError: closed by a concurrent stop
            return False
