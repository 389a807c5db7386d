"""Parallel ranged reads from a `Source` into `.part` files, with retries and a stall guard.

One pool of `concurrency` workers serves the parts of all files, first file first, so files
complete (and can be verified) early while the link stays busy. A part that fails in the middle
of its body is re-requested from the first byte it lacks. Two guards keep a dead connection from
hanging the pod in `Init` forever: botocore's socket read timeout (`stall_timeout`) fails a read
that gets no bytes, and a watchdog fails the whole transfer when no byte at all arrived for
longer than the retries could legitimately take.
"""

from __future__ import annotations

import dataclasses
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait

from .errors import FetchError, Stalled
from .objects import ObjectInfo, Source
from .options import FetchOptions
from .partfile import PartFile, split_missing
from .progress import Progress
from .retry import backoff_seconds, is_retryable, translate

CHUNK = 1024 * 1024  # bytes per read(); bounds memory at concurrency x 1 MiB


class _Aborted(Exception):
    """A part given up because another part already failed the transfer (not the cause)."""


@dataclasses.dataclass(frozen=True)
class Job:
    part: PartFile
    info: ObjectInfo
    start: int  # first byte of the range
    end: int  # one past the last byte


class Transfer:
    def __init__(self, source: Source, options: FetchOptions, progress: Progress) -> None:
        self._source = source
        self._options = options
        self._progress = progress
        self._abort = threading.Event()
        self._rng = random.Random()
        self._last_byte_at = time.monotonic()
        self._stamp_lock = threading.Lock()
        self._abort_hard = False  # the watchdog fired: do not wait for stuck workers

    @property
    def watchdog_seconds(self) -> float:
        """Longest a healthy transfer may go without a byte: every attempt timing out, plus backoff."""
        return (self._options.retries + 1) * (2 * self._options.stall_timeout + 25.0) + 5.0

    def _touch(self) -> None:
        with self._stamp_lock:
            self._last_byte_at = time.monotonic()

    def _read_range(self, job: Job, cursor: list[int]) -> None:
        """Read [cursor[0], job.end); cursor[0] advances with every write, so a retry after a
        failure mid-body asks only for the bytes that are still missing."""
        pos = cursor[0]
        stream = self._source.open_range(job.info, pos, job.end)
        try:
            while pos < job.end:
                if self._abort.is_set():
                    raise _Aborted()
                data = stream.read(min(CHUNK, job.end - pos))
                if not data:
                    raise ConnectionError(f"{job.info.path}: body ended at byte {pos} of {job.end}")
                job.part.write(pos, data)
                pos += len(data)
                cursor[0] = pos
                self._progress.add_bytes(len(data))
                self._touch()
        finally:
            stream.close()

    def _run_job(self, job: Job) -> None:
        cursor, attempt = [job.start], 0
        while True:
            if self._abort.is_set():
                raise _Aborted()
            try:
                self._read_range(job, cursor)
                job.part.mark_done(job.start, job.end)
                return
            except _Aborted:
                raise
            except FetchError:
                self._abort.set()  # fail fast: no worker starts another part
                raise
            except Exception as exc:
                attempt += 1
                if attempt > self._options.retries or not is_retryable(exc):
                    what = f"GET {self._source.uri}/{job.info.path} bytes {cursor[0]}-{job.end - 1}"
                    self._abort.set()
                    raise translate(exc, what) from exc
                time.sleep(backoff_seconds(attempt, self._rng))

    def run(
        self, parts: list[tuple[PartFile, ObjectInfo]], on_complete: Callable[[PartFile], None]
    ) -> None:
        """Fetch every missing range; call on_complete(part) as each file gets all its bytes."""
        jobs: list[Job] = []
        remaining: dict[int, int] = {}
        for part, info in parts:
            ranges = split_missing(part.done, part.size, self._options.part_size)
            remaining[id(part)] = len(ranges)
            jobs.extend(Job(part, info, start, end) for start, end in ranges)
            if not ranges:
                on_complete(part)
        lock = threading.Lock()

        def job_done(job: Job) -> Callable[[Future[None]], None]:
            def callback(future: Future[None]) -> None:
                if future.cancelled() or future.exception() is not None:
                    return
                with lock:
                    remaining[id(job.part)] -= 1
                    is_last = remaining[id(job.part)] == 0
                if is_last:
                    on_complete(job.part)

            return callback

        pool = ThreadPoolExecutor(self._options.concurrency, thread_name_prefix="kvasir-get")
        try:
            futures = []
            for job in jobs:
                future = pool.submit(self._run_job, job)
                future.add_done_callback(job_done(job))
                futures.append(future)
            self._wait(futures)
        finally:
            self._abort.set()
            pool.shutdown(wait=not self._abort_hard, cancel_futures=True)

    def _wait(self, futures: list[Future[None]]) -> None:
        pending = set(futures)
        self._touch()
        while pending:
            done, pending = wait(pending, timeout=0.5, return_when=FIRST_EXCEPTION)
            for future in done:
                error = future.exception()
                if error is not None and not isinstance(error, _Aborted):
                    raise error
            with self._stamp_lock:
                idle = time.monotonic() - self._last_byte_at
            if pending and idle > self.watchdog_seconds:
                # Workers are stuck in a read that no timeout interrupts; leave them behind.
                self._abort_hard = True
                raise Stalled(f"no data from {self._source.uri} for {idle:.0f} s (watchdog)")
