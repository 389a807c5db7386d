"""Per-tenant quotas: tokens per minute, requests per minute, concurrent requests.

Tokens and requests are counted in a sliding window of the last 60 seconds, kept as one counter
per second: a request is admitted only while the window's total plus its cost stays within the
limit, so no 60-second span ever admits more than the quota (a token bucket would let a fresh
tenant spend its full bucket and a minute's refill, twice the quota, in its first minute). The
cost taken at admission is the request's *reservation* (estimated prompt tokens + max_tokens);
`settle` corrects the second it was counted in once the response's usage is known: the unused
part comes back, or a response that used more than reserved counts the excess (delaying the
next admission). Concurrency is a set of leases with an expiry, so a gateway that crashed
mid-request cannot hold a slot forever; a running gateway renews the leases of its open
requests every third of the lease time, so a long stream keeps its slot.

`MemoryQuotaStore` holds that state in this process; `redis_quota.RedisQuotaStore` holds the
same state in Redis, changed by Lua scripts so that every gateway replica shares one budget.
Both take the same decisions: the tests run one suite against both. A tenant with no limit at all
never reaches a store: the proxy admits it as `UNLIMITED` and settles nothing, so it costs no
Redis round trip and a Redis that is down neither delays nor refuses it.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Protocol

from kvasir_gateway.config import QuotaLimits
from kvasir_gateway.errors import GatewayError

REFUSED_TOO_LARGE = "too_large"  # the reservation alone exceeds the tenant's tokens-per-minute
WINDOW_SECONDS = 60
# Counters are per whole second, so a second's counter may hold a token admitted up to 1 s after
# it began: keeping each for 61 s means no 60-second span, however it straddles the seconds,
# admits more than the quota.
KEEP_SECONDS = WINDOW_SECONDS + 1


@dataclass(frozen=True)
class Admission:
    allowed: bool
    refused_by: str | None  # None, "tokens", "requests", "concurrent", "too_large", "store"
    retry_after_seconds: float
    limits: QuotaLimits
    tokens_remaining: float  # in the window, after this admission's reservation
    requests_remaining: float
    tokens_reset_seconds: float = 0.0  # until everything counted in the window has left it
    requests_reset_seconds: float = 0.0
    window_second: int = 0  # the second the reservation was counted in (for `settle`)
    enforced: bool = True  # False: the store was unreachable and the gateway failed open

    def headers(self) -> dict[str, str]:
        """OpenAI's x-ratelimit-* headers (and Retry-After on a refusal)."""
        out: dict[str, str] = {}
        if not self.enforced:  # the store was unreachable: nothing true to report
            return {"retry-after": "1"} if not self.allowed else out
        for name, limit, remaining, reset in (
                ("tokens", self.limits.tokens_per_minute, self.tokens_remaining,
                 self.tokens_reset_seconds),
                ("requests", self.limits.requests_per_minute, self.requests_remaining,
                 self.requests_reset_seconds)):
            if limit > 0:
                out[f"x-ratelimit-limit-{name}"] = str(limit)
                out[f"x-ratelimit-remaining-{name}"] = str(math.floor(max(0.0, remaining)))
                out[f"x-ratelimit-reset-{name}"] = duration_text(reset)
        if not self.allowed and self.refused_by != REFUSED_TOO_LARGE:
            out["retry-after"] = str(max(1, math.ceil(self.retry_after_seconds)))
        return out


# A tenant without any limit: admitted without asking the store (proxy.py), nothing to report.
UNLIMITED = Admission(True, None, 0.0, QuotaLimits(), 0.0, 0.0)


def refusal_error(admission: Admission, cost: int) -> GatewayError:
    """What the client is told when `admission` refused a request reserving `cost` tokens."""
    refused_by = admission.refused_by
    if refused_by == "store":
        return GatewayError(503, "the quota store is unreachable and the gateway fails closed "
                                 "(--redis-failure closed); retry shortly",
                            code="quota_store_unavailable", headers={"retry-after": "1"})
    messages = {
        "too_large": (f"request needs {cost} tokens (prompt estimate + max_tokens), more than "
                      f"the tenant's limit of {admission.limits.tokens_per_minute} tokens per "
                      f"minute; lower max_tokens"),
        "tokens": f"rate limit reached for tokens per minute (this request reserves {cost})",
        "requests": "rate limit reached for requests per minute",
        "concurrent": "too many concurrent requests for this tenant",
    }
    return GatewayError(429, messages.get(refused_by or "", "rate limited"),
                        code=f"rate_limit_{refused_by}", headers=admission.headers())


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
                     lease_id: str, window_second: int) -> None:
        """Release the request's concurrency lease; add `delta_tokens` (used - reserved) to the
        second it was admitted in (nothing, once that second has left the window)."""

    async def renew(self, tenant_to_leases: dict[str, list[str]]) -> None:
        """Extend the leases of requests still running (streams longer than a lease)."""

    async def close(self) -> None: ...


