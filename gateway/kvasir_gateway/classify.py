"""The built-in classifier of a routing rule: a cheap look at the last user turn, no model.

`heuristic(body)` answers "hard" or "easy"; a rule maps those with `labels`
(`classifier: kvasir_gateway.classify:heuristic`, `labels: {hard: large, easy: cascade}`).
Hard: code (a fence or a few code-like lines), an ask for reasoning or proof, several
questions at once, or a long turn. It is a starting point to replace by your own function
(`module:function(body) -> pool | label | None`): the shadow metrics say how often it is wrong.
"""

from __future__ import annotations

import re
from typing import Any

HARD_WORDS = re.compile(
    r"\b(prove|proof|derive|step[- ]by[- ]step|explain why|analy[sz]e|compare|optimi[sz]e|"
    r"debug|refactor|implement|algorithm|complexity|theorem|calculate|translate)\b",
    re.IGNORECASE)
CODE = re.compile(r"```|^\s*(def|class|fn|func|import|#include|SELECT)\b", re.MULTILINE)
LONG_TURN_CHARS = 1200  # about 300 tokens: past a short question


def last_user_text(body: dict[str, Any]) -> str:
    for message in reversed(body.get("messages") or []):
        if isinstance(message, dict) and message.get("role") == "user":
            content = message.get("content")
            return content if isinstance(content, str) else str(content)
    prompt = body.get("prompt")
    return prompt if isinstance(prompt, str) else ""


def heuristic(body: dict[str, Any]) -> str:
    text = last_user_text(body)
    is_hard = (len(text) > LONG_TURN_CHARS or text.count("?") >= 3
               or CODE.search(text) is not None or HARD_WORDS.search(text) is not None)
    return "hard" if is_hard else "easy"
