"""How the agent API carries the host runtime's answers and errors as JSON, both ways."""

from __future__ import annotations

from typing import Any

from hostagent import errors
from hostagent.probe import ProcessUsage
from hostagent.runtime import InstanceRequest


def usage_to_json(usage: ProcessUsage) -> dict[str, Any]:
    return {"gpu": {str(k): v for k, v in usage.gpu.items()}, "host_bytes": usage.host_bytes}


def usage_from_json(data: dict[str, Any]) -> ProcessUsage:
    gpu = {int(k): (None if v is None else int(v)) for k, v in data["gpu"].items()}
    return ProcessUsage(gpu=gpu, host_bytes=int(data["host_bytes"]))


def request_from_json(data: dict[str, Any]) -> InstanceRequest:
    """An instance request from the server; raises ValueError naming what is wrong."""
    request = InstanceRequest.from_dict(data)
    for field in ("instance_id", "kind", "command", "source", "served_name"):
        if not isinstance(getattr(request, field), str) or not getattr(request, field):
            raise ValueError(f"bad instance request: {field} must be a non-empty string")
    return request


def _message(exc: Exception, tail: str) -> str:
    text = str(exc)
    return text[: -(len(tail) + 1)] if tail and text.endswith("\n" + tail) else text


def error_to_json(exc: errors.EngineError) -> dict[str, Any]:
    data: dict[str, Any] = {"type": type(exc).__name__, "message": str(exc)}
    if isinstance(exc, errors.EngineExitedError):
        data.update(message=_message(exc, exc.log_tail), exit_code=exc.exit_code,
                    log_tail=exc.log_tail)  # fmt: skip
    elif isinstance(exc, errors.StartTimeoutError):
        data.update(message=_message(exc, exc.log_tail), log_tail=exc.log_tail)
    elif isinstance(exc, errors.MemoryNotReleasedError):
        data["still_held"] = {str(k): v for k, v in exc.still_held.items()}
    elif isinstance(exc, errors.EngineCallError):
        data["status"] = exc.status
    return data


def error_from_json(data: dict[str, Any]) -> errors.EngineError:
    """The same error class the agent raised, so the scheduler handles it the same way."""
    kind, message = str(data.get("type")), str(data.get("message"))
    if kind == "EngineExitedError":
        return errors.EngineExitedError(message, data.get("exit_code"), str(data.get("log_tail")))
    if kind == "StartTimeoutError":
        return errors.StartTimeoutError(message, str(data.get("log_tail")))
    if kind == "MemoryNotReleasedError":
        held = {int(k): v for k, v in (data.get("still_held") or {}).items()}
        return errors.MemoryNotReleasedError(message, held)
    plain: dict[str, type[errors.EngineError]] = {
        "CannotParkError": errors.CannotParkError,
        "EngineStuckError": errors.EngineStuckError,
        "AdapterError": errors.AdapterError,
    }
    if kind in plain:
        return plain[kind](message)
    if kind == "EngineCallError":
        return errors.EngineCallError(message, data.get("status"))
    return errors.EngineError(message)