class OpenLeases:
    """The concurrency leases of the requests this gateway runs now: the proxy opens and closes
    them, app.py renews them every third of the lease time, so a long stream keeps its slot."""

    def __init__(self) -> None:
        self._lease_to_tenant: dict[str, str] = {}

    def open(self, lease_id: str, tenant: str) -> None:
        self._lease_to_tenant[lease_id] = tenant

    def close(self, lease_id: str) -> None:
        self._lease_to_tenant.pop(lease_id, None)

    def tenant_to_leases(self) -> dict[str, list[str]]:
        tenant_to_leases: dict[str, list[str]] = {}
        for lease_id, tenant in self._lease_to_tenant.items():
            tenant_to_leases.setdefault(tenant, []).append(lease_id)
        return tenant_to_leases


@dataclass(frozen=True)
class WindowState:
    used: int  # counted in the window now (before this request)
    wait_seconds: float  # until `cost` more would fit (0 when it fits now)
    reset_seconds: float  # until all that is counted has left the window


def window_state(per_second: dict[int, int], cap: int, cost: int, now: float) -> WindowState:
    """Drop the seconds that left the window from `per_second`, and say where it stands."""
    now_second = int(now)
    for second in [s for s in per_second if s <= now_second - KEEP_SECONDS]:
        del per_second[second]
    used = sum(per_second.values())
    wait = 0.0
    if used + cost > cap:
        freed, need = 0, used + cost - cap
        for second in sorted(per_second):
            freed += per_second[second]
            if freed >= need:
                wait = second + KEEP_SECONDS - now
                break
    reset = max(per_second) + KEEP_SECONDS - now if per_second else 0.0
    return WindowState(used, wait, reset)


class MemoryQuotaStore:
    """This process's quota state (no Redis configured: one gateway replica)."""

    def __init__(self, lease_seconds: float = 600.0) -> None:
        self.lease_seconds = lease_seconds
        self._tokens: dict[str, dict[int, int]] = {}
        self._requests: dict[str, dict[int, int]] = {}
        self._leases: dict[str, dict[str, float]] = {}

    async def admit(self, tenant: str, limits: QuotaLimits, cost: int,
                    lease_id: str) -> Admission:
        now = time.time()
        tpm, rpm, conc = limits.tokens_per_minute, limits.requests_per_minute, limits.max_concurrent
        tokens = self._tokens.setdefault(tenant, {})
        requests = self._requests.setdefault(tenant, {})
        tok = window_state(tokens, tpm, cost, now)
        req = window_state(requests, rpm, 1, now)
        leases = self._leases.setdefault(tenant, {})
        for lid in [lid for lid, expiry in leases.items() if expiry <= now]:
            del leases[lid]
        refused, wait = None, 0.0
        if 0 < tpm < cost:
            refused = REFUSED_TOO_LARGE
        elif tpm > 0 and tok.wait_seconds > 0:
            refused, wait = "tokens", tok.wait_seconds
        elif rpm > 0 and req.wait_seconds > 0:
            refused, wait = "requests", req.wait_seconds
        elif conc > 0 and len(leases) >= conc:
            refused, wait = "concurrent", 1.0
        second = int(now)
        tok_used, req_used = tok.used, req.used
        tok_reset, req_reset = tok.reset_seconds, req.reset_seconds
        if refused is None:
            if tpm > 0:
                tokens[second] = tokens.get(second, 0) + cost
                tok_used, tok_reset = tok_used + cost, second + KEEP_SECONDS - now
            if rpm > 0:
                requests[second] = requests.get(second, 0) + 1
                req_used, req_reset = req_used + 1, second + KEEP_SECONDS - now
            if conc > 0:
                leases[lease_id] = now + self.lease_seconds
        return Admission(refused is None, refused, wait, limits, float(tpm - tok_used),
                         float(rpm - req_used), tok_reset, req_reset, second)

    async def settle(self, tenant: str, limits: QuotaLimits, delta_tokens: int,
                     lease_id: str, window_second: int) -> None:
        self._leases.get(tenant, {}).pop(lease_id, None)
        tokens = self._tokens.get(tenant)
        if tokens is None or window_second not in tokens or delta_tokens == 0:
            return
        tokens[window_second] = max(0, tokens[window_second] + delta_tokens)

    async def renew(self, tenant_to_leases: dict[str, list[str]]) -> None:
        expiry = time.time() + self.lease_seconds
        for tenant, lease_ids in tenant_to_leases.items():
            held = self._leases.get(tenant, {})
            for lid in lease_ids:
                if lid in held:
                    held[lid] = expiry

    async def close(self) -> None:
        return None
