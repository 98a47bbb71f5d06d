"""SGLang: memory saver releases and resumes GPU memory; a CPU backup keeps weights."""

from __future__ import annotations

from hostagent.kinds.base import RESERVED_FLAGS, ProgramKind


class SGLangKind(ProgramKind):
    name = "sglang"
    description = "SGLang server with the memory saver"
    can_park_ram = True
    can_park_deep = True
    reserved_flags = (*RESERVED_FLAGS, "--served-model-name", "--model-path")
