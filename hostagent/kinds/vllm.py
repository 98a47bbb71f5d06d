"""vLLM: ``vllm serve`` with sleep mode (level 1 keeps weights in RAM, level 2 drops them)."""

from __future__ import annotations

from hostagent.kinds.base import RESERVED_FLAGS, ProgramKind


class VLLMKind(ProgramKind):
    name = "vllm"
    description = "vLLM OpenAI server with sleep mode"
    can_park_ram = True
    can_park_deep = True
    reserved_flags = (*RESERVED_FLAGS, "--served-model-name")
