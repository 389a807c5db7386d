"""`EngineConfig`: the frozen, validated configuration of one engine, passed down explicitly.

Built once (from the command line or the environment, in `args.py`) and never mutated. Facts
learned later at start-up (the number of KV blocks after memory profiling, EOS ids) live in
`RuntimeInfo`, not here (docs/architecture.md, rule 1).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from kvasir_engine.checkpoint.arch import ModelArch
from kvasir_engine.checkpoint.quant_config import KERNEL_FP8, CheckpointQuantization

DTYPES = ("auto", "float32", "bfloat16", "float16")
# The KV cache's dtype: "auto" is the compute dtype; bfloat16 under float32 compute on CPU
# halves the cache's memory and what decode attention reads each step (as llama.cpp's default
# float16 cache does), at bfloat16's rounding of K and V.
KV_CACHE_DTYPES = DTYPES
DEVICES = ("auto", "cpu", "cuda")
ATTENTION_BACKENDS = ("auto", "torch", "triton")
# Weight quantization applied after loading (layers/quantization.py); None keeps --dtype weights.
QUANTIZATIONS = ("int8", "int4")
# vLLM's names for a pre-quantized checkpoint's format: --quantization with one of these only
# asserts what the checkpoint is (checkpoint/quant_config.py reads it; a mismatch is refused).
CHECKPOINT_QUANTIZATIONS = ("compressed-tensors", "gptq", "awq", "fp8")
# How the scheduler picks among waiting requests: "fair" serves the tenant that has received the
# least weighted service first (core/fair_share.py), FCFS within a tenant; "fcfs" is arrival order.
SCHEDULING_POLICIES = ("fair", "fcfs")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@dataclass(frozen=True)
class ModelConfig:
    model: str  # a Hugging Face directory or a .gguf file
    arch: ModelArch
    served_model_name: str
    # The compute dtype after resolving "auto" (float32 on CPU unless asked, the checkpoint's on GPU).
    dtype: str
    max_model_len: int
    seed: int = 0
    # The native tiles the weights run on: --quantization's, or a pre-quantized checkpoint's.
    quantization: str | None = None
    # A pre-quantized checkpoint's quantization_config (checkpoint/quant_config.py), or None.
    checkpoint_quantization: CheckpointQuantization | None = None

    def __post_init__(self) -> None:
        _require(self.dtype in DTYPES[1:], f"--dtype must be one of {DTYPES[1:]}, got {self.dtype!r}")
        _require(self.max_model_len >= 1, f"--max-model-len must be >= 1, got {self.max_model_len}")
        _require(bool(self.served_model_name), "--served-model-name must not be empty")
        _require(self.quantization is None or self.quantization in QUANTIZATIONS,
                 f"--quantization must be one of {QUANTIZATIONS} or omitted, "
                 f"got {self.quantization!r}")
        cq = self.checkpoint_quantization
        if cq is not None:
            runs_as = None if cq.kernel == KERNEL_FP8 else cq.kernel
            _require(self.quantization == runs_as,
                     f"--quantization {self.quantization} disagrees with the checkpoint's "
                     f"{cq.describe()}, which runs as "
                     f"{runs_as or 'its dequantized weights'}; omit --quantization")


def resolve_quantization(flag: str | None, checkpoint: CheckpointQuantization | None,
                         ) -> str | None:
    """`ModelConfig.quantization`: the flag's, or the tiles a pre-quantized checkpoint runs on
    when the flag is omitted or names the checkpoint's format (`CHECKPOINT_QUANTIZATIONS`, as
    vLLM spells them); a format the checkpoint is not is refused here, an int8 / int4 that
    disagrees with it by ModelConfig."""
    if flag in CHECKPOINT_QUANTIZATIONS:
        if checkpoint is None:
            raise ValueError(f"--quantization {flag} names a pre-quantized checkpoint format, "
                             "but the checkpoint's config.json has no quantization_config")
        is_format = (checkpoint.kernel == KERNEL_FP8 if flag == "fp8"
                     else checkpoint.quant_method == flag)
        if not is_format:
            raise ValueError(f"--quantization {flag} disagrees with the checkpoint's "
                             f"{checkpoint.describe()}")
        flag = None
    if flag is not None or checkpoint is None or checkpoint.kernel == KERNEL_FP8:
        return flag
    return checkpoint.kernel


@dataclass(frozen=True)
class CacheConfig:
    # Tokens per KV block; 16 matches vLLM's default and keeps prefix-hash granularity fine.
    block_size: int = 16
    # CPU: the KV budget in bytes. None on CPU means the default of 2 GiB.
    kv_cache_memory_bytes: int | None = None
    # GPU: fraction of device memory for weights + activations + KV, as in vLLM.
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        _require(self.kv_cache_dtype in KV_CACHE_DTYPES,
                 f"--kv-cache-dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        _require(self.block_size in (1, 2, 4, 8, 16, 32, 64, 128, 256),
                 f"--block-size must be a power of two up to 256, got {self.block_size}")
        _require(self.kv_cache_memory_bytes is None or self.kv_cache_memory_bytes > 0,
                 f"--kv-cache-memory must be positive, got {self.kv_cache_memory_bytes}")
        _require(0 < self.gpu_memory_utilization <= 1,
                 f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}")

    def resolved_kv_cache_dtype(self, compute_dtype: str) -> str:
        return compute_dtype if self.kv_cache_dtype == "auto" else self.kv_cache_dtype


@dataclass(frozen=True)
class SchedulerConfig:
    max_model_len: int
    # Requests decoding at once. 256 is vLLM's GPU default; CPUs saturate far earlier.
    max_num_seqs: int = 256
    # Tokens per forward pass (decodes + prefill chunks). Long prompts are chunked to fit.
    max_num_batched_tokens: int = 2048
    # Requests (sequences) waiting beyond the free running slots; more are refused (429).
    # None = unbounded (offline); the server then bounds at 4 x max_num_seqs (admission.py).
    max_queue_len: int | None = None
    # "fair" by default: with one tenant (or none named) it admits in exactly FCFS order, and with
    # several it keeps a flooding tenant from delaying the others' first tokens.
    policy: str = "fair"
    # (tenant, weight) pairs of the fair share; unnamed tenants weigh 1.0. Weight 2 gets about
    # twice the token service of weight 1 while both have requests waiting.
    tenant_weights: tuple[tuple[str, float], ...] = ()
    # A tenant with this many running requests has the rest of its requests wait; None = no bound.
    max_running_seqs_per_tenant: int | None = None
    # Under "fair": prompt tokens a step computes for the tenants at or above their share of the
    # slots while a tenant below its share is present (core/fair_share.py); 0 = no cap.
    max_prefill_tokens_over_share: int = 0
    # Under "fair": a tenant's first request that arrives during a step runs its prefill between
    # two of that step's decoder layers (core/scheduler.py, "Interjection"; in-process only).
    interject_first_tokens: bool = True

    def __post_init__(self) -> None:
        _require(self.max_num_seqs >= 1, f"--max-num-seqs must be >= 1, got {self.max_num_seqs}")
        _require(self.max_num_batched_tokens >= self.max_num_seqs,
                 f"--max-num-batched-tokens ({self.max_num_batched_tokens}) must be >= "
                 f"--max-num-seqs ({self.max_num_seqs})")
        _require(self.max_queue_len is None or self.max_queue_len >= 0,
                 f"--max-queue-len must be >= 0, got {self.max_queue_len}")
        _require(self.policy in SCHEDULING_POLICIES,
                 f"--scheduling-policy must be one of {SCHEDULING_POLICIES}, got {self.policy!r}")
        tenants = [tenant for tenant, _ in self.tenant_weights]
        _require(all(tenants), "--tenant-weight: the tenant name must not be empty")
        _require(len(set(tenants)) == len(tenants),
                 f"--tenant-weight: a tenant is given twice in {tenants}")
        for tenant, weight in self.tenant_weights:
            _require(math.isfinite(weight) and weight > 0,
                     f"--tenant-weight {tenant}: the weight must be a finite number > 0, "
                     f"got {weight}")
        _require(self.max_running_seqs_per_tenant is None or self.max_running_seqs_per_tenant >= 1,
                 f"--max-running-seqs-per-tenant must be >= 1, "
                 f"got {self.max_running_seqs_per_tenant}")
        _require(self.max_prefill_tokens_over_share >= 0,
                 f"--max-prefill-tokens-over-share must be >= 0 (0 = no cap), "
                 f"got {self.max_prefill_tokens_over_share}")


@dataclass(frozen=True)
class ParallelConfig:
    """How one engine spans processes: `pipeline_parallel_size` stages of contiguous layers,
    each sharded over `tensor_parallel_size` ranks, on `nnodes` nodes (torchrun's names).

    Global rank = stage x tensor_parallel_size + tensor-parallel rank; node `node_rank` runs the
    `world_size / nnodes` consecutive ranks from `node_rank x ranks_per_node`, so tensor
    parallelism stays inside a node whenever a node holds whole stages."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    # Where node 0 hosts the rendezvous store (a torch TCPStore); only read when nnodes > 1
    # (one node rendezvouses on a free loopback port).
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    # How long a node waits for the others to join (and agree on the config) before it fails
    # naming the missing ones: pods of one group can start minutes apart (image pulls).
    rendezvous_timeout_s: float = 300.0
    # How long a node may go without a heartbeat in the store before the others call it gone
    # (distributed/heartbeat.py): a vanished node closes nothing an idle engine waits on. A few
    # seconds: well above a beat every 0.25 s and a scheduler hiccup, well below a probe's period.
    node_heartbeat_timeout_s: float = 5.0
    # Micro-batches a pipeline step's requests are cut into, so stages overlap within a step.
    # None: 1. On CPU two halve the bubble but cost more in per-operator overhead at half the
    # batch than they save (docs/parallelism.md); they pay where a step is compute-bound.
    pipeline_micro_batches: int | None = None

    def __post_init__(self) -> None:
        _require(self.tensor_parallel_size >= 1,
                 f"--tensor-parallel-size must be >= 1, got {self.tensor_parallel_size}")
        _require(self.pipeline_parallel_size >= 1,
                 f"--pipeline-parallel-size must be >= 1, got {self.pipeline_parallel_size}")
        _require(self.nnodes >= 1, f"--nnodes must be >= 1, got {self.nnodes}")
        _require(0 <= self.node_rank < self.nnodes,
                 f"--node-rank must be in [0, {self.nnodes}) for --nnodes {self.nnodes}, "
                 f"got {self.node_rank}")
        _require(self.world_size % self.nnodes == 0,
                 f"--nnodes {self.nnodes} does not divide the {self.world_size} ranks of "
                 f"--tensor-parallel-size {self.tensor_parallel_size} x "
                 f"--pipeline-parallel-size {self.pipeline_parallel_size}")
        _require(0 < self.master_port < 65536,
                 f"--master-port must be in [1, 65535], got {self.master_port}")
        _require(bool(self.master_addr), "--master-addr must not be empty")
        _require(self.pipeline_micro_batches is None or self.pipeline_micro_batches >= 1,
                 f"--pipeline-micro-batches must be >= 1, got {self.pipeline_micro_batches}")
        _require(self.rendezvous_timeout_s > 0,
                 f"--rendezvous-timeout must be > 0 seconds, got {self.rendezvous_timeout_s}")
        _require(self.node_heartbeat_timeout_s > 0,
                 f"--node-heartbeat-timeout must be > 0 seconds, "
                 f"got {self.node_heartbeat_timeout_s}")

    @property
    def num_micro_batches(self) -> int:
        return self.pipeline_micro_batches or 1

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes

    @property
    def node_ranks(self) -> range:
        """The global ranks this node runs."""
        return range(self.node_rank * self.ranks_per_node,
                     (self.node_rank + 1) * self.ranks_per_node)

    @property
    def is_multiprocess(self) -> bool:
        return self.world_size > 1 or self.nnodes > 1


@dataclass(frozen=True)
class DeviceConfig:
    device: str = "auto"
    attention_backend: str = "auto"
    # Disable CUDA-graph capture of decode steps.
    enforce_eager: bool = False
    # --batch-invariant: a request's greedy output does not depend on the batch around it
    # (docs/batch_invariance.md); kernels/choice.py picks the kernels that keep it.
    batch_invariant: bool = False
    # --adaptive-cpu-threads: the CPU compute team shrinks while a neighbour at our priority
    # runs on our cores, and grows back when they are free (kernels/threads.py).
    adaptive_cpu_threads: bool = True

    def __post_init__(self) -> None:
        _require(self.device in DEVICES, f"--device must be one of {DEVICES}, got {self.device!r}")
        _require(self.attention_backend in ATTENTION_BACKENDS,
                 f"--attention-backend must be one of {ATTENTION_BACKENDS}, "
                 f"got {self.attention_backend!r}")


# --speculative-config methods: "ngram" (prompt lookup) and "draft_model" (a small checkpoint).
SPECULATIVE_METHODS = ("ngram", "draft_model")
# The most draft tokens one step verifies; more only adds rows that are rarely accepted.
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (`--speculative-config`, vLLM's keys; docs/speculative.md)."""

    method: str
    num_speculative_tokens: int
    # ngram: the longest and shortest suffix of the sequence looked up earlier in it.
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    # draft_model: the checkpoint that proposes (same tokenizer as the target).
    model: str | None = None
    # No proposals while this many requests or more decode at once (the step is compute-bound,
    # verifying k extra tokens per request would cost more than it saves); None = never.
    disable_by_batch_size: int | None = None
    # Ours: a request whose draft acceptance (an EWMA over its steps) falls below this stops
    # proposing, and probes again later; the break-even of verifying the extra tokens.
    min_acceptance_rate: float = 0.3

    def __post_init__(self) -> None:
        key = "--speculative-config"
        _require(self.method in SPECULATIVE_METHODS,
                 f"{key}: method must be one of {SPECULATIVE_METHODS}, got {self.method!r}")
        _require(1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS,
                 f"{key}: num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], "
                 f"got {self.num_speculative_tokens}")
        _require(1 <= self.prompt_lookup_min <= self.prompt_lookup_max,
                 f"{key}: need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                 f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")
        _require((self.model is not None) == (self.method == "draft_model"),
                 f"{key}: model is required for method draft_model and only for it")
        _require(self.disable_by_batch_size is None or self.disable_by_batch_size >= 1,
                 f"{key}: disable_by_batch_size must be >= 1, got {self.disable_by_batch_size}")
        _require(0 <= self.min_acceptance_rate <= 1,
                 f"{key}: min_acceptance_rate must be in [0, 1], got {self.min_acceptance_rate}")


# --kv-transfer-config: the connectors built (vLLM's are NixlConnector, P2pNcclConnector, ...;
# ours speak their own block protocol over TCP, kv_transfer/wire.py, the blocks themselves in
# TCP frames or over a torch.distributed process group) and the roles, as vLLM spells them.
KV_CONNECTORS = ("TCPConnector", "TorchDistConnector")
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")


@dataclass(frozen=True)
class KVTransferConfig:
    """Disaggregated prefill and decode (`--kv-transfer-config`, vLLM's keys; docs/disaggregation.md).

    A producer runs prompts and keeps each one's KV blocks for a consumer to fetch from its
    block server on `kv_ip:kv_port`; a consumer fetches them into its own cache and decodes."""

    kv_connector: str
    kv_role: str
    # Producer: the address its block server binds and advertises in kv_transfer_params.
    kv_ip: str = "127.0.0.1"
    kv_port: int = 14579  # vLLM's default kv_port
    # Names this engine in kv_transfer_params; "" = "kv_ip:kv_port".
    engine_id: str = ""
    # Consumer: bytes of received blocks staged at once, waiting to be written into the cache;
    # a fetch that would exceed it is not made (the request prefills locally). 1 GiB: vLLM's
    # default kv_buffer_size.
    kv_buffer_size: int = 1 << 30
    # Producer (ours, in kv_connector_extra_config): seconds a finished prompt's blocks wait
    # for their consumer before they are freed; long enough for a queued decode to start.
    hold_timeout_s: float = 60.0
    # Consumer (ours, in kv_connector_extra_config): seconds one fetch may take in all, the
    # handshake included, before the request prefills locally.
    transfer_timeout_s: float = 10.0
    # Consumer (ours, in kv_connector_extra_config): "host:port" block servers known at start;
    # each is asked for the handshake before the port opens, and one that differs fails the
    # start (one line). Producers that a request names later are checked at their first
    # transfer.
    producers: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        key = "--kv-transfer-config"
        for address in self.producers:
            host, _, port = address.rpartition(":")
            _require(bool(host) and port.isdigit() and 0 < int(port) < 65536,
                     f"{key}: producers: each must be host:port, got {address!r}")
        _require(self.kv_connector in KV_CONNECTORS,
                 f"{key}: kv_connector must be one of {KV_CONNECTORS}, got {self.kv_connector!r}")
        _require(self.kv_role in KV_ROLES,
                 f"{key}: kv_role must be one of {KV_ROLES}, got {self.kv_role!r}")
        _require(bool(self.kv_ip), f"{key}: kv_ip must not be empty")
        _require(0 < self.kv_port < 65536, f"{key}: kv_port must be in [1, 65535], "
                                           f"got {self.kv_port}")
        _require(self.kv_buffer_size > 0,
                 f"{key}: kv_buffer_size must be > 0 bytes, got {self.kv_buffer_size}")
        _require(math.isfinite(self.hold_timeout_s) and self.hold_timeout_s > 0,
                 f"{key}: hold_timeout_s must be > 0 seconds, got {self.hold_timeout_s}")
        _require(math.isfinite(self.transfer_timeout_s) and self.transfer_timeout_s > 0,
                 f"{key}: transfer_timeout_s must be > 0 seconds, got {self.transfer_timeout_s}")

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @property
    def resolved_engine_id(self) -> str:
        return self.engine_id or f"{self.kv_ip}:{self.kv_port}"


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig = ParallelConfig()
    device: DeviceConfig = DeviceConfig()
    speculative: SpeculativeConfig | None = None
    kv_transfer: KVTransferConfig | None = None

    def __post_init__(self) -> None:
        arch, tp = self.model.arch, self.parallel.tensor_parallel_size
        _require(self.scheduler.max_model_len == self.model.max_model_len,
                 "scheduler and model disagree on max_model_len")
        _require(arch.num_attention_heads % tp == 0,
                 f"--tensor-parallel-size {tp} does not divide the model's "
                 f"{arch.num_attention_heads} attention heads")
        _require(self.model.quantization is None or self.device.device != "cuda",
                 f"--quantization {self.model.quantization} runs on CPU only "
                 f"(device {self.device.device!r})")
        kv_dtype = self.cache.resolved_kv_cache_dtype(self.model.dtype)
        _require(kv_dtype == self.model.dtype
                 or ((kv_dtype, self.model.dtype) == ("bfloat16", "float32")
                     and self.device.device != "cuda"),
                 f"--kv-cache-dtype {kv_dtype} needs --dtype {kv_dtype} (or, on CPU, "
                 f"bfloat16 under --dtype float32), got --dtype {self.model.dtype}")
        pp = self.parallel.pipeline_parallel_size
        _require(self.model.quantization is None or self.parallel.world_size == 1,
                 f"--quantization {self.model.quantization} runs on one CPU process only "
                 f"(--tensor-parallel-size {tp} --pipeline-parallel-size {pp})")
        _require(pp <= arch.num_hidden_layers,
                 f"--pipeline-parallel-size {pp} exceeds the model's {arch.num_hidden_layers} "
                 f"layers (every stage needs at least one)")
        # The earlier stages replay the last stage's sampled tokens into their own state; a
        # verification step's rejected drafts are not part of that replay (not built yet).
        _require(self.speculative is None or pp == 1,
                 f"--speculative-config does not run with --pipeline-parallel-size {pp} yet; "
                 f"use tensor parallelism or one process")
        _require(not self.device.batch_invariant or not self._batch_variant_parts(),
                 f"--batch-invariant does not run with {', '.join(self._batch_variant_parts())} "
                 f"(docs/batch_invariance.md)")
        # Each tensor-parallel rank serves and receives its own KV shard (kv_transfer/
        # tensor_parallel.py); a stage's blocks hold only its layers, and other nodes' ranks
        # are not reached: neither is built.
        _require(self.kv_transfer is None or (pp == 1 and self.parallel.nnodes == 1),
                 f"--kv-transfer-config runs with tensor parallelism on one node only for now "
                 f"(--pipeline-parallel-size {pp} --nnodes {self.parallel.nnodes})")
        _require(self.kv_transfer is None or self.kv_transfer.kv_port + tp - 1 < 65536,
                 f"--kv-transfer-config: kv_port + --tensor-parallel-size - 1 must be <= 65535 "
                 f"(rank r serves on kv_port + r), got kv_port "
                 f"{self.kv_transfer.kv_port if self.kv_transfer else 0}")

    def _batch_variant_parts(self) -> list[str]:
        """What --batch-invariant cannot hold invariant (or has not been shown to)."""
        parts = []
        if self.device.device == "cuda":
            parts.append("a CUDA device")
        if self.model.checkpoint_quantization is not None:
            parts.append("a pre-quantized checkpoint")
        if self.parallel.is_multiprocess:
            parts.append("more than one process")
        if self.speculative is not None and self.speculative.method != "ngram":
            parts.append("a draft model (--speculative-config)")
        return parts


@dataclass(frozen=True)
class RuntimeInfo:
    """Facts learned at start-up, after the model is loaded and memory profiled."""

    num_kv_blocks: int
    block_size: int
    eos_token_ids: frozenset[int]
    device: str  # "cpu" or "cuda"
    kv_cache_bytes: int
    # The model runner's kernel choice (kernels/choice.py:KernelChoice.as_dict), op -> kernel.
    kernels: Mapping[str, str | bool] = field(default_factory=dict)
