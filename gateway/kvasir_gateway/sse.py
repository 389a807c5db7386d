"""An engine's answer as the gateway reads it: server-sent events passed through one event at a
time, reading the usage on the way, or a whole JSON answer (`json_object`, `usage_tokens`,
`completion_tokens`).

The gateway asks the engine for `stream_options.include_usage` on every stream, because the
final usage is what settles the tenant's token reservation. When the client did not ask for it,
the usage is taken out again: a chunk whose only content is the usage (`choices: []`) is dropped,
and a usage field riding on a chunk with choices is removed from it. Every other byte goes
through unchanged, as soon as its event is complete (no buffering beyond one event).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


def json_object(data: bytes) -> dict[str, Any]:
    value = json.loads(data)
    if not isinstance(value, dict):
        raise ValueError("not an object")
    return value


def completion_tokens(answer: dict[str, Any]) -> int | None:
    usage = answer.get("usage")
    value = usage.get("completion_tokens") if isinstance(usage, dict) else None
    return value if isinstance(value, int) else None


def usage_tokens(usage: Any) -> int | None:
    if not isinstance(usage, dict):
        return None
    total = usage.get("total_tokens")
    if isinstance(total, int):
        return total
    parts = [usage.get("prompt_tokens"), usage.get("completion_tokens")]
    return sum(p for p in parts if isinstance(p, int)) if any(
        isinstance(p, int) for p in parts) else None


@dataclass
class StreamUsage:
    keep_usage: bool  # the client asked for include_usage itself
    used_tokens: int | None = None  # from the final usage chunk
    num_chunks: int = 0  # data events seen: a lower bound on completion tokens
    completion_tokens: int | None = None  # from the final usage chunk
    texts: list[str] | None = None  # the answer's text pieces, kept only when not None

    def __post_init__(self) -> None:
        self._pending = b""

    def feed(self, data: bytes) -> list[bytes]:
        """Complete events of `data` (with what came before), rewritten where needed."""
        self._pending += data
        out: list[bytes] = []
        while True:
            end = self._pending.find(b"\n\n")
            if end < 0:
                return out
            event, self._pending = self._pending[:end + 2], self._pending[end + 2:]
            rewritten = self._event(event)
            if rewritten:
                out.append(rewritten)

    def flush(self) -> bytes:
        rest, self._pending = self._pending, b""
        return rest

    def _event(self, event: bytes) -> bytes:
        is_data = event.startswith(b"data: {")
        if not is_data or (b'"usage"' not in event and self.texts is None):
            if is_data:
                self.num_chunks += 1
            return event
        try:
            chunk = json.loads(event[6:])
        except ValueError:
            return event
        self.num_chunks += 1
        if self.texts is not None and isinstance(chunk, dict):
            self.texts.extend(_delta_text(c) for c in chunk.get("choices") or []
                              if isinstance(c, dict))
        usage = chunk.get("usage") if isinstance(chunk, dict) else None
        used = usage_tokens(usage)
        if used is not None:
            self.used_tokens = used
            completion = usage.get("completion_tokens") if isinstance(usage, dict) else None
            self.completion_tokens = completion if isinstance(completion, int) else None
        if self.keep_usage or usage is None:
            return event
        if not chunk.get("choices"):
            return b""
        del chunk["usage"]
        return b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"


def _delta_text(choice: dict[str, Any]) -> str:
    delta = choice.get("delta")
    if isinstance(delta, dict):
        return str(delta.get("content") or "")
    return str(choice.get("text") or "")


def events_from_response(response: dict[str, Any], chat: bool, include_usage: bool) -> bytes:
    """A whole (buffered) answer as the SSE stream the engine would have sent: one chunk per
    choice holding its whole text, the usage chunk when asked, then `[DONE]`."""
    head = {"id": response.get("id"), "created": response.get("created"),
            "model": response.get("model"),
            "object": "chat.completion.chunk" if chat else "text_completion"}
    events = []
    for choice in response.get("choices") or []:
        if not isinstance(choice, dict):
            continue
        out: dict[str, Any] = {"index": choice.get("index", 0),
                               "logprobs": choice.get("logprobs"),
                               "finish_reason": choice.get("finish_reason")}
        if chat:
            message = choice.get("message") or {}
            out["delta"] = {"role": message.get("role", "assistant"),
                            "content": message.get("content")}
        else:
            out["text"] = choice.get("text", "")
        events.append({**head, "choices": [out]})
    if include_usage and response.get("usage") is not None:
        events.append({**head, "choices": [], "usage": response["usage"]})
    lines = [b"data: " + json.dumps(e, separators=(",", ":")).encode() + b"\n\n"
             for e in events]
    return b"".join(lines) + b"data: [DONE]\n\n"
