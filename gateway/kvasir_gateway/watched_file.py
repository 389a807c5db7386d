"""`WatchedFile`: a file re-read when its mtime or size changes, its problems logged once.

The key file and the routing file are both mounted from Kubernetes (a Secret, a ConfigMap) and
updated in place by the kubelet swapping a symlink, so `os.stat` (which follows it) sees the new
version. A version that fails to parse is reported once per distinct problem and the caller
keeps what it had: a bad edit never takes the gateway down. An empty version after the first
is refused the same way: a file rewritten in place (an editor, `>`) is empty for a moment, and
loading that moment would drop every key or alias until the next poll.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger("kvasir_gateway.watched_file")


class WatchedFile:
    def __init__(self, path: str) -> None:
        self.path = path
        self._stamp: tuple[int, int] | None = None
        self._reported = ""

    def read_if_changed(self) -> str | None:
        """The new text, or None when unchanged since the last call; OSError,
        UnicodeDecodeError and ValueError (an empty version after the first) pass up (the
        stamp is taken first: a bad version is read once)."""
        st = os.stat(self.path)
        stamp = (st.st_mtime_ns, st.st_size)
        if stamp == self._stamp:
            return None
        is_first = self._stamp is None
        self._stamp = stamp
        with open(self.path, encoding="utf-8") as f:
            text = f.read()
        if not text.strip() and not is_first:
            raise ValueError("the file is empty (being rewritten?)")
        return text

    def report(self, problem: Exception, kept: str) -> None:
        """A version not loaded: one error line per distinct problem, saying what stays."""
        if str(problem) != self._reported:
            self._reported = str(problem)
            log.error("%s not reloaded, keeping %s: %s", self.path, kept, problem)

    def loaded(self) -> None:
        self._reported = ""
