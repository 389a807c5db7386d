"""The tokenizer a GGUF file carries, rebuilt as a `tokenizers` byte-level BPE.

A GGUF file brings only metadata (tokens, their types, merges, the pre-tokenizer's name, special
ids, the chat template); from it we rebuild the "gpt2" BPE that SmolLM2 and Llama 3 use. The
result is plain parts, not `tokenizer.py:Tokenizer`, so this package imports nothing above it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from kvasir_engine.checkpoint.metadata import read_gguf_fields

# llama.cpp's token types.
_CONTROL, _USER_DEFINED = 3, 4
# llama.cpp pre-tokenizer names that split digits one by one before the GPT-2 regex (SmolLM's
# own tokenizer.json does this with a Digits pre-tokenizer).
_SINGLE_DIGIT_PRE = {"smollm"}


@dataclass(frozen=True)
class TokenizerParts:
    backend: HFTokenizer
    chat_template: str | None
    bos_token_id: int | None
    eos_token_id: int | None
    # tokenizer.ggml.add_bos_token: the BPE has no post-processor, so encode() prepends BOS.
    add_bos_token: bool


def read_gguf_tokenizer(path: Path) -> TokenizerParts:
    fields = read_gguf_fields(path, include_tokenizer=True)
    kind = fields.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"{path}: GGUF tokenizer model {kind!r} is not supported (gpt2 only)")
    tokens: list[str] = list(fields["tokenizer.ggml.tokens"])
    types: list[int] = list(fields.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in fields.get("tokenizer.ggml.merges") or []]
    vocab = {token: index for index, token in enumerate(tokens)}
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if fields.get("tokenizer.ggml.pre") in _SINGLE_DIGIT_PRE:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        backend.pre_tokenizer = byte_level
    backend.decoder = decoders.ByteLevel()
    specials = [AddedToken(t, special=True, normalized=False)
                for t, kind_id in zip(tokens, types, strict=True) if kind_id == _CONTROL]
    backend.add_special_tokens(specials)
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, kind_id in zip(tokens, types, strict=True)
                        if kind_id == _USER_DEFINED])
    bos, eos = fields.get("tokenizer.ggml.bos_token_id"), fields.get("tokenizer.ggml.eos_token_id")
    return TokenizerParts(backend, fields.get("tokenizer.chat_template"),
                          None if bos is None else int(bos), None if eos is None else int(eos),
                          add_bos_token=bool(fields.get("tokenizer.ggml.add_bos_token", False)))
