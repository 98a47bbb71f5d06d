"""TensorFold: ``serve SOURCE --name NAME``, ready when ``/health`` answers 200; no
parking, so it is stopped to make room and started again on its next request.

The key is in ``TENSORFOLD_API_KEY``, which releases with API keys read (beside
``--api-key`` and ``--api-key-file``); older releases have no keys and ignore it, so they
serve on loopback without one, as they always did."""

from __future__ import annotations

from hostagent.kinds.base import RESERVED_FLAGS, LaunchSpec, ProgramKind, loopback_flags


class TensorFoldKind(ProgramKind):
    name = "tensorfold"
    description = "TensorFold server"
    reserved_flags = (*RESERVED_FLAGS, "--api-key-file", "--name")

    def engine_flags(self, spec: LaunchSpec) -> list[str]:
        return [
            "serve",
            spec.source,
            "--name",
            spec.served_name,
            *loopback_flags(spec),
        ]

    def key_env(self, spec: LaunchSpec) -> dict[str, str]:
        return {"TENSORFOLD_API_KEY": spec.api_key}
