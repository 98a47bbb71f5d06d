"""TensorFold: ``serve SOURCE --name NAME``, ready when ``/health`` answers 200. Without
its sleep API (below) it cannot park, so it is stopped to make room and started again on
its next request.

The key is in ``TENSORFOLD_API_KEY``, which releases with API keys read (beside
``--api-key`` and ``--api-key-file``); older releases have no keys and ignore it, so they
serve on loopback without one, as they always did.

Sleep: where the installed TensorFold's ``serve --help`` lists ``--enable-sleep-mode``
(its prototype sleep API, :mod:`hostagent.versions` reads the help), it is launched with
it and a sleep token CapyCTL makes, in ``TENSORFOLD_SLEEP_TOKEN`` (never on the command
line), and its models park ``deep``: ``POST /sleep?level=2`` drops the weights and caches,
``POST /wake_up`` reloads them; both are confirmed with ``GET /is_sleeping``, and a wake
is done when it says ``ready`` (``/health`` is 200 while it sleeps). Elsewhere they are
stopped, as before.

TensorFold's ``--host`` takes an address only (``cli_args.py``): it cannot listen on a Unix
socket, so it listens on loopback TCP, where its API key and sleep token guard its routes."""

from __future__ import annotations

import hashlib
import hmac
import math
from typing import Any

from hostagent.errors import CannotParkError
from hostagent.kinds.base import (
    RESERVED_FLAGS,
    Capabilities,
    LaunchSpec,
    ProgramKind,
    loopback_flags,
    wait_until,
)
from hostagent.kinds.client import EngineClient
from hostagent.versions import EngineFeatures, ProbeCommands

# The cap on TensorFold's memory budget, in GiB (``cuda/capacity.py``: the budget is
# min(free memory less a reserve of max(4 GiB, a tenth of the card), this cap); the MLX
# build reads TENSORFOLD_MEMORY_LIMIT_GB the same way). The budget is its weights and
# caches: the CUDA context and the runtime's own buffers come on top, so the cap is the
# claim less CONTEXT_ALLOWANCE_BYTES, rounded down to 0.01 GiB.
CUDA_LIMIT_VARIABLE = "TENSORFOLD_CUDA_MEMORY_LIMIT_GB"
MLX_LIMIT_VARIABLE = "TENSORFOLD_MEMORY_LIMIT_GB"
CONTEXT_ALLOWANCE_BYTES = 512 * 1024**2
GIB = 1024**3
SLEEP_FLAG = "--enable-sleep-mode"
SLEEP_TOKEN_VARIABLE = "TENSORFOLD_SLEEP_TOKEN"  # noqa: S105 - a variable's name
# A reload verifies the whole checkpoint's SHA-256 before it loads it: minutes, for big ones.
SLEEP_SECONDS = 300.0


def sleep_token(spec: LaunchSpec) -> str:
    """The launch's sleep token: made from its launch key, so an agent that adopts the
    engine after a restart knows it too, and distinct from it."""
    return hmac.new(spec.api_key.encode(), b"tensorfold-sleep", hashlib.sha256).hexdigest()


def limit_gib(claim_bytes: int) -> float:
    """The budget cap for a claim per GPU: the claim less the context allowance, in GiB
    rounded down to 0.01 (never above the claim; at least 0.01, the engine refuses 0)."""
    hundredths = math.floor((claim_bytes - CONTEXT_ALLOWANCE_BYTES) * 100 / GIB)
    return max(hundredths, 1) / 100


def _operator_limit(env: dict[str, str], name: str) -> float | None:
    """A positive finite GiB figure the engine's own env sets for ``name``, else None."""
    try:
        value = float(env.get(name, ""))
    except ValueError:
        return None
    return value if math.isfinite(value) and value > 0 else None


def has_sleep(features: EngineFeatures | None) -> bool:
    return features is not None and features.has(SLEEP_FLAG)


