"""CUDA graphs for decode steps: captured once per batch size of a ladder during warm-up.

A decode step of a small batch is dominated by kernel-launch overhead (hundreds of launches for
a few microseconds of work each), so the model runner replays a graph instead. Graphs need
static shapes and addresses: every input lives in a persistent buffer sized for the largest
batch, a batch of n requests is padded to the next captured size, and the attention metadata is
built from views of those buffers with `max_seq_len = max_model_len` (the Triton decode
kernel's grid then never changes; see kernels/paged_attention.py). Padding rows decode token 0
at position 0 into slot 0, which lies in the block pool's reserved null block 0, with a context
of that one slot, so they touch no request's cache.

Only the Triton backend is graph-safe (the torch backend reads Python-side lengths); with any
other backend, on CPU, or with --enforce-eager, the runner stays eager.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from typing import Any

import torch

from kvasir_engine.attention.metadata import AttentionMetadata

# [T] input ids, [T] positions, metadata -> [T, hidden]
ModelForward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, then every multiple of 8 up to max_num_seqs (vLLM's ladder): padding wastes
    at most 7 rows while the number of graphs (and their memory) stays small."""
    sizes = [s for s in (1, 2, 4) if s <= max_num_seqs]
    sizes += list(range(8, max_num_seqs + 1, 8))
    if sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


def padded_batch_size(num_reqs: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds num_reqs requests; None if none does."""
    i = bisect.bisect_left(sizes, num_reqs)
    return sizes[i] if i < len(sizes) else None


def graphs_enabled(device: torch.device, backend_name: str, enforce_eager: bool) -> bool:
    return device.type == "cuda" and backend_name == "triton" and not enforce_eager


class DecodeCUDAGraphs:
    def __init__(self, forward: ModelForward, max_num_seqs: int, max_model_len: int,
                 block_size: int, hidden_size: int, dtype: torch.dtype, device: torch.device):
        self.forward = forward
        self.sizes = capture_sizes(max_num_seqs)
        self.max_model_len = max_model_len
        max_bs, max_blocks = self.sizes[-1], -(-max_model_len // block_size)
        self.input_ids = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.slot_mapping = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(max_bs, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(max_bs, max_blocks, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(max_bs + 1, dtype=torch.int32, device=device)
        self.hidden = torch.zeros(max_bs, hidden_size, dtype=dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool: Any = None  # the memory pool all graphs share

    def _meta(self, batch_size: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:batch_size],
            query_start_loc=self.query_start_loc[:batch_size + 1],
            seq_lens=self.seq_lens[:batch_size],
            block_tables=self.block_tables[:batch_size],
            max_query_len=1, max_seq_len=self.max_model_len,
            query_start_loc_cpu=tuple(range(batch_size + 1)), seq_lens_cpu=(1,) * batch_size,
            is_decode_only=True)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first so smaller graphs reuse its memory pool."""
        for batch_size in reversed(self.sizes):
            meta = self._meta(batch_size)
            ids, pos = self.input_ids[:batch_size], self.positions[:batch_size]
            self.forward(ids, pos, meta)  # warm-up: compiles kernels, settles allocations
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.hidden[:batch_size] = self.forward(ids, pos, meta)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[batch_size] = graph
        torch.cuda.synchronize()

    def can_run(self, meta: AttentionMetadata) -> bool:
        return (meta.is_decode_only and meta.max_seq_len <= self.max_model_len
                and meta.block_tables.shape[1] <= self.block_tables.shape[1]
                and padded_batch_size(meta.num_reqs, self.sizes) in self.graphs)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            meta: AttentionMetadata) -> torch.Tensor:  # [num_reqs, hidden]
        """Replay the graph of the next captured size; the caller checked `can_run`."""
        n = meta.num_reqs
        batch_size = padded_batch_size(n, self.sizes)
        if batch_size is None or batch_size not in self.graphs:
            raise ValueError(f"no decode graph holds {n} requests (captured: {self.sizes})")
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.seq_lens[:n].copy_(meta.seq_lens)
        width = meta.block_tables.shape[1]
        self.block_tables[:n, :width].copy_(meta.block_tables)
        self.block_tables[:n, width:].zero_()
        # Padding rows: token 0 at position 0 into the null block's slot 0, one-slot context.
        self.input_ids[n:batch_size].zero_()
        self.positions[n:batch_size].zero_()
        self.slot_mapping[n:batch_size].zero_()
        self.seq_lens[n:batch_size].fill_(1)
        self.block_tables[n:batch_size].zero_()
        self.graphs[batch_size].replay()
        return self.hidden[:n]
