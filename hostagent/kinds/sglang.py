"""SGLang: the memory saver releases and resumes GPU memory occupation.

With ``--enable-weights-cpu-backup`` the weights are kept in host RAM while released (our
``ram`` park); without it they are dropped and reloaded from disk on wake (``deep``).
SGLang's API key guards these routes, so calls carry the launch key. Where its help lists
``--uds`` (its main branch; no release up to 0.5.23) it listens on a Unix socket in its
0700 run dir instead of loopback TCP. SGLang reads its key
from no variable, so it is in a 0600 ``--config`` file (YAML; SGLang merges its options
inside the process), never on the command line.

Adapters: with adapter slots it is launched with ``--enable-lora --max-loras-per-batch N+1
--max-lora-rank R --lora-target-modules all``. Its GPU pool counts requests for the base
model as one of its slots (``docs/advanced_features/lora.md``: "one slot for adaptor and
another one for base model"), hence the +1. With no ``--lora-paths`` at launch it needs both
a rank and target modules (``server_args.py``: "When no initial --lora-paths is provided,
you need to specify both --max-lora-rank and --lora-target-modules"), so where the
deployment gives no rank it gets :data:`DEFAULT_LORA_RANK` (vLLM's default). No
``--max-loaded-loras``: with it SGLang would unload its least recently used adapter on a
load, unasked (``tokenizer_control_mixin.py``), behind the control plane's back.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from hostagent.errors import AdapterError, CannotParkError
from hostagent.kinds.adapters import ANY_STATUS, engine_message
from hostagent.kinds.base import (
    MODELS_PATH,
    RESERVED_FLAGS,
    KindError,
    LaunchSpec,
    ProgramKind,
    fraction_flag,
    has_uds,
    key_file_path,
    one_token_completion,
    uds_flags,
)
from hostagent.kinds.client import EngineClient
from hostagent.kinds.media import FLAG as MEDIA_FLAG
from hostagent.kinds.media import media_domain_flags
from hostagent.versions import EngineFeatures, ProbeCommands

if TYPE_CHECKING:
    import httpx

CPU_BACKUP_FLAG = "--enable-weights-cpu-backup"
# What SGLang allocates outside its static part (activations, CUDA graph buffers), kept
# inside the claim.
OUTSIDE_STATIC_BYTES = 2 * 1024**3
CONFIG_FILE = "sglang-config.yaml"  # SGLang takes only .yaml or .yml
DEFAULT_LORA_RANK = 16


def static_fraction(spec: LaunchSpec) -> LaunchSpec:
    """The launch with the share ``--mem-fraction-static`` is given. SGLang's static part
    (weights and the KV pool) is the device's total times the fraction less what is in use
    on it when it sizes its pool (``rest = free after loading - total x (1 - fraction)``):
    other engines' memory counts against it. So the fraction is what the GPU holds at launch
    plus the claim, less :data:`OUTSIDE_STATIC_BYTES`, over its total (the smallest of its
    GPUs'); without those figures, the claim's share of the device."""
    if spec.memory_fraction is None or spec.claim_bytes is None or not spec.gpu_memory:
        return spec
    shares = [
        (total - free + spec.claim_bytes - OUTSIDE_STATIC_BYTES) / total
        for free, total in spec.gpu_memory
        if total > 0
    ]
    if not shares:
        return spec
    return replace(spec, memory_fraction=min(max(min(shares), 0.01), 1.0))


class SGLangKind(ProgramKind):
    name = "sglang"
    description = "SGLang server with the memory saver"
    reserved_flags = (
        *RESERVED_FLAGS,
        "--config",  # one config file per launch: CapyCTL's, with the key
        "--uds",
        "--served-model-name",
        "--model-path",
        "--enable-memory-saver",
        CPU_BACKUP_FLAG,
        MEDIA_FLAG,  # the deployment's media domains say it
    )
    adapter_reserved = (
        "--enable-lora",
        "--max-loras-per-batch",
        "--max-lora-rank",
        "--lora-target-modules",
        "--max-loaded-loras",
        "--lora-paths",
    )
    # Its runtime routes came with --enable-lora (before, --lora-paths alone turned LoRA on).
    adapter_help_flag = "--enable-lora"
    runtime_adapter_loading = True
    park_modes = ("ram", "deep")
    sizes_by_free_memory = True  # its static fraction counts what else the GPU holds
    # launch_server has no --version; its --help lists the flags.
    probes = ProbeCommands(version=None, help=["--help"])

    def engine_flags(self, spec: LaunchSpec) -> list[str]:
        flags = [
            "--model-path",
            spec.source,
            "--served-model-name",
            spec.served_name,
            *uds_flags(spec),
            "--config",
            str(key_file_path(spec, CONFIG_FILE)),
            "--enable-memory-saver",
            *fraction_flag(static_fraction(spec), "--mem-fraction-static"),
            *media_domain_flags(spec),
        ]
        if spec.ram_park:
            flags.append(CPU_BACKUP_FLAG)
        return flags

    def socket_listening(self, features: EngineFeatures | None) -> bool:
        # SGLang's --uds (python/sglang/srt/utils/uds.py) refuses a --host or --port
        # other than their defaults beside it: uds_flags gives neither.
        return has_uds(features)

    def key_files(self, spec: LaunchSpec) -> dict[Path, str]:
        # JSON is YAML too, and quotes the key whatever it looks like.
        return {key_file_path(spec, CONFIG_FILE): json.dumps({"api-key": spec.api_key}) + "\n"}

    def warm_up(self, client: EngineClient, spec: LaunchSpec) -> None:
        one_token_completion(client, spec)

    def park(self, client: EngineClient, spec: LaunchSpec, mode: str) -> None:
        if mode not in self.park_modes:
            raise self.refuse_park(mode)
        if mode == "ram" and not spec.ram_park:
            raise self.refuse_park_ram()
        if mode == "deep" and spec.ram_park:
            # With the CPU backup, releasing still copies the weights to host RAM.
            raise CannotParkError(
                f"this sglang launch has {CPU_BACKUP_FLAG}: releasing would still copy its "
                "weights to host RAM"
            )
        client.request("POST", "/release_memory_occupation", json={})

    def refuse_park_ram(self) -> CannotParkError:
        return CannotParkError(
            f"this sglang launch has no {CPU_BACKUP_FLAG}, so it can park only 'deep'"
        )

    def wake(self, client: EngineClient, spec: LaunchSpec, mode: str) -> None:
        if mode not in self.park_modes:
            raise self.refuse_park(mode)
        client.request("POST", "/resume_memory_occupation", json={})
        if mode == "deep" and not spec.ram_park:
            # Without a CPU backup the weights were dropped: load them from disk again.
            client.request("POST", "/update_weights_from_disk", json={"model_path": spec.source})

    # -- LoRA adapters ----------------------------------------------------------------------

    def slot_flags(self, spec: LaunchSpec) -> list[str]:
        if spec.adapters:
            raise KindError("sglang loads adapters while running: a launch names none")
        return [
            "--enable-lora",
            "--max-loras-per-batch",
            str(spec.adapter_slots + 1),
            "--max-lora-rank",
            str(spec.adapter_max_rank or DEFAULT_LORA_RANK),
            "--lora-target-modules",
            "all",
        ]

    def load_adapter(self, client: EngineClient, spec: LaunchSpec, name: str, path: str) -> None:
        body = {"lora_name": name, "lora_path": path}
        answer = client.request("POST", "/load_lora_adapter", json=body, expect=ANY_STATUS)
        message = engine_message(answer)
        if answer.status_code == 200 and _succeeded(answer):
            return
        # Its registry refuses a name it holds (lora_registry.py, 400): already there.
        if f"LoRA with name {name} already exists" in message:
            return
        raise AdapterError(f"sglang refused to load adapter {name}: {message}")

    def unload_adapter(self, client: EngineClient, spec: LaunchSpec, name: str) -> None:
        body = {"lora_name": name}
        answer = client.request("POST", "/unload_lora_adapter", json=body, expect=ANY_STATUS)
        message = engine_message(answer)
        if answer.status_code == 200 and _succeeded(answer):
            return
        # Its registry refuses a name it does not hold (lora_registry.py, 400): gone.
        if f"LoRA with name {name} does not exist" in message:
            return
        raise AdapterError(f"sglang refused to unload adapter {name}: {message}")

    def loaded_adapters(self, client: EngineClient, spec: LaunchSpec) -> list[str] | None:
        # /v1/models lists the loaded adapters after the base, each with its parent.
        cards = client.request("GET", MODELS_PATH).json().get("data") or []
        return [str(c["id"]) for c in cards if isinstance(c, dict) and c.get("parent")]


def _succeeded(answer: httpx.Response) -> bool:
    try:
        data = answer.json()
    except ValueError:
        return False
    return isinstance(data, dict) and data.get("success") is True
