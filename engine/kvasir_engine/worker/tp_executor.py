"""`TPExecutor`: the core's `Executor` over `tensor_parallel_size` worker processes, one per rank.

Every rank is a spawned process holding a `ModelRunner` with its shard of the weights and of the
KV heads; the ranks meet in a torch.distributed group (NCCL on CUDA, gloo on CPU). The
scheduler runs once, in the engine process: each step its plain `SchedulerOutput` is pickled
down one pipe per rank (docs/architecture.md, rule 6), every rank runs the same forward pass (the parallel layers
all-reduce / all-gather among themselves), and rank 0 sends back the `ModelRunnerOutput`.
Every rank samples from the same gathered logits with the same seeded generator, so their
per-request state stays identical without further messages.

The engine process never joins a collective, so it cannot hang in one: it waits on the rank
pipes *and* the rank processes' sentinels, and a watchdog thread watches the sentinels between
steps. A rank that dies or raises marks the executor failed, the other ranks are killed, the
current or next `execute_model` raises with the rank, pid and exit code, and `on_rank_failure`
(if given) is called at once so a server can turn unhealthy and exit.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch.multiprocessing as mp

from kvasir_engine.config import EngineConfig, RuntimeInfo
from kvasir_engine.core.outputs import ModelRunnerOutput, SchedulerOutput
from kvasir_engine.distributed.parallel_state import (
    destroy_tp_group,
    free_loopback_port,
    init_tp_group,
)

# Seconds a rank may take to load its shard and size its KV cache.
START_TIMEOUT_S = 900.0
# How long an error from one rank waits to see whether a peer was killed (the likelier cause).
PEER_DEATH_GRACE_S = 0.5


def check_tp_fits(config: EngineConfig) -> None:
    """The start-up errors of a tensor-parallel size that cannot work, one clear line each."""
    tp, arch = config.parallel.tensor_parallel_size, config.model.arch
    heads, kv_heads = arch.num_attention_heads, arch.num_key_value_heads
    if heads % tp:
        raise ValueError(f"--tensor-parallel-size {tp} does not divide the model's {heads} "
                         f"attention heads")
    if (tp <= kv_heads and kv_heads % tp) or (tp > kv_heads and tp % kv_heads):
        raise ValueError(f"--tensor-parallel-size {tp} must divide the model's {kv_heads} KV "
                         f"heads or be a multiple of them (KV heads are then replicated)")
    if config.device.device == "cuda" and tp > torch.cuda.device_count():
        raise ValueError(f"--tensor-parallel-size {tp} exceeds the {torch.cuda.device_count()} "
                         f"visible CUDA devices")


def _cpu_ids(tp_rank: int, tp_size: int) -> list[int]:
    """This rank's share of the cores, so the ranks' thread pools do not fight over them."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < tp_size:
        return [cores[tp_rank % len(cores)]]
    per_rank = len(cores) // tp_size
    return cores[tp_rank * per_rank:(tp_rank + 1) * per_rank]


def _run_rank(config: EngineConfig, tp_rank: int, init_method: str, conn: Connection,
              cpu_ids: list[int]) -> None:
    """A rank's process: join the group, load the shard, then run steps until told to stop."""
    from kvasir_engine.worker.model_runner import ModelRunner

    group = None
    try:
        if config.device.device != "cuda":
            os.sched_setaffinity(0, cpu_ids)
        group = init_tp_group(tp_rank, config.parallel.tensor_parallel_size, init_method,
                              config.device.device)
        runner = ModelRunner(config, tp_rank, group)
        info = runner.initialize_kv_cache()
        weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
        conn.send(("ready", (info, weight_bytes)))
        while True:
            kind, payload = conn.recv()
            if kind == "shutdown":
                break
            output = runner.execute_model(payload)
            if tp_rank == 0:
                conn.send(("output", output))
    except EOFError:  # the engine process is gone
        sys.exit(1)
    except BaseException as e:  # noqa: BLE001 - every failure is reported, then the rank exits
        try:
            conn.send(("error", (type(e).__name__, f"rank {tp_rank}: {type(e).__name__}: {e}")))
        finally:
            sys.exit(1)
    finally:
        if group is not None:
            destroy_tp_group(group)


