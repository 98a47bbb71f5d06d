"""An engine's advice to start it with a flag, said the way CapyCTL takes it.

llama-server answers ``/v1/embeddings`` without ``--embeddings`` with "This server does
not support embeddings. Start it with `--embeddings`"; other engines give such advice too.
Behind CapyCTL nobody starts the engine by hand: the flag goes into the deployment's
engine args. So an engine's error answer whose message advises a flag gets one sentence
more, naming the command. Only error answers are read (never a success), once each.
"""

from __future__ import annotations

import json
import re

# "Start it with `--embeddings`", "restart the server with --enable-lora", "launch with
# --flag": a verb of starting, then within the sentence a flag.
_ADVICE = re.compile(
    r"\b(?:re)?(?:start|launch|run|serve)\w*\b[^.\n]{0,80}?(?<![\w-])(--[a-z0-9][a-z0-9-]*)",
    re.IGNORECASE,
)
_MESSAGE_BYTES = 64 * 1024  # a longer body is not an engine's error message


def hint(message: str, model: str) -> str | None:
    """The sentence to add when ``message`` advises starting the engine with a flag."""
    found = _ADVICE.search(message)
    if found is None:
        return None
    flag = found.group(1)
    return (
        f"CapyCTL starts this engine: give it {flag} with `capyctl deployment update "
        f'{model} --args "... {flag}"` (--args replaces its engine args: repeat the ones it '
        f"has), then `capyctl deployment stop {model}` and `capyctl deployment start {model}`."
    )


def with_capyctl_hint(body: bytes, model: str) -> bytes:
    """``body`` (an engine's error answer) with :func:`hint` added to its message: to
    ``error.message`` (OpenAI's shape), ``message`` or ``detail``, else to the text."""
    if len(body) > _MESSAGE_BYTES or b"--" not in body:
        return body
    try:
        parsed = json.loads(body)
    except ValueError:
        text = body.decode("utf-8", "replace")
        said = hint(text, model)
        return body if said is None else _joined(text, said).encode()
    holder = parsed.get("error") if isinstance(parsed, dict) else None
    if not isinstance(holder, dict):
        holder = parsed if isinstance(parsed, dict) else None
    if holder is None:
        return body
    for field in ("message", "detail"):
        message = holder.get(field)
        if isinstance(message, str):
            said = hint(message, model)
            if said is None:
                return body
            holder[field] = _joined(message, said)
            return json.dumps(parsed).encode()
    return body


def _joined(message: str, said: str) -> str:
    message = message.rstrip()
    return f"{message}{'' if message.endswith(('.', '!', '?')) else '.'} {said}"
