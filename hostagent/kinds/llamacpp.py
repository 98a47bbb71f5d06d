"""llama.cpp's ``llama-server``: ``/health`` is 503 while loading; no parking, so it is
stopped to make room and started again on its next request. The key is in
``LLAMA_API_KEY``, the variable of its ``--api-key`` option (``common/arg.cpp``)."""

from __future__ import annotations

from hostagent.kinds.base import RESERVED_FLAGS, LaunchSpec, ProgramKind, loopback_flags


class LlamaCppKind(ProgramKind):
    name = "llamacpp"
    description = "llama.cpp llama-server"
    reserved_flags = (*RESERVED_FLAGS, "--api-key-file", "-m", "--model", "--alias", "-a")

    def engine_flags(self, spec: LaunchSpec) -> list[str]:
        return [
            "-m",
            spec.source,
            "--alias",
            spec.served_name,
            *loopback_flags(spec),
        ]

    def key_env(self, spec: LaunchSpec) -> dict[str, str]:
        return {"LLAMA_API_KEY": spec.api_key}
