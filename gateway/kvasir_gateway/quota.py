"""Per-tenant quotas: tokens per minute, requests per minute, concurrent requests.

Tokens and requests are token buckets that refill continuously (a limit of N per minute holds
N and refills N/60 each second), so a burst can use a whole minute's budget but never more.
Admission takes the request's *reservation* (estimated prompt tokens + max_tokens) from the
token bucket; `settle` returns the difference once the response's usage is known (the bucket
may go below zero when a response used more than was reserved: the debt delays the next
admission). Concurrency is a set of leases with an expiry, so a gateway that crashed mid-request
cannot hold a slot forever.

`MemoryQuotaStore` holds that state in this process; `redis_quota.RedisQuotaStore` holds the
same state in Redis, changed by Lua scripts so that every gateway replica shares one budget.
Both take the same decisions: the tests run one suite against both.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Protocol

from kvasir_gateway.config import QuotaLimits

REFUSED_TOO_LARGE = "too_large"  # the reservation alone exceeds the tenant's tokens-per-minute


@dataclass(frozen=True)
class Admission:
    allowed: bool
    refused_by: str | None  # None, "tokens", "requests", "concurrent", "too_large", "store"
    retry_after_seconds: float
    limits: QuotaLimits
    tokens_remaining: float  # after this admission's reservation
    requests_remaining: float
    enforced: bool = True  # False: the store was unreachable and the gateway failed open

    def headers(self) -> dict[str, str]:
        """OpenAI's x-ratelimit-* headers (and Retry-After on a refusal)."""
        out: dict[str, str] = {}
        if not self.enforced:  # the store was unreachable: nothing true to report
            return {"retry-after": "1"} if not self.allowed else out
        for name, limit, remaining in (
                ("tokens", self.limits.tokens_per_minute, self.tokens_remaining),
                ("requests", self.limits.requests_per_minute, self.requests_remaining)):
            if limit > 0:
                left = max(0.0, remaining)
                out[f"x-ratelimit-limit-{name}"] = str(limit)
                out[f"x-ratelimit-remaining-{name}"] = str(math.floor(left))
                out[f"x-ratelimit-reset-{name}"] = duration_text((limit - left) * 60.0 / limit)
        if not self.allowed and self.refused_by != REFUSED_TOO_LARGE:
            out["retry-after"] = str(max(1, math.ceil(self.retry_after_seconds)))
        return out


def duration_text(seconds: float) -> str:
    """OpenAI's reset format: "6m0s", "1.5s", "20ms"."""
    seconds = max(0.0, seconds)
    if seconds < 1:
        return f"{round(seconds * 1000)}ms"
    minutes, rest = divmod(seconds, 60)
    if minutes:
        return f"{int(minutes)}m{rest:.0f}s"
    return f"{rest:.3g}s"


class QuotaStore(Protocol):
    async def admit(self, tenant: str, limits: QuotaLimits, cost: int,
                    lease_id: str) -> Admission: ...

    async def settle(self, tenant: str, limits: QuotaLimits, delta_tokens: int,
                     lease_id: str) -> None:
        """Release the request's concurrency lease; add `delta_tokens` (used - reserved)."""

    async def renew(self, tenant_to_leases: dict[str, list[str]]) -> None:
        """Extend the leases of requests still running (streams longer than a lease)."""

    async def close(self) -> None: ...


def _level(cap: int, value: float | None, stamp: float, now: float) -> float:
    if cap <= 0:
        return 0.0
    if value is None:
        return float(cap)
    return min(float(cap), value + max(0.0, now - stamp) * cap / 60.0)


@dataclass
class _Bucket:
    tokens: float | None = None
    tokens_at: float = 0.0
    requests: float | None = None
    requests_at: float = 0.0


class MemoryQuotaStore:
    """This process's quota state (no Redis configured: one gateway replica)."""

    def __init__(self, lease_seconds: float = 600.0) -> None:
        self.lease_seconds = lease_seconds
        self._buckets: dict[str, _Bucket] = {}
        self._leases: dict[str, dict[str, float]] = {}

    async def admit(self, tenant: str, limits: QuotaLimits, cost: int,
                    lease_id: str) -> Admission:
        now = time.monotonic()
        b = self._buckets.setdefault(tenant, _Bucket())
        tpm, rpm, conc = limits.tokens_per_minute, limits.requests_per_minute, limits.max_concurrent
        tokens = _level(tpm, b.tokens, b.tokens_at, now)
        requests = _level(rpm, b.requests, b.requests_at, now)
        leases = self._leases.setdefault(tenant, {})
        for lid in [lid for lid, expiry in leases.items() if expiry <= now]:
            del leases[lid]
        refused, wait = None, 0.0
        if 0 < tpm < cost:
            refused = REFUSED_TOO_LARGE
        elif tpm > 0 and tokens < cost:
            refused, wait = "tokens", (cost - tokens) * 60.0 / tpm
        elif rpm > 0 and requests < 1:
            refused, wait = "requests", (1 - requests) * 60.0 / rpm
        elif conc > 0 and len(leases) >= conc:
            refused, wait = "concurrent", 1.0
        if refused is None:
            tokens -= cost if tpm > 0 else 0
            requests -= 1 if rpm > 0 else 0
            b.tokens, b.tokens_at, b.requests, b.requests_at = tokens, now, requests, now
            if conc > 0:
                leases[lease_id] = now + self.lease_seconds
        return Admission(refused is None, refused, wait, limits, tokens, requests)

    async def settle(self, tenant: str, limits: QuotaLimits, delta_tokens: int,
                     lease_id: str) -> None:
        self._leases.get(tenant, {}).pop(lease_id, None)
        tpm = limits.tokens_per_minute
        b = self._buckets.get(tenant)
        if b is None or tpm <= 0 or delta_tokens == 0:
            return
        now = time.monotonic()
        b.tokens = min(float(tpm), _level(tpm, b.tokens, b.tokens_at, now) - delta_tokens)
        b.tokens_at = now

    async def renew(self, tenant_to_leases: dict[str, list[str]]) -> None:
        expiry = time.monotonic() + self.lease_seconds
        for tenant, lease_ids in tenant_to_leases.items():
            held = self._leases.get(tenant, {})
            for lid in lease_ids:
                if lid in held:
                    held[lid] = expiry

    async def close(self) -> None:
        return None
