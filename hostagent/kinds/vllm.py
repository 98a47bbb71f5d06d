"""vLLM: ``vllm serve`` with sleep mode.

Level 1 sleep offloads weights to host RAM and drops the KV cache (our ``ram`` park);
level 2 drops both (``deep``). The sleep routes exist only with ``--enable-sleep-mode``
and ``VLLM_SERVER_DEV_MODE=1``, and the API key does not guard them (only ``/v1`` and a
few other prefixes): where ``vllm serve --help=all`` lists ``--uds`` it is launched on a
Unix socket in its 0700 run dir (vLLM then ignores ``--host`` and ``--port``), which no
other local user can open; older releases listen on loopback, where any local user could
reach those routes, and reconcile notices a park CapyCTL did not ask for. A 200 from
``/sleep`` is not trusted alone: ``/is_sleeping`` must agree, and the runtime confirms the
release with the GPU probe.

The key is in ``VLLM_API_KEY``, which vLLM's server reads when no ``--api-key`` is given
(``args.api_key or envs.VLLM_API_KEY``), never on the command line.
"""

from __future__ import annotations

from hostagent.kinds.base import (
    RESERVED_FLAGS,
    EngineClient,
    LaunchSpec,
    ProgramKind,
    fraction_flag,
    has_uds,
    one_token_completion,
    uds_flags,
    wait_until,
)
from hostagent.kinds.media import FLAG as MEDIA_FLAG
from hostagent.kinds.media import media_domain_flags
from hostagent.versions import EngineFeatures, ProbeCommands

SLEEP_LEVELS = {"ram": 1, "deep": 2}


def flag_spelling(given: str) -> str:
    """The flag vLLM reads ``given`` as (``utils/argparse_utils.py``): ``_`` for ``-`` up to
    the first ``.``, ``--x.y`` a key of the JSON flag ``--x``, ``-O3`` ``--optimization-level``."""
    if given.startswith("--"):
        return "--" + given[2:].split(".", 1)[0].replace("_", "-")
    if given.startswith("-O"):
        return "--optimization-level"
    return given


class VLLMKind(ProgramKind):
    name = "vllm"
    description = "vLLM OpenAI server with sleep mode"
    reserved_flags = (
        *RESERVED_FLAGS,
        "--uds",
        "--served-model-name",
        "--enable-sleep-mode",
        MEDIA_FLAG,  # the deployment's media domains say it
    )
    # vLLM reports usage to stats.vllm.ai unless one of these is 1 (``usage/usage_lib.py``).
    quiet_env = (("VLLM_NO_USAGE_STATS", "1"), ("VLLM_DO_NOT_TRACK", "1"))
    park_modes = ("ram", "deep")
    # ``serve --help`` lists vLLM's config groups only; ``--help=all`` every flag.
    probes = ProbeCommands(help=["serve", "--help=all"], help_timeout=90.0, spelling=flag_spelling)

    def engine_flags(self, spec: LaunchSpec) -> list[str]:
        return [
            "serve",
            spec.source,
            "--served-model-name",
            spec.served_name,
            *uds_flags(spec),
            "--enable-sleep-mode",
            *fraction_flag(spec, "--gpu-memory-utilization"),
            *media_domain_flags(spec),
        ]

    def socket_listening(self, features: EngineFeatures | None) -> bool:
        return has_uds(features)

    def extra_env(self, spec: LaunchSpec) -> dict[str, str]:
        return {"VLLM_SERVER_DEV_MODE": "1"}

    def key_env(self, spec: LaunchSpec) -> dict[str, str]:
        return {"VLLM_API_KEY": spec.api_key}

    def warm_up(self, client: EngineClient, spec: LaunchSpec) -> None:
        one_token_completion(client, spec)

    def _sleeping(self, client: EngineClient) -> bool:
        return bool(client.request("GET", "/is_sleeping").json().get("is_sleeping"))

    def asleep(self, client: EngineClient, spec: LaunchSpec) -> bool | None:
        return self._sleeping(client)

    def park(self, client: EngineClient, spec: LaunchSpec, mode: str) -> None:
        if mode not in SLEEP_LEVELS:
            raise self.refuse_park(mode)
        client.request("POST", "/sleep", params={"level": SLEEP_LEVELS[mode]})
        wait_until(lambda: self._sleeping(client), 60, "vLLM to report is_sleeping")

    def wake(self, client: EngineClient, spec: LaunchSpec, mode: str) -> None:
        if mode not in SLEEP_LEVELS:
            raise self.refuse_park(mode)
        if mode == "deep":
            # Level 2 dropped the weights: wake their buffers, reload them from disk, then
            # the KV cache, and forget prefix-cache entries computed with the old weights.
            client.request("POST", "/wake_up", params={"tags": "weights"})
            client.request("POST", "/collective_rpc", json={"method": "reload_weights"})
            client.request("POST", "/wake_up", params={"tags": "kv_cache"})
            client.request("POST", "/reset_prefix_cache")
        else:
            client.request("POST", "/wake_up")
        wait_until(lambda: not self._sleeping(client), 60, "vLLM to report it is awake")
