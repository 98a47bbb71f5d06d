"""LoRA adapters served by a base engine: names, and what a request must carry.

An adapter is a fine-tune served by the engine of its base deployment (DESIGN.md §2). The
engines name one differently in a request:

- vLLM serves a loaded adapter under its own name as the request's ``model``
  (``vllm/entrypoints/openai/engine/serving.py``, ``_maybe_get_adapters``: ``request.model``
  looked up in ``models.lora_requests``); the answer's ``model`` is the adapter's name.
- SGLang takes the adapter's name in the body's ``lora_path`` beside the base's ``model``
  (``protocol.py``'s ``lora_path``; newer releases also read ``model: "BASE:ADAPTER"``):
  ``lora_path`` works in every release with runtime loading, the colon form only in newer
  ones.
- llama-server applies adapters by their index in its ``--lora`` list with the per-request
  ``lora: [{"id": N, "scale": S}]`` (``parse_lora_request``: every adapter not named runs at
  scale 0, an index out of range is refused with "invalid adapter id").

Adapter names are checked here with the rules the control plane uses for aliases
(letters, digits, ``._-``; at most 128): the host agent imports nothing from capyctl.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from hostagent.errors import AdapterError

if TYPE_CHECKING:
    import httpx

ADAPTER_NAME_MAX = 128
ANY_STATUS = tuple(range(100, 600))  # an adapter call reads every answer itself
_ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def check_adapter_name(name: object) -> str:
    """``name`` if it is a valid adapter name, else :class:`AdapterError` in one line."""
    if (
        not isinstance(name, str)
        or len(name) > ADAPTER_NAME_MAX
        or not _ADAPTER_NAME.fullmatch(name)
    ):
        raise AdapterError(
            f"invalid adapter name {name!r}: letters, digits, '.', '_' and '-' only, "
            f"starting with a letter or digit, at most {ADAPTER_NAME_MAX} characters"
        )
    return name


def adapter_request_fields(
    kind: str, served_name: str, adapter_name: str, index: int
) -> dict[str, Any]:
    """The body fields the gateway sets so the engine of ``kind`` (serving its base as
    ``served_name``) answers with the adapter ``adapter_name``; ``index`` is the adapter's
    position in the launch's adapters (llama-server names adapters by it). Plain data, no
    I/O: called for every request."""
    if kind == "vllm":
        return {"model": adapter_name}
    if kind == "sglang":
        return {"model": served_name, "lora_path": adapter_name}
    if kind == "llamacpp":
        return {"model": served_name, "lora": [{"id": index, "scale": 1.0}]}
    raise AdapterError(f"{kind} cannot serve LoRA adapters")


def engine_message(response: httpx.Response) -> str:
    """The engine's own words in an answer, on one line: vLLM's ``error.message``,
    SGLang's ``error_message``, FastAPI's ``detail``, else the start of the body."""
    try:
        data = response.json()
    except ValueError:
        data = None
    text = response.text[:300]
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, dict) and error.get("message"):
            text = str(error["message"])
        elif data.get("error_message"):
            text = str(data["error_message"])
        elif data.get("detail"):
            text = str(data["detail"])
    return " ".join(text.split())
