"""llama.cpp's ``llama-server``: no parking; it is stopped and started again."""

from __future__ import annotations

from hostagent.kinds.base import RESERVED_FLAGS, ProgramKind


class LlamaCppKind(ProgramKind):
    name = "llamacpp"
    description = "llama.cpp llama-server"
    reserved_flags = (*RESERVED_FLAGS, "-m", "--model", "--alias", "-a")
