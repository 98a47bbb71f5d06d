"""A streamed Response (``POST /v1/responses`` with ``stream``), event by event, as each
engine sends it; the simulator writes each event as ``event: TYPE`` and ``data: JSON``.

- vLLM (``vllm/entrypoints/openai/responses/serving.py`` and ``streaming_events.py``, the
  non-Harmony path): ``response.created``, ``response.in_progress``, then
  ``output_item.added`` and ``content_part.added`` before the first text delta, the text
  deltas, ``output_text.done``, ``content_part.done``, ``output_item.done`` and
  ``response.completed``; every event numbered by ``sequence_number`` from 0. The streamed
  item's id is a bare hex uuid, and the completed Response names its message ``msg_…``
  afresh (vLLM builds the final Response again from the whole output).
- SGLang (``python/sglang/srt/entrypoints/openai/serving_responses.py``): its stream handles
  Harmony (gpt-oss) contexts only, so for every other model it sends ``response.created``,
  ``response.in_progress`` and then, once the text is whole, ``response.completed``: no
  deltas at all.
- llama-server (``tools/server/server-task.cpp``, ``to_json_oaicompat_resp``): the same
  events as vLLM, but with no ``sequence_number``, no ``output_index`` and no
  ``content_index`` on any of them, and ``response.created`` carries only the id, object
  and status. The ``openai`` SDK's ``responses.stream()`` cannot place such events.
- TensorFold (``src/tensorfold/server/responses_translate.py``, ``Reply``): the full
  sequence with every index and ``sequence_number``, its item ids ``msg_…`` throughout;
  a reply cut off by its token limit ends with ``response.incomplete``.
"""

from __future__ import annotations

import uuid
from typing import Any

Event = dict[str, Any]
LLAMA_COMPLETED = ("id", "object", "created_at", "status", "model", "output", "usage")


def final_status(kind: str, cut_off: bool) -> str:
    """The finished Response's status: TensorFold says ``incomplete`` for a reply its
    token limit cut off; the others say ``completed`` either way."""
    return "incomplete" if kind == "tensorfold" and cut_off else "completed"


class ResponseStream:
    """The events of one streamed Response: :meth:`opening` before any text,
    :meth:`delta` for each piece of text, :meth:`closing` once the text is whole.

    ``started`` is the Response as it begins (``in_progress``, no output), ``done`` as it
    ends (its one message holds the whole text).
    """

    def __init__(self, kind: str, started: dict[str, Any], done: dict[str, Any]) -> None:
        self.kind = kind
        self.started = started
        self.done = done
        message = done["output"][0]
        # vLLM streams its item under a bare uuid; the others under the final message's id.
        self.item_id = uuid.uuid4().hex if kind == "vllm" else str(message["id"])
        self.text = ""
        self._sequence = 0
        self._opened = False

    def _event(self, kind: str, **fields: Any) -> Event:
        if self.kind == "llamacpp":  # llama-server numbers nothing
            return {"type": kind, **fields}
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event

    def _where(self, content: bool = True) -> dict[str, Any]:
        """The fields that place an event: none on llama-server's events."""
        if self.kind == "llamacpp":
            return {"item_id": self.item_id}
        where: dict[str, Any] = {"item_id": self.item_id, "output_index": 0}
        if content:
            where["content_index"] = 0
        return where

    def _item(self, status: str, content: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.item_id,
            "type": "message",
            "role": "assistant",
            "status": status,
            "content": content,
        }

    def _part(self, text: str, *, logprobs: bool) -> dict[str, Any]:
        part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": []}
        if logprobs:
            part["logprobs"] = []
        return part

    def _placed(self, **fields: Any) -> dict[str, Any]:
        """``output_index`` 0 where the engine sends it."""
        return fields if self.kind == "llamacpp" else {"output_index": 0, **fields}

    def opening(self) -> list[Event]:
        if self.kind == "llamacpp":  # the id, object and status only
            started = {key: self.started[key] for key in ("id", "object", "status")}
        else:
            started = self.started
        return [
            self._event("response.created", response=started),
            self._event("response.in_progress", response=started),
        ]

    def delta(self, piece: str) -> list[Event]:
        self.text += piece
        if self.kind == "sglang":  # its stream sends no deltas for a non-Harmony model
            return []
        events: list[Event] = []
        if not self._opened:
            self._opened = True
            events.append(
                self._event(
                    "response.output_item.added", **self._placed(item=self._item("in_progress", []))
                )
            )
            if self.kind == "llamacpp":
                part = {"type": "output_text", "text": ""}
            else:
                part = self._part("", logprobs=True)
            events.append(self._event("response.content_part.added", **self._where(), part=part))
        logprobs: dict[str, Any] = {} if self.kind == "llamacpp" else {"logprobs": []}
        events.append(
            self._event("response.output_text.delta", **self._where(), delta=piece, **logprobs)
        )
        return events

    def closing(self) -> list[Event]:
        final = self.done
        if self.kind == "llamacpp":  # the fields llama-server's completed Response has
            final = {key: final[key] for key in LLAMA_COMPLETED}
        if self.kind == "sglang":
            return [self._event("response.completed", response=final)]
        logprobs: dict[str, Any] = {} if self.kind == "llamacpp" else {"logprobs": []}
        # vLLM's done part has no logprobs; llama-server's and TensorFold's have them.
        part = self._part(self.text, logprobs=self.kind != "vllm")
        status = str(final["status"])
        item = self._item("completed" if self.kind != "tensorfold" else status, [part])
        return [
            self._event("response.output_text.done", **self._where(), text=self.text, **logprobs),
            self._event("response.content_part.done", **self._where(), part=part),
            self._event("response.output_item.done", **self._placed(item=item)),
            self._event(f"response.{status}", response=final),
        ]
