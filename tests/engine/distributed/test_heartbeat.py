"""The heartbeat between nodes (distributed/heartbeat.py), in one process on a loopback store:
beating nodes are never silent, a node that stops beating is named after the timeout, the
group's failure is read back, and a worker node counts the leader silent when the store stops
answering without closing its socket (a store whose calls never return)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta

import pytest
from kvasir_engine.config import ParallelConfig
from kvasir_engine.distributed.bootstrap import Rendezvous, TCPStore, report_failure
from kvasir_engine.distributed.heartbeat import HEARTBEAT_INTERVAL_S, LEADER_NODE, Heartbeat

TIMEOUT_S = 0.75
# Bounded waits for what the heartbeat should notice (generous: a loaded CI host).
NOTICE_BOUND_S = 20.0


def _parallel(node_rank: int, nnodes: int = 3) -> ParallelConfig:
    return ParallelConfig(pipeline_parallel_size=nnodes, nnodes=nnodes, node_rank=node_rank,
                          node_heartbeat_timeout_s=TIMEOUT_S)


@pytest.fixture
def meeting() -> Iterator[Rendezvous]:
    store = TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=10), wait_for_workers=False)
    yield Rendezvous("127.0.0.1", int(store.port), store, 10.0)


def _wait_for(predicate: Callable[[], bool]) -> float:
    """Seconds until `predicate()` held (fails after NOTICE_BOUND_S)."""
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < NOTICE_BOUND_S, "never noticed"
        time.sleep(0.02)
    return time.monotonic() - start


def test_beating_nodes_are_never_silent_and_a_stopped_one_is_named(
        meeting: Rendezvous) -> None:
    beats = [Heartbeat(meeting, _parallel(n)) for n in range(3)]
    assert beats[0].watched == [1, 2] and beats[1].watched == beats[2].watched == [LEADER_NODE]
    for beat in beats:
        beat.start()
    try:
        time.sleep(3 * TIMEOUT_S)
        assert [b.silent_node() for b in beats] == [None, None, None]
        beats[2].stop()
        _wait_for(lambda: beats[0].silent_node() == 2)
        assert beats[1].silent_node() is None  # a worker node watches the leader only
    finally:
        for beat in beats:
            beat.stop()


def test_the_groups_first_failure_is_read_back(meeting: Rendezvous) -> None:
    leader, worker = Heartbeat(meeting, _parallel(0, 2)), Heartbeat(meeting, _parallel(1, 2))
    leader.start()
    worker.start()
    try:
        time.sleep(2 * HEARTBEAT_INTERVAL_S)
        assert leader.failure is None and worker.failure is None
        report_failure(meeting.store, "rank 1 died")
        _wait_for(lambda: leader.failure == worker.failure == "rank 1 died")
    finally:
        leader.stop()
        worker.stop()


def test_a_node_that_never_beats_is_silent_after_the_timeout(meeting: Rendezvous) -> None:
    leader = Heartbeat(meeting, _parallel(0, 2))
    leader.start()
    try:
        waited = _wait_for(lambda: leader.silent_node() == 1)
        assert waited >= TIMEOUT_S - HEARTBEAT_INTERVAL_S  # not before it could have beaten
    finally:
        leader.stop()


class _FrozenStore:
    """A store whose server stopped answering without closing the socket: calls never return."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def add(self, key: str, value: int) -> int:
        self.release.wait()
        raise RuntimeError("Connection reset by peer")


def test_a_worker_counts_the_leader_silent_when_the_store_stops_answering(
        meeting: Rendezvous, monkeypatch: pytest.MonkeyPatch) -> None:
    frozen = _FrozenStore()
    monkeypatch.setattr(Rendezvous, "connect", lambda self: frozen)
    worker = Heartbeat(meeting, _parallel(1, 2))
    worker.start()
    try:
        _wait_for(lambda: worker.silent_node() == LEADER_NODE)
        assert worker.store_error is None
        frozen.release.set()  # the socket closes at last: a broken connection, recorded
        _wait_for(lambda: worker.store_error == "RuntimeError: Connection reset by peer")
    finally:
        frozen.release.set()
        worker.stop()
