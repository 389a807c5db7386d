"""`ModelRunner`: the only place that knows about the device (docs/architecture.md, rule 7).

It loads the model, sizes and allocates the paged KV cache, keeps each request's tokens and
block table between steps, and runs one step: prepare inputs, forward over the ragged batch,
logits of each sampling request's last token, sample, append the samples to its own state. A
request that asks for prompt logprobs has its prompt rows scored too (worker/prompt_logprobs.py),
delivered with its first sampled token. With speculative decoding it also verifies the drafts
the scheduler sends (spec_decode/rejection.py) and, on rank 0, proposes the next ones
(spec_decode/proposer.py).
"""

from __future__ import annotations

import ctypes
import logging

import torch

from kvasir_engine.checkpoint.loader import load_weights
from kvasir_engine.checkpoint.metadata import read_eos_token_ids
from kvasir_engine.config import EngineConfig, RuntimeInfo
from kvasir_engine.core.outputs import KVLoad, ModelRunnerOutput, RequestError, SchedulerOutput
from kvasir_engine.core.request import LogprobsEntry
from kvasir_engine.kernels.choice import build_kernel_choice
from kvasir_engine.kernels.host import cpu_threads
from kvasir_engine.kernels.threads import ThreadGovernor
from kvasir_engine.kv_transfer.connector import BLOCKS_GONE, KVConnector
from kvasir_engine.kv_transfer.tensor_parallel import RankKVTransfer
from kvasir_engine.layers.dense import pack_model
from kvasir_engine.layers.parallel import TensorParallelGroup
from kvasir_engine.layers.prequantized import finish_model, stage_model
from kvasir_engine.layers.quantization import quantize_model
from kvasir_engine.layers.sampler import SamplerOutput, logprobs_entries, sample
from kvasir_engine.models.llama import LayerwiseForward, LlamaForCausalLM
from kvasir_engine.models.pipeline_stage import PipelineStage, whole_model
from kvasir_engine.models.registry import model_class
from kvasir_engine.spec_decode.draft import draft_block_bytes
from kvasir_engine.spec_decode.proposer import Proposer, make_proposer
from kvasir_engine.spec_decode.rejection import accepted_tokens
from kvasir_engine.worker.blame import blame
from kvasir_engine.worker.cuda_graphs import DecodeCUDAGraphs, graphs_enabled
from kvasir_engine.worker.input_batch import (
    PreparedBatch,
    RequestState,
    build_sampling_tensors,
    prepare_batch,
    sample_row_states,
    sample_rows,
)
from kvasir_engine.worker.prompt_logprobs import gather_prompt_logprobs

logger = logging.getLogger(__name__)

# The CPU KV budget when --kv-cache-memory is not given.
DEFAULT_CPU_KV_BYTES = 2 << 30
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Disaggregated prefill's end in this process: the engine's connector (one process), or a
# tensor-parallel rank's (kv_transfer/tensor_parallel.py).
RunnerKVTransfer = KVConnector | RankKVTransfer