class TensorFoldKind(ProgramKind):
    name = "tensorfold"
    description = "TensorFold server"
    reserved_flags = (
        *RESERVED_FLAGS,
        "--api-key-file",
        "--name",
        SLEEP_FLAG,  # CapyCTL sets it where the engine has it, with its own token
        "--sleep-token-env",
    )
    probes = ProbeCommands(help=["serve", "--help"])
    # ``serve`` asks GitHub for a newer release unless this is set (``update.py``); releases
    # without the check ignore it, where ``--no-update-check`` would make them exit.
    quiet_env = (("TENSORFOLD_NO_UPDATE_CHECK", "1"),)

    def capabilities(
        self, options: dict[str, Any], features: EngineFeatures | None = None
    ) -> Capabilities:
        return Capabilities(deep=has_sleep(features))

    def engine_flags(self, spec: LaunchSpec) -> list[str]:
        return [
            "serve",
            spec.source,
            "--name",
            spec.served_name,
            *loopback_flags(spec),
            *([SLEEP_FLAG] if has_sleep(spec.features) else []),
        ]

    def cap_env(self, spec: LaunchSpec) -> dict[str, str]:
        """Both budget caps from the claim; an operator's own lower value stays."""
        if spec.claim_bytes is None:
            return {}
        ours = limit_gib(spec.claim_bytes)
        caps = {}
        for name in (CUDA_LIMIT_VARIABLE, MLX_LIMIT_VARIABLE):
            theirs = _operator_limit(spec.env, name)
            caps[name] = spec.env[name] if theirs is not None and theirs <= ours else f"{ours:.2f}"
        return caps

    def key_env(self, spec: LaunchSpec) -> dict[str, str]:
        env = {"TENSORFOLD_API_KEY": spec.api_key}
        if has_sleep(spec.features):
            env[SLEEP_TOKEN_VARIABLE] = sleep_token(spec)
        return env

    # -- the prototype sleep API (level 2 only) -----------------------------------------------

    def _lifecycle(self, client: EngineClient, spec: LaunchSpec) -> dict[str, Any]:
        answer = client.request("GET", "/is_sleeping", headers=self._auth(spec)).json()
        return answer if isinstance(answer, dict) else {}

    def _auth(self, spec: LaunchSpec) -> dict[str, str]:
        return {"Authorization": f"Bearer {sleep_token(spec)}"}

    def asleep(self, client: EngineClient, spec: LaunchSpec) -> bool | None:
        if not has_sleep(spec.features):
            return None
        return bool(self._lifecycle(client, spec).get("is_sleeping"))

    def park(self, client: EngineClient, spec: LaunchSpec, mode: str) -> None:
        if mode != "deep" or not has_sleep(spec.features):
            raise self._refuse(mode, spec)
        client.request(
            "POST", "/sleep", params={"level": 2}, headers=self._auth(spec), timeout=SLEEP_SECONDS
        )
        wait_until(
            lambda: bool(self._lifecycle(client, spec).get("is_sleeping")),
            SLEEP_SECONDS,
            "TensorFold to report is_sleeping",
        )

    def wake(self, client: EngineClient, spec: LaunchSpec, mode: str) -> None:
        if mode != "deep" or not has_sleep(spec.features):
            raise self._refuse(mode, spec)
        client.request("POST", "/wake_up", headers=self._auth(spec), timeout=SLEEP_SECONDS)
        wait_until(
            lambda: self._lifecycle(client, spec).get("ready") is True,
            SLEEP_SECONDS,
            "TensorFold to report it is ready",
        )

    def _refuse(self, mode: str, spec: LaunchSpec) -> CannotParkError:
        if has_sleep(spec.features):
            return CannotParkError("tensorfold can park only deep (its sleep API has level 2 only)")
        return CannotParkError(
            f"tensorfold cannot park here: its serve --help does not list {SLEEP_FLAG}; "
            "stop it to free its memory"
        )
