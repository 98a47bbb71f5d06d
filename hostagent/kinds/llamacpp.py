"""llama.cpp's ``llama-server``: ``/health`` is 503 while loading; no parking, so it is
stopped to make room and started again on its next request."""

from __future__ import annotations

from hostagent.kinds.base import LOOPBACK, RESERVED_FLAGS, LaunchSpec, ProgramKind


class LlamaCppKind(ProgramKind):
    name = "llamacpp"
    description = "llama.cpp llama-server"
    reserved_flags = (*RESERVED_FLAGS, "-m", "--model", "--alias", "-a")

    def engine_flags(self, spec: LaunchSpec) -> list[str]:
        return [
            "-m",
            spec.source,
            "--alias",
            spec.served_name,
            "--host",
            LOOPBACK,
            "--port",
            str(spec.port),
            "--api-key",
            spec.api_key,
        ]
