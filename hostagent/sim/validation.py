"""A request that lacks a field its route requires, refused in each engine's own words.

vLLM and SGLang validate a request's body with pydantic before anything else (FastAPI's
``RequestValidationError``, which both answer 400 rather than FastAPI's 422: vLLM's
``build_app`` in ``vllm/entrypoints/openai/api_server.py``, SGLang's
``validation_exception_handler`` in ``python/sglang/srt/entrypoints/http_server.py``, whose
body is flat outside ``/v1/responses``); llama-server throws ``'messages' is required``
(``tools/server/server-common.cpp``, ``oaicompat_chat_params_parse``); TensorFold refuses
with ``messages must be a non-empty list`` (``src/tensorfold/server/messages.py``).
"""

from __future__ import annotations

from typing import Any


def _pydantic_message(field: str, body: dict[str, Any]) -> str:
    """FastAPI's ``str(exc)`` then ``str(exc.errors())``, as both engines join them."""
    error = {"type": "missing", "loc": ("body", field), "msg": "Field required", "input": body}
    return f"1 validation error:\n  {error}\n {[error]}"


def missing_field(kind: str, field: str, body: dict[str, Any]) -> tuple[int, Any] | None:
    """The status and body with which ``kind`` refuses ``body`` for lacking ``field``;
    None when the field is there."""
    if field in body and (kind != "tensorfold" or body[field]):
        return None
    if kind == "vllm":
        error = {"message": _pydantic_message(field, body), "type": "Bad Request"}
        return 400, {"error": {**error, "param": None, "code": 400}}
    if kind == "sglang":
        message = _pydantic_message(field, body)
        return 400, {"object": "error", "message": message, "type": "Bad Request",
                     "param": None, "code": 400}  # fmt: skip
    if kind == "llamacpp":
        message = f"'{field}' is required"
        return 400, {"error": {"code": 400, "message": message, "type": "invalid_request_error"}}
    message = f"{field} must be a non-empty list"
    return 400, {"error": {"message": message, "type": "invalid_request_error", "param": field}}
