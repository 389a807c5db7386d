"""What a checkpoint says about itself without its weights: `ModelArch` and EOS ids.

From a Hugging Face `config.json` (+ `generation_config.json`) or a GGUF file's metadata.
Torch-free, so `args.py` can validate flags against the model before anything heavy loads. Every
unsupported or malformed checkpoint fails here with one line naming the file and the problem.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvasir_engine.checkpoint.arch import ModelArch, RopeScaling
from kvasir_engine.checkpoint.format import CheckpointFormat, checkpoint_format
from kvasir_engine.checkpoint.quant_config import CheckpointQuantization, parse_quantization_config

# model_type in config.json -> the architecture name our registry serves.
MODEL_TYPE_TO_ARCHITECTURE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}
SUPPORTED_ARCHITECTURES = tuple(sorted(set(MODEL_TYPE_TO_ARCHITECTURE.values())))
# general.architecture in a GGUF file -> the architecture name. Only "llama" is wired: its Q/K
# permutation is the one the loader knows how to undo.
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM"}


def read_model_arch(model: str | Path) -> ModelArch:
    """The architecture of a Hugging Face directory or a `.gguf` file."""
    path = Path(model)
    if checkpoint_format(path) is CheckpointFormat.GGUF_FILE:
        return arch_from_gguf_fields(read_gguf_fields(path), path)
    return arch_from_hf_config(read_json(path / "config.json"), path / "config.json")


def read_checkpoint_quantization(model: str | Path) -> CheckpointQuantization | None:
    """A Hugging Face checkpoint's `quantization_config` (None: unquantized, or GGUF, whose
    quantization the loader dequantizes)."""
    path = Path(model)
    if checkpoint_format(path) is CheckpointFormat.GGUF_FILE:
        return None
    return parse_quantization_config(read_json(path / "config.json"), str(path / "config.json"))


def read_eos_token_ids(model: str | Path) -> frozenset[int]:
    """EOS ids: generation_config.json, else config.json; tokenizer.ggml.eos_token_id in GGUF."""
    path = Path(model)
    if checkpoint_format(path) is CheckpointFormat.GGUF_FILE:
        eos = read_gguf_fields(path).get("tokenizer.ggml.eos_token_id")
        return frozenset() if eos is None else frozenset({int(eos)})
    for name in ("generation_config.json", "config.json"):
        file = path / name
        if not file.is_file():
            continue
        try:
            eos = json.loads(file.read_text()).get("eos_token_id")
        except (OSError, ValueError) as exc:
            raise ValueError(f"{file}: not valid JSON ({exc})") from exc
        if eos is not None:
            return frozenset(int(e) for e in (eos if isinstance(eos, list) else [eos]))
    return frozenset()


def read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ValueError(f"{path}: file not found")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def _architecture_name(config: dict[str, Any], source: Path) -> str:
    names = config.get("architectures") or []
    for name in names:
        if name in SUPPORTED_ARCHITECTURES:
            return str(name)
    model_type = config.get("model_type")
    if not names and model_type in MODEL_TYPE_TO_ARCHITECTURE:
        return MODEL_TYPE_TO_ARCHITECTURE[model_type]
    found = names or model_type
    raise ValueError(f"{source}: unsupported architecture {found!r}; "
                     f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")


def _rope_from_hf(config: dict[str, Any]) -> tuple[float, RopeScaling]:
    # transformers >= 5 writes `rope_parameters` (theta inside); older configs use rope_theta +
    # rope_scaling (None, or a dict keyed by "rope_type" or the legacy "type").
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, RopeScaling()
    if rope_type not in ("llama3", "linear"):
        raise ValueError(f"rope scaling type {rope_type!r} is not supported (llama3, linear)")
    defaults = RopeScaling()
    return theta, RopeScaling(
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", defaults.low_freq_factor)),
        high_freq_factor=float(params.get("high_freq_factor", defaults.high_freq_factor)),
        original_max_position_embeddings=int(params.get(
            "original_max_position_embeddings", defaults.original_max_position_embeddings)),
    )


def arch_from_hf_config(config: dict[str, Any], source: Path = Path("config.json")) -> ModelArch:
    architecture = _architecture_name(config, source)
    try:
        hidden = int(config["hidden_size"])
        heads = int(config["num_attention_heads"])
        theta, scaling = _rope_from_hf(config)
        use_sliding = config.get("use_sliding_window", architecture == "MistralForCausalLM")
        return ModelArch(
            architecture=architecture,
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(config["intermediate_size"]),
            num_hidden_layers=int(config["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            # Qwen2's config has no flag: its q/k/v projections always carry biases.
            attention_bias=bool(config.get("attention_bias",
                                           architecture == "Qwen2ForCausalLM")),
            sliding_window=config.get("sliding_window") if use_sliding else None,
            torch_dtype=str(config.get("torch_dtype") or config.get("dtype") or "float32"),
        )
    except KeyError as exc:
        raise ValueError(f"{source}: missing required field {exc.args[0]!r}") from exc
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{source}: {exc}") from exc


def read_gguf_fields(path: Path, include_tokenizer: bool = False) -> dict[str, Any]:
    """The metadata key/values of a GGUF file (arrays of strings/ints as lists).

    The tokenizer's vocabulary and merges (~100k strings) are skipped unless asked for.
    """
    reader = open_gguf(path)
    fields: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if not include_tokenizer and key.startswith("tokenizer.ggml.") and len(field.data) > 1:
            fields[key + ".count"] = len(field.data)
            continue
        try:
            fields[key] = field.contents()
        except Exception:  # noqa: BLE001 - an odd metadata type we never read must not block
            continue
    fields["__tensor_names__"] = [t.name for t in reader.tensors]
    return fields


def open_gguf(path: Path):  # type: ignore[no-untyped-def]
    """A `gguf.GGUFReader`, with any parse failure turned into one line naming the file."""
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except Exception as exc:  # noqa: BLE001 - the reader raises many types on truncated files
        raise ValueError(f"{path}: not a readable GGUF file ({type(exc).__name__}: {exc})") from exc


def arch_from_gguf_fields(fields: dict[str, Any], source: Path) -> ModelArch:
    name = fields.get("general.architecture")
    if name not in GGUF_ARCHITECTURES:
        raise ValueError(f"{source}: unsupported GGUF architecture {name!r}; "
                         f"supported: {', '.join(GGUF_ARCHITECTURES)}")

    def get(key: str, default: Any = None) -> Any:
        value = fields.get(f"{name}.{key}", default)
        if value is None:
            raise ValueError(f"{source}: GGUF metadata lacks {name}.{key}")
        return value

    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    vocab = fields.get(f"{name}.vocab_size") or fields.get("tokenizer.ggml.tokens.count", 0)
    scaling = RopeScaling()
    if fields.get(f"{name}.rope.scaling.type") == "linear":
        scaling = RopeScaling(rope_type="linear", factor=float(get("rope.scaling.factor")))
    if "rope_freqs.weight" in fields["__tensor_names__"]:
        raise ValueError(f"{source}: GGUF rope_freqs (Llama 3.1 rope scaling) is not supported; "
                         "serve the Hugging Face checkpoint instead")
    return ModelArch(
        architecture=GGUF_ARCHITECTURES[name],
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_hidden_layers=int(get("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(get("attention.head_count_kv", heads)),
        head_dim=int(get("attention.key_length", get("rope.dimension_count", hidden // heads))),
        max_position_embeddings=int(get("context_length")),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        tie_word_embeddings="output.weight" not in fields["__tensor_names__"],
        torch_dtype="float32",
    )
