"""The checks a cascade's answer must pass before the gateway returns it instead of escalating.

Each check reads the engine's whole (non-streamed) answer; every choice must pass. In the order
they run, with the name each escalation is counted under:

- `length`: `finish_reason: length` (the answer was cut off by max_tokens),
- `refusal`: the text matches `refusal_regex` (search, e.g. `(?i)\\bI can(no|')t\\b`),
- `regex`: the text does not match `regex` (fullmatch, after stripping whitespace),
- `json_schema`: the text is not JSON valid under `json_schema` (the `jsonschema` library),
- `logprob`: the mean log-probability of the answer's tokens is under `min_mean_logprob`.

The last needs the engine's logprobs: the gateway asks for them (`logprobs: 1` on completions,
`logprobs: true` on chat) when the client did not, and `strip_logprobs` removes them again.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import jsonschema


@dataclass(frozen=True)
class CascadeChecks:
    min_mean_logprob: float | None = None
    length: bool = True  # escalate when finish_reason is "length"
    regex: re.Pattern[str] | None = None
    refusal_regex: re.Pattern[str] | None = None
    json_schema: dict[str, Any] | None = None

    @property
    def is_empty(self) -> bool:
        return (self.min_mean_logprob is None and not self.length and self.regex is None
                and self.refusal_regex is None and self.json_schema is None)

    @property
    def is_structured(self) -> bool:
        """Answers are compared exactly (shadow.py) when they must have a shape."""
        return self.json_schema is not None or self.regex is not None


def parse_checks(where: str, value: Any) -> CascadeChecks:
    if not isinstance(value, dict):
        raise ValueError(f"{where}: expected a mapping")
    known = {"min_mean_logprob", "length", "regex", "refusal_regex", "json_schema"}
    unknown = set(value) - known
    if unknown:
        raise ValueError(f"{where}.{sorted(unknown)[0]}: unknown check (known: "
                         f"{', '.join(sorted(known))})")
    threshold = value.get("min_mean_logprob")
    if threshold is not None and (isinstance(threshold, bool)
                                  or not isinstance(threshold, (int, float)) or threshold > 0):
        raise ValueError(f"{where}.min_mean_logprob: expected a number <= 0, got {threshold!r}")
    length = value.get("length", True)
    if not isinstance(length, bool):
        raise ValueError(f"{where}.length: expected true or false, got {length!r}")
    patterns: dict[str, re.Pattern[str] | None] = {}
    for name in ("regex", "refusal_regex"):
        text = value.get(name)
        if text is not None and not isinstance(text, str):
            raise ValueError(f"{where}.{name}: expected a string, got {text!r}")
        try:
            patterns[name] = re.compile(text) if text is not None else None
        except re.error as exc:
            raise ValueError(f"{where}.{name}: not a regex: {exc}") from None
    schema = value.get("json_schema")
    if schema is not None:
        if not isinstance(schema, dict):
            raise ValueError(f"{where}.json_schema: expected a mapping (a JSON schema)")
        try:
            jsonschema.validators.validator_for(schema).check_schema(schema)
        except jsonschema.SchemaError as exc:
            raise ValueError(f"{where}.json_schema: not a valid schema: {exc.message}") from None
    return CascadeChecks(None if threshold is None else float(threshold), length,
                         patterns["regex"], patterns["refusal_regex"], schema)


def choice_text(choice: dict[str, Any]) -> str:
    message = choice.get("message")
    if isinstance(message, dict):
        return str(message.get("content") or "")
    return str(choice.get("text") or "")


def answer_text(response: dict[str, Any]) -> str:
    """The answer's text, choices joined (what the shadow comparison reads)."""
    return "\n".join(choice_text(c) for c in response.get("choices") or []
                     if isinstance(c, dict))


def token_logprobs(choice: dict[str, Any]) -> list[float]:
    logprobs = choice.get("logprobs")
    if not isinstance(logprobs, dict):
        return []
    if isinstance(logprobs.get("content"), list):  # chat
        values = [e.get("logprob") for e in logprobs["content"] if isinstance(e, dict)]
    else:
        values = logprobs.get("token_logprobs") or []
    return [float(v) for v in values if isinstance(v, (int, float))]


def mean_logprob(choice: dict[str, Any]) -> float | None:
    values = token_logprobs(choice)
    return sum(values) / len(values) if values else None


def failed_check(checks: CascadeChecks, response: dict[str, Any]) -> str | None:
    """The name of the first check the answer fails, or None when it passes them all."""
    choices = [c for c in response.get("choices") or [] if isinstance(c, dict)]
    if not choices:
        return "empty"
    for choice in choices:
        text = choice_text(choice)
        if checks.length and choice.get("finish_reason") == "length":
            return "length"
        if checks.refusal_regex is not None and checks.refusal_regex.search(text):
            return "refusal"
        if checks.regex is not None and not checks.regex.fullmatch(text.strip()):
            return "regex"
        if checks.json_schema is not None:
            try:
                jsonschema.validate(json.loads(text), checks.json_schema)
            except (ValueError, jsonschema.ValidationError):
                return "json_schema"
        if checks.min_mean_logprob is not None:
            mean = mean_logprob(choice)
            if mean is None or mean < checks.min_mean_logprob:
                return "logprob"
    return None


def client_wants_logprobs(body: dict[str, Any]) -> bool:
    return body.get("logprobs") not in (None, False)


def with_logprobs(body: dict[str, Any], chat: bool) -> dict[str, Any]:
    """The body as sent upstream when the logprob check needs what the client did not ask."""
    if client_wants_logprobs(body):
        return body
    return {**body, "logprobs": True if chat else 1}


def strip_logprobs(response: dict[str, Any]) -> dict[str, Any]:
    for choice in response.get("choices") or []:
        if isinstance(choice, dict) and "logprobs" in choice:
            choice["logprobs"] = None
    return response
