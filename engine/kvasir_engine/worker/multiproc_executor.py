"""`MultiprocExecutor`: the core's `Executor` over tensor_parallel_size x pipeline_parallel_size
rank processes, on one node or several.

The engine process (the leader, node rank 0) first meets the other nodes
(distributed/bootstrap.py: the rendezvous store it hosts, the configuration compared), then
spawns its own node's ranks (worker/local_ranks.py); the other nodes spawn theirs
(worker/worker_node.py). The scheduler runs once, here: each step its plain `SchedulerOutput`
goes down one pipe to the driver, global rank 0, which broadcasts it to every rank
(worker/rank.py) and answers with the `ModelRunnerOutput`.

The engine process never joins a collective, so it cannot hang in one: it waits on its ranks'
pipes *and* their sentinels, and a watchdog thread watches the sentinels, the store's failure
record and the other nodes' heartbeats between steps. A rank that dies or raises, on any node,
or a node gone silent for --node-heartbeat-timeout (distributed/heartbeat.py), marks the
executor failed, the local ranks are killed, the current or next `execute_model` raises naming
the rank or node, and `on_rank_failure` (if given) is called at once so a server can turn
unhealthy and exit.

With `--kv-transfer-config` each rank moves its own KV shard (kv_transfer/tensor_parallel.py):
the connector gets the ranks' KV pipes once they run, and a step that admits a request with
received blocks sends each rank its shard down its own pipe, right after the plan.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from multiprocessing.connection import wait
from typing import Any

import torch
import torch.multiprocessing as mp

from kvasir_engine.config import EngineConfig, RuntimeInfo
from kvasir_engine.core.executor_protocol import WholeForward
from kvasir_engine.core.outputs import ModelRunnerOutput, RequestError, SchedulerOutput
from kvasir_engine.distributed.bootstrap import rendezvous
from kvasir_engine.kv_transfer.connector import BLOCKS_GONE, KVConnector
from kvasir_engine.worker.local_ranks import WATCH_INTERVAL_S, LocalRanks, RankFailure

# Seconds a rank may take to load its part and size its KV cache.
START_TIMEOUT_S = 900.0
# How long the driver may take to hand back the ranks' statistics at shutdown.
SHUTDOWN_TIMEOUT_S = 10.0


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
    local = config.parallel.ranks_per_node
    if config.device.device == "cuda" and local > torch.cuda.device_count():
        raise ValueError(f"this node's {local} ranks exceed its {torch.cuda.device_count()} "
                         f"visible CUDA devices")


class MultiprocExecutor:
    def __init__(self, config: EngineConfig,
                 on_rank_failure: Callable[[str], None] | None = None,
                 kv_connector: KVConnector | None = None):
        check_tp_fits(config)
        if config.parallel.node_rank != 0:
            raise ValueError("only node rank 0 runs the engine; the others run worker nodes")
        self.config = config
        self.on_rank_failure = on_rank_failure
        self.kv_connector = kv_connector
        self.local: LocalRanks | None = None
        self.rank_weight_bytes: list[int] = []
        # Every rank's worker/pipeline.py:PipelineStats, handed back at an orderly shutdown.
        self.pipeline_stats: list[Any] = []
        self.failure: str | None = None
        self._lock = threading.Lock()
        self._closing = False
        self._wake_r, self._wake_w = mp.get_context("spawn").Pipe(duplex=False)
        self._watchdog: threading.Thread | None = None

    @property
    def procs(self) -> list[Any]:
        return self.local.procs if self.local is not None else []

    @property
    def is_healthy(self) -> bool:
        return self.failure is None and bool(self.procs)

    def initialize(self) -> RuntimeInfo:
        self.local = LocalRanks(self.config, rendezvous(self.config))
        self.local.start()
        infos: list[RuntimeInfo] = []
        try:
            for local_rank in range(len(self.local.ranks)):
                info, weight_bytes = self.local.receive(local_rank, "ready", START_TIMEOUT_S)
                infos.append(info)
                self.rank_weight_bytes.append(weight_bytes)
        except RankFailure as e:  # a start-up that cannot work: one line, before the port opens
            self._fail(str(e), announce=False)
            raise ValueError(str(e)) from None
        if self.kv_connector is not None:
            self.kv_connector.attach_ranks(self.local.kv_conns)
        self._watchdog = threading.Thread(target=self._watch, name="kvasir-rank-watchdog",
                                          daemon=True)
        self._watchdog.start()
        return infos[0]  # the driver's: the whole group's KV facts (worker/rank.py:_agree)

    def start_model(self, scheduler_output: SchedulerOutput) -> WholeForward:
        """Whole: the ranks run the step in their own processes, so no first token is
        interjected under tensor or pipeline parallelism."""
        return WholeForward(lambda: self.execute_model(scheduler_output))

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """The ranks run the step in their own processes; rank 0 answers."""
        if self.failure is not None:
            raise RuntimeError(self.failure)
        if self.local is None:
            raise RuntimeError("executor used before initialize()")
        rank = 0
        try:
            self.local.conns[0].send(("execute", scheduler_output))
            gone: list[str] = []
            for new in scheduler_output.scheduled_new_reqs:  # received KV, each rank its shard
                if new.kv_load is None:
                    continue
                assert self.kv_connector is not None, "a KV load without a connector"
                shards = self.kv_connector.take_staged(new.kv_load)
                if shards is None:
                    gone.append(new.request_id)
                if new.kv_load.block_ids:
                    for rank, conn in enumerate(self.local.conns):
                        conn.send(("kv_blocks", None if shards is None else shards[rank]))
        except (BrokenPipeError, ConnectionResetError, OSError):
            self._fail(self.local.group_failure(self.local.death_message(rank)))
            raise RuntimeError(self.failure) from None
        try:
            output: ModelRunnerOutput = self.local.receive(0, "output", None)
        except RankFailure as e:
            self._fail(str(e))
            raise RuntimeError(self.failure) from None
        if gone:  # the ranks wrote nothing for them: what they computed is dropped
            raise RequestError(gone, BLOCKS_GONE)
        return output

    def _watch(self) -> None:
        """Between steps nothing reads the pipes: notice a dying rank here, a failure another
        node reported, or a node gone silent."""
        local = self.local
        if local is None:
            return
        while True:
            ready = wait([self._wake_r, *local.sentinels], WATCH_INTERVAL_S)
            if self._closing or self._wake_r in ready:
                return
            for r, proc in enumerate(local.procs):
                if proc.sentinel in ready:
                    self._fail(local.group_failure(local.death_message(r)))
                    return
            try:
                remote = local.remote_failure()
            except RuntimeError:  # this process hosts the store: it goes only with us
                remote = None
            if remote is not None:
                self._fail(remote)
                return

    def _fail(self, message: str, announce: bool = True) -> None:
        with self._lock:
            if self.failure is not None or self._closing:
                return
            self.failure = message
        if announce:
            print(f"kvasir: {message}", file=sys.stderr, flush=True)
        if self.local is not None:
            self.local.kill()
        if self.on_rank_failure is not None:
            self.on_rank_failure(message)

    def shutdown(self) -> None:
        with self._lock:
            self._closing = True
        self._wake_w.send(None)
        local = self.local
        if local is not None:
            if self.failure is None and local.procs:
                try:  # the ranks exit 0 once the driver has answered: no failure to watch for
                    local.conns[0].send(("shutdown", None))
                    if local.conns[0].poll(SHUTDOWN_TIMEOUT_S):
                        kind, payload = local.conns[0].recv()
                        self.pipeline_stats = payload if kind == "stats" else []
                except (OSError, EOFError):
                    pass
            for proc in local.procs:
                proc.join(timeout=10.0)
            local.kill()
        if self._watchdog is not None:
            self._watchdog.join(timeout=5.0)
        if local is not None:
            local.close()
