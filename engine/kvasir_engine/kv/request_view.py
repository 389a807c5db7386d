"""`RequestView`: what the KV layer reads of a request.

`kv` sits below `core` (the import-linter layers contract), so it cannot import
`core.request.Request`; `Request` satisfies this protocol structurally. Read-only on purpose:
the KV layer never changes a request.
"""

from __future__ import annotations

from typing import Protocol


class RequestView(Protocol):
    @property
    def request_id(self) -> str: ...

    @property
    def prompt_token_ids(self) -> list[int]: ...

    @property
    def output_token_ids(self) -> list[int]: ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_computed_tokens(self) -> int: ...

    @property
    def cache_salt(self) -> str | None: ...

    @property
    def skip_reading_prefix_cache(self) -> bool: ...
