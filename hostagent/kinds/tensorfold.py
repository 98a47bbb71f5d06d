"""TensorFold: ``serve SOURCE --name NAME``, ready when ``/health`` answers 200; no
parking, so it is stopped to make room and started again on its next request."""

from __future__ import annotations

from hostagent.kinds.base import LOOPBACK, RESERVED_FLAGS, LaunchSpec, ProgramKind


class TensorFoldKind(ProgramKind):
    name = "tensorfold"
    description = "TensorFold server"
    reserved_flags = (*RESERVED_FLAGS, "--name")

    def engine_flags(self, spec: LaunchSpec) -> list[str]:
        return [
            "serve",
            spec.source,
            "--name",
            spec.served_name,
            "--host",
            LOOPBACK,
            "--port",
            str(spec.port),
            "--api-key",
            spec.api_key,
        ]
