"""TensorFold: ``serve`` with a health route; no parking."""

from __future__ import annotations

from hostagent.kinds.base import ProgramKind


class TensorFoldKind(ProgramKind):
    name = "tensorfold"
    description = "TensorFold server"
