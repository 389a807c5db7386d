"""`Tokenizer`: encode, decode and chat templates for a Hugging Face directory or a GGUF file.

A Hugging Face directory brings `tokenizer.json` (+ `tokenizer_config.json` for the chat template
and special tokens). A GGUF file brings only metadata, from which `checkpoint/gguf_tokenizer.py`
rebuilds an equivalent `tokenizers` byte-level BPE. Chat templates render in a sandboxed jinja2
environment, as transformers does. `IncrementalDetokenizer` is in `detokenizer.py`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from kvasir_engine.checkpoint.format import CheckpointFormat, checkpoint_format

# Texts longer than this are encoded through `encode_batch`, which (unlike `encode`) releases
# the GIL: a server thread tokenising a long prompt then leaves the event loop running.
_LONG_TEXT_CHARS = 4096


class Tokenizer:
    def __init__(self, backend: HFTokenizer, chat_template: str | None = None,
                 bos_token_id: int | None = None, eos_token_id: int | None = None,
                 add_bos_token: bool = False):
        self.backend = backend
        self.chat_template = chat_template
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        # Only for GGUF files that ask for it: tokenizer.json post-processors add BOS themselves.
        self.add_bos_token = add_bos_token

    @property
    def vocab_size(self) -> int:
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    def token_text(self, token_id: int | None) -> str | None:
        return None if token_id is None else self.backend.id_to_token(token_id)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) > _LONG_TEXT_CHARS:  # the batch encoder releases the GIL while it works
            encoding = self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0]
        else:
            encoding = self.backend.encode(text, add_special_tokens=add_special_tokens)
        ids = list(encoding.ids)
        if (add_special_tokens and self.add_bos_token and self.bos_token_id is not None
                and ids[:1] != [self.bos_token_id]):
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if len(token_ids) > _LONG_TEXT_CHARS:  # as encode: the batch decoder releases the GIL
            return str(self.backend.decode_batch([list(token_ids)],
                                                 skip_special_tokens=skip_special_tokens)[0])
        return str(self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    def convert_ids_to_tokens(self, token_ids: Sequence[int]) -> list[str]:
        return [self.backend.id_to_token(i) or "" for i in token_ids]

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True, **extra: Any) -> str:
        if not self.chat_template:
            raise ValueError("this model has no chat template; use a completion request")
        from kvasir_engine.chat_template import render_chat_template

        return render_chat_template(
            self.chat_template, messages, add_generation_prompt=add_generation_prompt,
            bos_token=self.token_text(self.bos_token_id) or "",
            eos_token=self.token_text(self.eos_token_id) or "", **extra)


def load_tokenizer(model: str | Path) -> Tokenizer:
    path = Path(model)
    if checkpoint_format(path) is CheckpointFormat.GGUF_FILE:
        return tokenizer_from_gguf(path)
    return tokenizer_from_hf_dir(path)


def _special_text(value: Any) -> str | None:
    if isinstance(value, dict):  # {"content": "<s>", ...} in older tokenizer_config files
        value = value.get("content")
    return value if isinstance(value, str) else None


def tokenizer_from_hf_dir(model_dir: Path) -> Tokenizer:
    file = model_dir / "tokenizer.json"
    if not file.is_file():
        raise ValueError(f"{file}: not found (only fast tokenizers, tokenizer.json, are supported)")
    try:
        backend = HFTokenizer.from_file(str(file))
    except Exception as exc:  # noqa: BLE001 - tokenizers raises a bare Exception
        raise ValueError(f"{file}: not a valid tokenizer.json ({exc})") from exc
    config: dict[str, Any] = {}
    config_file = model_dir / "tokenizer_config.json"
    if config_file.is_file():
        try:
            config = json.loads(config_file.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ValueError(f"{config_file}: not valid JSON ({exc})") from exc
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: take the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    if template is None and (model_dir / "chat_template.jinja").is_file():
        template = (model_dir / "chat_template.jinja").read_text(encoding="utf-8")

    def token_id(key: str) -> int | None:
        text = _special_text(config.get(key))
        return None if text is None else backend.token_to_id(text)

    return Tokenizer(backend, template, token_id("bos_token"), token_id("eos_token"))


def tokenizer_from_gguf(path: Path) -> Tokenizer:
    from kvasir_engine.checkpoint.gguf_tokenizer import read_gguf_tokenizer

    parts = read_gguf_tokenizer(path)
    return Tokenizer(parts.backend, parts.chat_template, parts.bos_token_id,
                     parts.eos_token_id, add_bos_token=parts.add_bos_token)
