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

Adapters: with adapter slots it is launched with ``--enable-lora --max-loras N
--max-cpu-loras N`` (and ``--max-lora-rank R`` where given; vLLM's default is 16 and it
takes only 1, 8, 16, 32, 64, 128, 256, 320 or 512: ``vllm/config/lora.py``'s
``MaxLoRARanks``) and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``, without which vLLM has no
``/v1/load_lora_adapter`` or ``/v1/unload_lora_adapter`` at all
(``entrypoints/serve/lora/api_router.py``). ``--max-cpu-loras`` (its default: the same as
``--max-loras``) is set so its host-RAM cache is as many adapters as it has slots.

The key is in ``VLLM_API_KEY``, which vLLM's server reads when no ``--api-key`` is given
(``args.api_key or envs.VLLM_API_KEY``), never on the command line.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hostagent.errors import AdapterError
from hostagent.kinds.adapters import ANY_STATUS, engine_message
from hostagent.kinds.base import (
    MODELS_PATH,
    RESERVED_FLAGS,
    VLLM_LOAD_ADAPTER_PATH,
    VLLM_UNLOAD_ADAPTER_PATH,
    KindError,
    LaunchSpec,
    ProgramKind,
    fraction_flag,
    has_uds,
    one_token_completion,
    uds_flags,
    wait_until,
)
from hostagent.kinds.client import EngineClient
from hostagent.kinds.media import FLAG as MEDIA_FLAG
from hostagent.kinds.media import media_domain_flags
from hostagent.versions import EngineFeatures, ProbeCommands

if TYPE_CHECKING:
    import httpx

SLEEP_LEVELS = {"ram": 1, "deep": 2}
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vllm/config/lora.py, MaxLoRARanks
RUNTIME_LORA_VARIABLE = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
LOAD_ROUTE = VLLM_LOAD_ADAPTER_PATH
UNLOAD_ROUTE = VLLM_UNLOAD_ADAPTER_PATH


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
    adapter_reserved = ("--enable-lora", "--max-loras", "--max-lora-rank", "--max-cpu-loras")
    adapter_help_flag = "--enable-lora"
    runtime_adapter_loading = True
    # A level-2 sleep of an engine with --enable-lora crashes on wake (reload_weights looks up
    # weights the LoRA wrappers moved under `base_layer`): vllm#39934; vllm PR #48337 fixes
    # it and is in no release yet.
    deep_park_with_adapters_fails = (
        "vLLM with LoRA enabled fails to wake from a deep park (a level-2 sleep: vllm#39934, "
        "fixed by vllm PR #48337, in no release yet)"
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

    # -- LoRA adapters ----------------------------------------------------------------------

    def slot_flags(self, spec: LaunchSpec) -> list[str]:
        if spec.adapters:
            raise KindError("vllm loads adapters while running: a launch names none")
        slots = str(spec.adapter_slots)
        flags = ["--enable-lora", "--max-loras", slots, "--max-cpu-loras", slots]
        if spec.adapter_max_rank:
            if spec.adapter_max_rank not in LORA_RANKS:
                allowed = ", ".join(str(r) for r in LORA_RANKS)
                raise KindError(
                    f"vllm takes an adapter maximum rank of {allowed} (got {spec.adapter_max_rank})"
                )
            flags += ["--max-lora-rank", str(spec.adapter_max_rank)]
        return flags

    def adapter_env(self, spec: LaunchSpec) -> dict[str, str]:
        return {RUNTIME_LORA_VARIABLE: "True"}

    def load_adapter(self, client: EngineClient, spec: LaunchSpec, name: str, path: str) -> None:
        body = {"lora_name": name, "lora_path": path}
        answer = client.request("POST", LOAD_ROUTE, json=body, expect=ANY_STATUS)
        if answer.status_code == 200:
            return
        message = engine_message(answer)
        # serving.py: "The lora adapter 'X' has already been loaded. If you want to load
        # the adapter in place, set 'load_inplace' to True." (400)
        if answer.status_code == 400 and "has already been loaded" in message:
            return
        raise AdapterError(f"vllm refused to load adapter {name}: {self._why(answer, message)}")

    def unload_adapter(self, client: EngineClient, spec: LaunchSpec, name: str) -> None:
        answer = client.request("POST", UNLOAD_ROUTE, json={"lora_name": name}, expect=ANY_STATUS)
        if answer.status_code == 200:
            return
        message = engine_message(answer)
        # serving.py: "The lora adapter 'X' cannot be found." (404 NotFoundError)
        if answer.status_code == 404 and "cannot be found" in message:
            return
        raise AdapterError(f"vllm refused to unload adapter {name}: {self._why(answer, message)}")

    def _why(self, answer: httpx.Response, message: str) -> str:
        # vLLM's own refusals are {"error": {...}}; a 404 without one is its web
        # framework's: the route is not there at all.
        try:
            data = answer.json()
        except ValueError:
            data = None
        if answer.status_code == 404 and not (isinstance(data, dict) and "error" in data):
            return (
                f"it has no {LOAD_ROUTE} (launched without {RUNTIME_LORA_VARIABLE}=True "
                "and --enable-lora)"
            )
        return message

    def loaded_adapters(self, client: EngineClient, spec: LaunchSpec) -> list[str] | None:
        # /v1/models lists each loaded adapter as a card whose parent is the base.
        cards = client.request("GET", MODELS_PATH).json().get("data") or []
        return [str(c["id"]) for c in cards if isinstance(c, dict) and c.get("parent")]

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
