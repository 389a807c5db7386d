"""`UpstreamClient`: the gateway's one HTTP client to the engines, and the headers it sends them.

aiohttp (its C parser costs ~1 ms less a request than httpx's h11 here). Long generations: no
overall deadline, but a connection must open fast and a replica that sends nothing for 300 s is
given up. No pool limit: 1,000 streams are 1,000 connections. Idle connections are dropped after
`UPSTREAM_KEEPALIVE_SECONDS`, before the engine's uvicorn closes them (5 s, vLLM's too): reusing
one the server is closing just then resets it, which ejected a healthy replica.

The session belongs to the running event loop, so app.py opens it in the lifespan and closes it
there; `session` refuses before. The engine trusts the tenant header only with the gateway's own
key (`headers`).
"""

from __future__ import annotations

import aiohttp

TENANT_HEADER = "x-kvasir-tenant"
# Below uvicorn's default keep-alive (5 s), which the engines (ours and vLLM) serve with.
UPSTREAM_KEEPALIVE_SECONDS = 4.0


class UpstreamClient:
    def __init__(self, upstream_key: str | None, connect_timeout_seconds: float) -> None:
        self.upstream_key = upstream_key  # the trusted-gateway key; None: the engines want none
        self.connect_timeout_seconds = connect_timeout_seconds
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("the gateway's upstream client exists only while the app runs")
        return self._session

    def headers(self, tenant: str) -> dict[str, str]:
        """What a request on behalf of `tenant` carries upstream."""
        if not self.upstream_key:
            return {}
        return {"authorization": f"Bearer {self.upstream_key}", TENANT_HEADER: tenant}

    def open(self) -> None:
        timeout = aiohttp.ClientTimeout(total=None, connect=self.connect_timeout_seconds,
                                        sock_read=300.0)
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=UPSTREAM_KEEPALIVE_SECONDS),
            timeout=timeout, auto_decompress=False, skip_auto_headers=("User-Agent",),
            headers={"content-type": "application/json"})

    async def close(self) -> None:
        await self.session.close()
