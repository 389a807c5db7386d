"""Render a model's jinja2 chat template the way transformers does, in a sandbox.

Templates come from model files, so they run in jinja2's immutable sandbox (no attribute
writes, no access to Python internals), with transformers' settings (trim_blocks,
lstrip_blocks, loop controls) and helpers (`raise_exception`, `tojson`, `strftime_now`).
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment


def _raise(message: str) -> None:
    raise ValueError(f"chat template: {message}")


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


@lru_cache(maxsize=8)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except jinja2.TemplateError as exc:
        raise ValueError(f"chat template does not compile: {exc}") from exc


def render_chat_template(template: str, messages: list[dict[str, Any]],
                         add_generation_prompt: bool = True, **context: Any) -> str:
    if not messages:
        raise ValueError("messages: must contain at least one message")
    try:
        return str(_compile(template).render(messages=messages,
                                             add_generation_prompt=add_generation_prompt,
                                             **context))
    except jinja2.TemplateError as exc:
        raise ValueError(f"chat template failed: {exc}") from exc