class ModelRunner:
    def __init__(self, config: EngineConfig, tp_rank: int = 0,
                 group: TensorParallelGroup | None = None, stage: PipelineStage | None = None,
                 local_rank: int | None = None, kv_connector: RunnerKVTransfer | None = None):
        """`stage`: the pipeline stage this rank runs (default the whole model);
        `local_rank`: this rank's index on its node, its CUDA device (default `tp_rank`);
        `kv_connector`: disaggregated prefill's (kv_transfer/), given the KV tensors."""
        self.config = config
        self.kv_connector = kv_connector
        self.tp_rank, self.tp_size = tp_rank, config.parallel.tensor_parallel_size
        self.group = group
        self.stage = stage or whole_model(config.model.arch)
        self.device = _resolve_device(config.device.device,
                                      tp_rank if local_rank is None else local_rank)
        self.dtype = _DTYPES[config.model.dtype]
        self.kv_dtype = _DTYPES[config.cache.resolved_kv_cache_dtype(config.model.dtype)]
        self.block_size = config.cache.block_size
        self.arch = config.model.arch
        self.eos_token_ids = read_eos_token_ids(config.model.model)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(config.model.seed)
        self.states: dict[str, RequestState] = {}
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.num_kv_blocks = 0
        self.graphs: DecodeCUDAGraphs | None = None
        self.proposer: Proposer | None = None
        self.threads: ThreadGovernor | None = None
        self.cpu_threads = ""  # how many compute threads, and why (/version)
        if self.device.type == "cpu":
            threads, why = cpu_threads()
            torch.set_num_threads(threads)
            self.cpu_threads = f"{threads} ({why})"
            if config.device.adaptive_cpu_threads and not config.device.batch_invariant:
                # Built here, ticked on the thread that runs the steps (start_step).
                self.threads = ThreadGovernor(threads, torch.set_num_threads)
                self.cpu_threads += ", adaptive"
            if tp_rank == 0:
                logger.info("CPU threads: %s", self.cpu_threads)
            _retain_freed_memory()
        # Every kernel of this process, decided here once and handed down to the model.
        self.kernels = build_kernel_choice(config, self.device.type)
        if tp_rank == 0:
            logger.info("kernels: %s", self.kernels.describe())
            if self.kernels.batch_invariant:
                logger.info("--batch-invariant: every attention row through %s, products %s "
                            "(docs/batch_invariance.md)",
                            "the native decode kernel" if self.kernels.decode_attention
                            == "native" else "its torch twin",
                            self.kernels.dense_packing)
        # The decode graphs capture the whole model's forward: one stage runs eagerly.
        self.use_graphs = graphs_enabled(self.device, self.kernels.attention_backend,
                                         config.device.enforce_eager or self.stage.pp_size > 1)
        self.model = self._load_model()

    def _load_model(self) -> LlamaForCausalLM:
        cls = model_class(self.arch.architecture)
        # Build in float32 on CPU so the GGUF float32 dequantization is copied exactly, then cast.
        model = cls(self.arch, self.kernels, self.tp_rank, self.tp_size, self.group, self.stage)
        checkpoint_quantization = self.config.model.checkpoint_quantization
        if checkpoint_quantization is not None:
            stage_model(model, checkpoint_quantization)
        load_weights(model, self.config.model.model, self.arch, self.stage.owns_weight)
        if checkpoint_quantization is not None:
            # Its integer weights packed as they are (int4 / int8); FP8 kept for the GPU's
            # FP8 products, or dequantized (CPU).
            finish_model(model, self.dtype, native=self.kernels.matmul == "native",
                         fp8_device=self.device if self.kernels.fp8_matmul == "scaled_mm"
                         else None)
            if self.tp_rank == 0:
                logger.info("checkpoint quantization: %s, runs as %s",
                            checkpoint_quantization.describe(), self.config.model.quantization
                            or ("FP8 products" if self.kernels.fp8_matmul == "scaled_mm" else
                                f"{self.config.model.dtype} weights dequantized at load"))
        elif self.config.model.quantization is not None:
            # From the float32 weights, before the cast: a Q4_1 GGUF gets its own codes back.
            quantize_model(model, self.config.model.quantization, self.dtype,
                           native=self.kernels.matmul == "native",
                           weight_only_prefill=self.kernels.int4_prefill == "weight_only")
        model = model.to(device=self.device, dtype=self.dtype).eval()
        if self.kernels.dense_packing is not None:
            pack_model(model, self.kernels.dense_packing)
        if self.kernels.fused_decode:
            model.enable_fused_decode()
        return model

    @property
    def num_local_kv_heads(self) -> int:
        return max(1, self.arch.num_key_value_heads // self.tp_size)

    def block_bytes(self) -> int:
        """K and V of one block over this rank's layers."""
        per_token = (2 * self.stage.num_layers * self.num_local_kv_heads
                     * self.arch.head_dim * self.kv_dtype.itemsize)
        return per_token * self.block_size

    def kv_budget_bytes(self) -> int:
        if self.device.type == "cpu":
            return self.config.cache.kv_cache_memory_bytes or DEFAULT_CPU_KV_BYTES
        return self._profile_cuda_budget()

    def _profile_cuda_budget(self) -> int:
        """Device memory left for KV after weights and one worst-case forward's activations."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        num_tokens = min(self.config.scheduler.max_num_batched_tokens,
                         self.config.model.max_model_len)
        probe_blocks = -(-num_tokens // self.block_size)
        self._allocate_kv(probe_blocks)
        before_forward = torch.cuda.memory_allocated(self.device)
        with torch.inference_mode():
            batch = self._dummy_batch(num_tokens)
            given = None if self.stage.is_first else torch.zeros(
                num_tokens, self.arch.hidden_size, dtype=self.dtype, device=self.device)
            hidden, _ = self.model.forward_stage(batch.input_ids, batch.positions,
                                                 self.kv_caches, batch.meta, given, given)
            if self.stage.is_last:
                self.model.compute_logits(hidden[-1:])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - probe_blocks * self.block_bytes()
        activations = torch.cuda.max_memory_allocated(self.device) - before_forward
        self.kv_caches = []
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(self.device).total_memory
        # The decode graphs' pool holds the activations of at most max_num_seqs tokens, which
        # is no more than this max_num_batched_tokens forward needed: keep that much free.
        graph_reserve = activations if self.use_graphs else 0
        return int(total * self.config.cache.gpu_memory_utilization) - peak - graph_reserve

    def _dummy_batch(self, num_tokens: int) -> PreparedBatch:
        from kvasir_engine.core.outputs import SchedulerOutput as SO
        from kvasir_engine.core.request import SamplingParams

        state = RequestState("__profile__", [0] * num_tokens, num_tokens, SamplingParams(),
                             list(range(-(-num_tokens // self.block_size))), 0)
        so = SO([], [], {"__profile__": num_tokens}, num_tokens)
        return prepare_batch(so, {"__profile__": state}, self.block_size, self.device,
                             self.arch.vocab_size, self.eos_token_ids)

    def initialize_kv_cache(self) -> RuntimeInfo:
        budget = self.kv_budget_bytes()
        # A draft model's cache has as many blocks as the target's, from the same budget.
        bytes_per_block = self.block_bytes() + draft_block_bytes(self.config, self.kv_dtype)
        num_blocks = max(0, budget // bytes_per_block)
        needed = -(-self.config.model.max_model_len // self.block_size)
        if num_blocks < needed:
            raise ValueError(
                f"KV cache budget of {budget} bytes holds {num_blocks} blocks of "
                f"{self.block_size} tokens, but --max-model-len {self.config.model.max_model_len}"
                f" needs {needed} ({needed * bytes_per_block} bytes); raise "
                f"--kv-cache-memory / --gpu-memory-utilization or lower --max-model-len")
        self._allocate_kv(num_blocks)
        if self.kv_connector is not None:
            self.kv_connector.register_kv_caches(self.kv_caches)
        if self.tp_rank == 0:  # only rank 0 answers, so only it proposes
            self.proposer = make_proposer(self.config, self.kernels, self.device, self.dtype,
                                          self.kv_dtype, num_blocks)
        if self.use_graphs:
            self._capture_graphs()
        return RuntimeInfo(num_kv_blocks=num_blocks, block_size=self.block_size,
                           eos_token_ids=self.eos_token_ids, device=self.device.type,
                           kv_cache_bytes=num_blocks * self.block_bytes(),
                           kernels={**self.kernels.as_dict(),
                                    **({"cpu_threads": self.cpu_threads}
                                       if self.cpu_threads else {})})

    def _allocate_kv(self, num_blocks: int) -> None:
        shape = (num_blocks, self.block_size, self.num_local_kv_heads, self.arch.head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=self.kv_dtype, device=self.device),
             torch.zeros(shape, dtype=self.kv_dtype, device=self.device))
            for _ in range(self.stage.num_layers)]
        self.num_kv_blocks = num_blocks

    def _capture_graphs(self) -> None:
        """Part of start-up, so it happens before the server's /ready turns 200."""
        self.graphs = DecodeCUDAGraphs(
            lambda ids, pos, meta: self.model(ids, pos, self.kv_caches, meta),
            self.config.scheduler.max_num_seqs, self.config.model.max_model_len,
            self.block_size, self.arch.hidden_size, self.dtype, self.device)
        self.graphs.capture()

    def forward(self, batch: PreparedBatch) -> torch.Tensor:
        """[T, hidden]: a captured decode graph when one fits the batch, else eager."""
        if self.graphs is not None and self.graphs.can_run(batch.meta):
            return self.graphs.run(batch.input_ids, batch.positions, batch.meta)
        hidden: torch.Tensor = self.model(batch.input_ids, batch.positions, self.kv_caches,
                                          batch.meta)
        return hidden

    def _start_forward(self, batch: PreparedBatch) -> LayerwiseForward | torch.Tensor:
        """The batch's pass a layer at a time; or, for a captured decode graph, its result."""
        if self.graphs is not None and self.graphs.can_run(batch.meta):
            return self.graphs.run(batch.input_ids, batch.positions, batch.meta)
        return self.model.start_forward(batch.input_ids, batch.positions, self.kv_caches,
                                        batch.meta)

    def update_states(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids:
            self.states.pop(req_id, None)
        if self.proposer is not None and so.finished_req_ids:
            self.proposer.forget(so.finished_req_ids)
        for new in so.scheduled_new_reqs:
            try:
                self.states[new.request_id] = RequestState(
                    new.request_id, list(new.token_ids), new.num_prompt_tokens,
                    new.sampling_params, list(new.block_ids), new.num_computed_tokens)
            except ValueError as e:
                raise RequestError([new.request_id], str(e)) from e
            if new.kv_load is not None:
                self._load_kv(new.request_id, new.kv_load)
        for cached in so.scheduled_cached_reqs:
            state = self.states[cached.request_id]
            if cached.num_kept_blocks is not None:  # rejected drafts gave blocks back
                del state.block_ids[cached.num_kept_blocks:]
            state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    def _load_kv(self, request_id: str, load: KVLoad) -> None:
        """A consumer's received K/V into the request's blocks, before any forward reads them."""
        try:
            assert self.kv_connector is not None, "a KV load without a connector"
            self.kv_connector.load(load)
        except KeyError:
            raise RequestError([request_id], BLOCKS_GONE) from None

    def prepare(self, so: SchedulerOutput) -> PreparedBatch:
        try:
            return self._prepare(so)
        except Exception as e:
            culprits = blame(list(so.num_scheduled_tokens),
                             lambda req_id: self._prepare(so.restricted_to({req_id})), e)
            if culprits is None:
                raise
            raise culprits from e

    def _prepare(self, so: SchedulerOutput) -> PreparedBatch:
        return prepare_batch(so, self.states, self.block_size, self.device,
                             self.arch.vocab_size, self.eos_token_ids)

    def _sample(self, batch: PreparedBatch, logits: torch.Tensor) -> SamplerOutput:
        """[S, vocab] logits -> the batch's samples; a failure is blamed on the requests whose
        rows fail alone."""
        assert batch.sampling is not None
        try:
            return sample(logits, batch.sampling, self.generator)
        except Exception as e:
            spec = batch.sample_spec_token_ids or [[] for _ in batch.sample_req_ids]
            rows = sample_rows(batch.sample_req_ids, spec)

            def try_alone(req_id: str) -> None:
                first, last = rows[req_id]
                drafts = spec[batch.sample_req_ids.index(req_id)]
                alone = build_sampling_tensors(
                    sample_row_states([self.states[req_id]], [drafts]), self.device,
                    self.arch.vocab_size, self.eos_token_ids)
                sample(logits[first:last], alone, self.generator)

            culprits = blame(batch.sample_req_ids, try_alone, e)
            if culprits is None:
                raise
            raise culprits from e

    @torch.inference_mode()
    def compute_logits(self, batch: PreparedBatch,
                       hidden: torch.Tensor | None = None) -> torch.Tensor:
        """[S, vocab] float32 logits of each sampling request's last scheduled token."""
        hidden = self.forward(batch) if hidden is None else hidden
        return self.model.compute_logits(hidden[batch.logits_indices]).float()

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """One step, whole (`RunnerStep.finish` runs every layer nobody advanced)."""
        return self.start_step(so).finish()

    @torch.inference_mode()
    def start_step(self, so: SchedulerOutput) -> RunnerStep:
        """One step, for the caller to run a decoder layer at a time (`RunnerStep`); between
        two layers it may run `execute_model` for another plan."""
        if self.threads is not None:
            self.threads.tick()
        self.update_states(so)
        if so.is_empty:
            return RunnerStep(self, so, None, None)
        batch = self.prepare(so)
        return RunnerStep(self, so, batch, self._start_forward(batch))

    def finish_step(self, so: SchedulerOutput, batch: PreparedBatch,
                    hidden: torch.Tensor) -> ModelRunnerOutput:
        """After the forward pass ([T, hidden]): prompt logprobs, sampling, the output."""
        if batch.prompt_spans:
            gather_prompt_logprobs(self.model.compute_logits, hidden, batch.prompt_spans,
                                   self.states)
        sampled: dict[str, tuple[list[int], list[LogprobsEntry] | None]] = {}
        for req_id in batch.req_ids:
            self.states[req_id].num_computed_tokens += so.num_scheduled_tokens[req_id]
        if batch.sampling is not None:
            out = self._sample(batch, self.compute_logits(batch, hidden))
            sampled = self._collect(batch, out)
        token_lists, logprob_lists = [], []
        prompt_lists: list[list[LogprobsEntry] | None] = []
        for req_id in batch.req_ids:
            tokens, entries = sampled.get(req_id, ([], None))
            token_lists.append(tokens)
            logprob_lists.append(entries)
            prompt_lists.append(self._deliver_prompt_logprobs(req_id) if tokens else None)
        if all(p is None for p in prompt_lists):
            prompt_lists = []
        return ModelRunnerOutput(list(batch.req_ids), token_lists, logprob_lists, prompt_lists,
                                 self._propose(so, batch.req_ids))

    def _propose(self, so: SchedulerOutput, req_ids: list[str]) -> list[list[int]]:
        """Drafts for the next step, parallel to req_ids; [] when nobody asked."""
        if self.proposer is None or not so.num_spec_tokens_to_propose:
            return []
        wanted = [(req_id, self.states[req_id].token_ids, num)
                  for req_id, num in so.num_spec_tokens_to_propose.items()
                  if req_id in self.states]
        drafts = self.proposer.propose(wanted)
        return [drafts.get(req_id, []) for req_id in req_ids]

    def _deliver_prompt_logprobs(self, req_id: str) -> list[LogprobsEntry] | None:
        """The whole prompt's logprobs once its first token is sampled; None ever after."""
        state = self.states[req_id]
        owed, state.prompt_logprobs = state.prompt_logprobs, None
        return owed

    def _collect(self, batch: PreparedBatch, out: SamplerOutput
                 ) -> dict[str, tuple[list[int], list[LogprobsEntry] | None]]:
        """Each sampling request's emitted tokens (one; or, verifying drafts, the accepted
        drafts and one more), appended to its state, with their logprobs when asked."""
        tokens = out.token_ids.tolist()
        states = [self.states[req_id] for req_id in batch.sample_req_ids]
        spec = batch.sample_spec_token_ids or [[] for _ in states]
        row_tops = [state.sampling_params.logprobs or 0
                    for state, drafts in zip(states, spec, strict=True)
                    for _ in range(len(drafts) + 1)]
        entries: list[LogprobsEntry] = []
        if out.logprobs is not None:
            entries = logprobs_entries(tokens, out.logprobs, row_tops)
        result: dict[str, tuple[list[int], list[LogprobsEntry] | None]] = {}
        row = 0
        for state, drafts in zip(states, spec, strict=True):
            emitted = (accepted_tokens(tokens[row:row + len(drafts) + 1], drafts) if drafts
                       else [tokens[row]])
            state.token_ids.extend(emitted)
            # Only the accepted drafts' K/V stay valid; the rejected ones are recomputed.
            state.num_computed_tokens -= len(drafts) + 1 - len(emitted)
            wants_logprobs = state.sampling_params.logprobs is not None and bool(entries)
            result[state.request_id] = (
                emitted, entries[row:row + len(emitted)] if wants_logprobs else None)
            row += len(drafts) + 1
        return result


class RunnerStep:
    """A step in flight on the runner: `advance` runs its forward pass a decoder layer at a
    time (False once none is left; a captured graph or the fused decode call ran whole at the
    start), `finish` runs what is left and samples."""

    def __init__(self, runner: ModelRunner, so: SchedulerOutput, batch: PreparedBatch | None,
                 forward: LayerwiseForward | torch.Tensor | None) -> None:
        self._runner, self._so, self._batch, self._forward = runner, so, batch, forward

    @torch.inference_mode()
    def advance(self) -> bool:
        return isinstance(self._forward, LayerwiseForward) and self._forward.run_next_layer()

    @torch.inference_mode()
    def finish(self) -> ModelRunnerOutput:
        if self._batch is None or self._forward is None:
            return ModelRunnerOutput([], [], [])
        if isinstance(self._forward, torch.Tensor):
            hidden = self._forward
        else:
            while self._forward.run_next_layer():
                pass
            hidden = self._forward.result()
        return self._runner.finish_step(self._so, self._batch, hidden)


def _retain_freed_memory() -> None:
    """Serve large CPU temporaries from the heap and keep freed pages: by default glibc maps
    and unmaps each one, so every layer pays page faults on fresh memory (~15% of a prefill)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return  # not glibc: its allocator has its own policy
    libc.mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD, glibc's ceiling on 64-bit
    libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD


def _resolve_device(device: str, tp_rank: int) -> torch.device:
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        return torch.device("cuda", tp_rank % max(1, torch.cuda.device_count()))
    return torch.device("cpu")
