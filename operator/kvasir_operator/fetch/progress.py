"""Progress of one fetch: counters shared by the workers, a steady reporter, a summary line.

The reporter thread wakes every `interval` seconds, prints one line on stderr (bytes done/total,
rate over the last interval, ETA) and patches the pod annotation. The same snapshot dict is the
annotation payload of the contract, so the log and `status.download` always agree.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any

from .annotate import PodAnnotator


def human_bytes(num: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(num) < 1024 or unit == "TiB":
            return f"{num:.1f} {unit}" if unit != "B" else f"{int(num)} B"
        num /= 1024
    return f"{num:.1f} TiB"


class Progress:
    def __init__(self, annotator: PodAnnotator | None, interval: float) -> None:
        self._lock = threading.Lock()
        self._annotator = annotator
        self._interval = interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.phase = "Listing"
        self.message = ""
        self.manifest_digest = ""
        self.bytes_total = 0
        self.bytes_done = 0  # includes bytes reused from a previous run
        self.bytes_fetched = 0  # bytes transferred by this run
        self.files_total = 0
        self.files_done = 0
        self.files_reused = 0
        self.started = time.monotonic()
        self._window: tuple[float, int] = (self.started, 0)
        self._rate = 0.0

    def add_bytes(self, num: int) -> None:
        with self._lock:
            self.bytes_done += num
            self.bytes_fetched += num

    def add_files(self, num: int) -> None:
        with self._lock:
            self.files_done += num

    def update(self, **fields: Any) -> None:
        with self._lock:
            for key, value in fields.items():
                setattr(self, key, value)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            now = time.monotonic()
            then, fetched_then = self._window
            if now - then >= 0.5:
                self._rate = (self.bytes_fetched - fetched_then) / (now - then)
                self._window = (now, self.bytes_fetched)
            remaining = max(0, self.bytes_total - self.bytes_done)
            eta = remaining / self._rate if self._rate > 0 else None
            return {
                "phase": self.phase,
                "bytesDone": self.bytes_done,
                "bytesTotal": self.bytes_total,
                "bytesPerSecond": round(self._rate, 1),
                "etaSeconds": round(eta, 1)
                if eta is not None
                else (0.0 if not remaining else None),
                "filesDone": self.files_done,
                "filesTotal": self.files_total,
                "message": self.message,
                "manifestDigest": self.manifest_digest,
            }

    def report(self) -> None:
        snap = self.snapshot()
        pct = 100.0 * snap["bytesDone"] / snap["bytesTotal"] if snap["bytesTotal"] else 0.0
        eta = "?" if snap["etaSeconds"] is None else f"{snap['etaSeconds']:.0f}s"
        print(
            f"kvasir-fetch: {snap['phase']} {human_bytes(snap['bytesDone'])} / "
            f"{human_bytes(snap['bytesTotal'])} ({pct:.1f}%) "
            f"{snap['bytesPerSecond'] / 1e6:.1f} MB/s ETA {eta} "
            f"files {snap['filesDone']}/{snap['filesTotal']}",
            file=sys.stderr,
            flush=True,
        )
        if self._annotator is not None:
            self._annotator.patch(snap)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self.report()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kvasir-progress", daemon=True)
        self._thread.start()

    def finish(self, phase: str, message: str) -> None:
        """Stop the reporter and publish the final state (Done or Failed) once more."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.update(phase=phase, message=message)
        if self._annotator is not None:
            self._annotator.patch(self.snapshot())

    def summary_line(self) -> str:
        with self._lock:
            seconds = max(time.monotonic() - self.started, 1e-9)
            return (
                f"kvasir-fetch: done: {human_bytes(self.bytes_total)} in {seconds:.1f} s, "
                f"fetched {human_bytes(self.bytes_fetched)} "
                f"({self.bytes_fetched / seconds / 1e6:.1f} MB/s), "
                f"files fetched {self.files_total - self.files_reused}, reused {self.files_reused}"
            )