class TPExecutor:
    def __init__(self, config: EngineConfig,
                 on_rank_failure: Callable[[str], None] | None = None):
        check_tp_fits(config)
        self.config = config
        self.tp_size = config.parallel.tensor_parallel_size
        self.on_rank_failure = on_rank_failure
        self.procs: list[Any] = []
        self.conns: list[Connection] = []
        self.rank_weight_bytes: list[int] = []
        self.failure: str | None = None
        # Messages read while waiting for another rank's, kept for their own `_receive`.
        self._pending: dict[int, list[tuple[str, Any]]] = {}
        self._lock = threading.Lock()
        self._closing = False
        self._wake_r, self._wake_w = mp.get_context("spawn").Pipe(duplex=False)
        self._watchdog: threading.Thread | None = None

    @property
    def is_healthy(self) -> bool:
        return self.failure is None and bool(self.procs)

    def initialize(self) -> RuntimeInfo:
        ctx = mp.get_context("spawn")
        init_method = f"tcp://127.0.0.1:{free_loopback_port()}"
        for rank in range(self.tp_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_run_rank, name=f"kvasir-tp-rank-{rank}", daemon=True,
                               args=(self.config, rank, init_method, child,
                                     _cpu_ids(rank, self.tp_size)))
            proc.start()
            child.close()
            self.procs.append(proc)
            self.conns.append(parent)
        infos: list[RuntimeInfo] = []
        for rank in range(self.tp_size):
            info, weight_bytes = self._receive(rank, "ready", START_TIMEOUT_S)
            infos.append(info)
            self.rank_weight_bytes.append(weight_bytes)
        self._watchdog = threading.Thread(target=self._watch, name="kvasir-tp-watchdog",
                                          daemon=True)
        self._watchdog.start()
        # Block ids below the smallest count are valid on every rank.
        num_blocks = min(i.num_kv_blocks for i in infos)
        kv_bytes = sum(i.kv_cache_bytes // max(1, i.num_kv_blocks) for i in infos) * num_blocks
        first = infos[0]
        return RuntimeInfo(num_kv_blocks=num_blocks, block_size=first.block_size,
                           eos_token_ids=first.eos_token_ids, device=first.device,
                           kv_cache_bytes=kv_bytes, kernels=first.kernels)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if self.failure is not None:
            raise RuntimeError(self.failure)
        if not self.procs:
            raise RuntimeError("executor used before initialize()")
        for rank, conn in enumerate(self.conns):
            try:
                conn.send(("execute", scheduler_output))
            except (BrokenPipeError, ConnectionResetError, OSError):
                self._fail(self._death_message(rank))
                raise RuntimeError(self.failure) from None
        output: ModelRunnerOutput = self._receive(0, "output", None)
        return output

    def _receive(self, rank: int, expected: str, timeout: float | None) -> Any:
        """Rank `rank`'s next `expected` message; raises when any rank errs or dies first."""
        waitables = [*self.conns, *(p.sentinel for p in self.procs)]
        pending = self._pending.setdefault(rank, [])
        if pending:
            kind, payload = pending.pop(0)
            if kind == expected:
                return payload
        while True:
            ready = wait(waitables, timeout)
            if not ready:
                self._fail(f"tensor-parallel rank {rank} sent no {expected!r} within {timeout}s")
                raise RuntimeError(self.failure)
            for r, conn in enumerate(self.conns):  # messages first: an error explains a death
                if conn in ready:
                    try:
                        kind, payload = conn.recv()
                    except (EOFError, OSError):
                        continue
                    if kind == "error":
                        killed = self._killed_peer(r)
                        if killed is not None:
                            self._fail(self._death_message(killed))
                            raise RuntimeError(self.failure)
                        error_type, message = payload
                        self._fail(f"tensor-parallel {message}")
                        raise (ValueError if error_type == "ValueError" else RuntimeError)(message)
                    if r == rank and kind == expected:
                        return payload
                    self._pending.setdefault(r, []).append((kind, payload))
            for r, proc in enumerate(self.procs):
                if proc.sentinel in ready:
                    self._fail(self._death_message(r))
                    raise RuntimeError(self.failure)

    def _killed_peer(self, rank: int) -> int | None:
        """A rank other than `rank` that died without reporting (killed, crashed) within a
        short grace: when one rank is killed, its peers' collectives fail and they report
        that error, often before its own exit is seen; the death is the cause to report.
        Ranks that report an error exit with code 1 and are not counted."""
        others = {p.sentinel: i for i, p in enumerate(self.procs) if i != rank}
        for sentinel in wait(list(others), PEER_DEATH_GRACE_S) if others else []:
            proc = self.procs[others[sentinel]]
            proc.join(timeout=1.0)
            if proc.exitcode not in (None, 1):
                return others[sentinel]
        return None

    def _death_message(self, rank: int) -> str:
        proc = self.procs[rank]
        proc.join(timeout=1.0)
        return (f"tensor-parallel rank {rank} (pid {proc.pid}) died with exit code "
                f"{proc.exitcode}; the engine cannot continue")

    def _watch(self) -> None:
        """Between steps nothing reads the pipes: notice a dying rank here."""
        ready = wait([self._wake_r, *(p.sentinel for p in self.procs)])
        if self._closing or self._wake_r in ready:
            return
        for r, proc in enumerate(self.procs):
            if proc.sentinel in ready:
                self._fail(self._death_message(r))
                return

    def _fail(self, message: str) -> None:
        with self._lock:
            if self.failure is not None or self._closing:
                return
            self.failure = message
        print(f"kvasir: {message}", file=sys.stderr, flush=True)
        self._kill_all()
        if self.on_rank_failure is not None:
            self.on_rank_failure(message)

    def _kill_all(self) -> None:
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
        for proc in self.procs:
            proc.join(timeout=5.0)

    def shutdown(self) -> None:
        with self._lock:
            self._closing = True
        self._wake_w.send(None)
        for conn in self.conns:
            try:
                conn.send(("shutdown", None))
            except OSError:
                pass
        for proc in self.procs:
            proc.join(timeout=10.0)
        self._kill_all()
        if self._watchdog is not None:
            self._watchdog.join(timeout=5.0)
        for conn in self.conns:
            conn.close()
