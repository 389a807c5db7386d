"""`checkpoint_format(path)`: which kind of checkpoint a model path is, decided in one place.

Every reader (architecture, EOS ids, weights, tokenizer) and the served-name default dispatch on
its answer instead of testing suffixes themselves, so a new format is one more member here.
"""

from __future__ import annotations

import enum
from pathlib import Path


class CheckpointFormat(enum.Enum):
    # A Hugging Face directory: config.json, tokenizer.json, *.safetensors (sharded or not).
    HF_DIR = "hf_dir"
    # One llama.cpp .gguf file: metadata (architecture, tokenizer) and the tensors together.
    GGUF_FILE = "gguf_file"


def checkpoint_format(model: str | Path) -> CheckpointFormat:
    """The format of `model`; a `ValueError` naming the path when it is neither."""
    path = Path(model)
    if not path.exists():
        raise ValueError(f"model path does not exist: {path}")
    if path.is_file() and path.suffix == ".gguf":
        return CheckpointFormat.GGUF_FILE
    if path.is_dir():
        return CheckpointFormat.HF_DIR
    raise ValueError(f"model must be a Hugging Face directory or a .gguf file, got {path}")


def resolve_model_path(model: str | Path) -> Path:
    """The path the readers take: a directory without config.json that holds exactly one .gguf
    file is that file. It is the layout a fetched GGUF upload leaves (the operator renders the
    cache directory, `/models/<hash>`, where kvasir-fetch puts the file and its manifest)."""
    path = Path(model)
    if path.is_dir() and not (path / "config.json").exists():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0]
    return path


def default_served_name(model: str | Path) -> str:
    """`--served-model-name` when not given: the file's stem for GGUF, the directory's name."""
    path = Path(model)
    return path.stem if checkpoint_format(path) is CheckpointFormat.GGUF_FILE else path.name
