"""TensorFold: ``serve SOURCE --name NAME``, ready when ``/health`` answers 200; no
parking, so it is stopped to make room and started again on its next request."""

from __future__ import annotations

from hostagent.kinds.base import RESERVED_FLAGS, LaunchSpec, ProgramKind, loopback_flags


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
            *loopback_flags(spec),
        ]
