"""Typed errors of the host runtime. Each message says what a user needs to act."""

from __future__ import annotations


class EngineError(Exception):
    """Something went wrong with an engine process or a call to it."""


class CannotParkError(EngineError):
    """The engine's kind cannot park in the asked mode (it must be stopped instead)."""


class EngineCallError(EngineError):
    """A control call (health, park, wake) failed; ``status`` is the HTTP status if any."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class EngineExitedError(EngineError):
    """The engine process ended; ``log_tail`` holds its last log lines."""

    def __init__(self, message: str, exit_code: int | None, log_tail: str) -> None:
        super().__init__(f"{message}\n{log_tail}" if log_tail else message)
        self.exit_code = exit_code
        self.log_tail = log_tail


class StartTimeoutError(EngineError):
    """The engine did not become ready in time; ``log_tail`` holds its last log lines."""

    def __init__(self, message: str, log_tail: str) -> None:
        super().__init__(f"{message}\n{log_tail}" if log_tail else message)
        self.log_tail = log_tail


class EngineExposedError(EngineError):
    """The engine listened beyond loopback, so it was stopped."""


class MemoryNotReleasedError(EngineError):
    """A park call answered success but the probe still sees the GPU memory held."""

    def __init__(self, message: str, still_held: dict[int, int | None]) -> None:
        super().__init__(message)
        self.still_held = still_held


class EngineStuckError(EngineError):
    """The engine's process did not end after SIGKILL (stuck in the kernel or a GPU
    driver): what it holds cannot be confirmed released."""


class AdapterError(EngineError):
    """An engine refused to load or unload a LoRA adapter (its own message, one line), or
    an adapter cannot be served where it was asked for."""
