"""Engine kinds: what CapyCTL knows about each inference server program.

A kind is a small object satisfying :class:`EngineKind`; each lives in its own module and
is listed in :data:`REGISTRY`. Code elsewhere asks the registry, never ``if kind == ...``.
"""

from __future__ import annotations

from hostagent.kinds.base import (
    Capabilities,
    EngineKind,
    KindError,
    Launch,
    LaunchSpec,
)
from hostagent.kinds.client import EngineClient
from hostagent.kinds.custom import CustomKind
from hostagent.kinds.llamacpp import LlamaCppKind
from hostagent.kinds.sglang import SGLangKind
from hostagent.kinds.tensorfold import TensorFoldKind
from hostagent.kinds.vllm import VLLMKind

REGISTRY: dict[str, EngineKind] = {
    kind.name: kind
    for kind in (VLLMKind(), SGLangKind(), LlamaCppKind(), TensorFoldKind(), CustomKind())
}


class UnknownKindError(KindError):
    """The kind name is not registered."""


def kind_names() -> list[str]:
    """Registered kind names, in a stable order."""
    return list(REGISTRY)


def get_kind(name: str) -> EngineKind:
    """Return the registered kind called ``name``, or raise :class:`UnknownKindError`."""
    try:
        return REGISTRY[name]
    except KeyError:
        known = ", ".join(REGISTRY)
        raise UnknownKindError(f"unknown engine kind {name!r} (known: {known})") from None


__all__ = [
    "REGISTRY",
    "Capabilities",
    "EngineClient",
    "EngineKind",
    "KindError",
    "Launch",
    "LaunchSpec",
    "UnknownKindError",
    "get_kind",
    "kind_names",
]
