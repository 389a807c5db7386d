"""The quota state in Redis, so that every gateway replica spends one budget per tenant.

Each tenant has a hash `kvasir:quota:{tenant}` (token and request bucket levels and the time
they were computed) and a sorted set `kvasir:quota:{tenant}:leases` (concurrency leases scored by
their expiry). The two Lua scripts below read and write them atomically, with Redis's own clock
(`TIME`), so replicas with skewed clocks still agree; `{tenant}` is a hash tag, so both keys of a
tenant land on one Redis Cluster slot. The decisions are the same as `MemoryQuotaStore`'s.

Redis unreachable or slow (every call has a short socket timeout and an overall deadline): the
store answers at once as configured, admitting with `enforced=False` (fail-open) or refusing
with `refused_by="store"` (fail-closed, a 503), counts it in
`kvasir_gateway_quota_store_errors_total` and logs one line per `LOG_EVERY_SECONDS`.
"""

from __future__ import annotations

import asyncio
import logging
import time

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from kvasir_gateway.config import QuotaLimits
from kvasir_gateway.metrics import GatewayMetrics
from kvasir_gateway.quota import Admission

log = logging.getLogger("kvasir_gateway.quota")
LOG_EVERY_SECONDS = 10.0
BUCKET_TTL_MS = 300_000  # an idle bucket refills within a minute; keep it a while longer

_LEVEL = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local function level(cap, v, ts)
  if cap <= 0 then return 0 end
  if not v then return cap end
  return math.min(cap, tonumber(v) + math.max(0, now - tonumber(ts)) * cap / 60000)
end
"""

# KEYS: bucket, leases. ARGV: tpm, rpm, max_concurrent, cost, lease_id, lease_ms, bucket_ttl_ms.
ADMIT = _LEVEL + """
local tpm, rpm, conc = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local cost = tonumber(ARGV[4])
local s = redis.call('HMGET', KEYS[1], 'tok', 'tok_ts', 'req', 'req_ts')
local tok, req = level(tpm, s[1], s[2]), level(rpm, s[3], s[4])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
local running = redis.call('ZCARD', KEYS[2])
local refused, wait = '', 0
if tpm > 0 and cost > tpm then refused = 'too_large'
elseif tpm > 0 and tok < cost then refused, wait = 'tokens', (cost - tok) * 60 / tpm
elseif rpm > 0 and req < 1 then refused, wait = 'requests', (1 - req) * 60 / rpm
elseif conc > 0 and running >= conc then refused, wait = 'concurrent', 1
end
if refused == '' then
  if tpm > 0 then tok = tok - cost end
  if rpm > 0 then req = req - 1 end
  redis.call('HSET', KEYS[1], 'tok', tostring(tok), 'tok_ts', now, 'req', tostring(req),
             'req_ts', now)
  redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[7]))
  if conc > 0 then
    redis.call('ZADD', KEYS[2], now + tonumber(ARGV[6]), ARGV[5])
    redis.call('PEXPIRE', KEYS[2], tonumber(ARGV[6]))
  end
end
return {refused, tostring(wait), tostring(tok), tostring(req)}
"""

# KEYS: bucket, leases. ARGV: tpm, delta_tokens, lease_id, bucket_ttl_ms.
SETTLE = _LEVEL + """
redis.call('ZREM', KEYS[2], ARGV[3])
local tpm, delta = tonumber(ARGV[1]), tonumber(ARGV[2])
if tpm > 0 and delta ~= 0 then
  local s = redis.call('HMGET', KEYS[1], 'tok', 'tok_ts')
  local tok = math.min(tpm, level(tpm, s[1], s[2]) - delta)
  redis.call('HSET', KEYS[1], 'tok', tostring(tok), 'tok_ts', now)
  redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[4]))
end
return 1
"""

# KEYS: leases. ARGV: lease_ms, lease ids... (only leases still held are extended: XX)
RENEW = _LEVEL + """
for i = 2, #ARGV do
  redis.call('ZADD', KEYS[1], 'XX', now + tonumber(ARGV[1]), ARGV[i])
end
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[1]))
return 1
"""


def _keys(tenant: str) -> list[str]:
    base = f"kvasir:quota:{{{tenant}}}"
    return [base, f"{base}:leases"]


class RedisQuotaStore:
    def __init__(self, url: str, metrics: GatewayMetrics, *, timeout_seconds: float = 0.25,
                 fail_open: bool = True, lease_seconds: float = 600.0) -> None:
        self.client = aioredis.Redis.from_url(
            url, socket_timeout=timeout_seconds, socket_connect_timeout=timeout_seconds,
            retry_on_timeout=False, health_check_interval=0)
        self.metrics = metrics
        self.deadline = timeout_seconds * 2  # a script round trip plus one reconnect at most
        self.fail_open = fail_open
        self.lease_ms = int(lease_seconds * 1000)
        self._admit = self.client.register_script(ADMIT)
        self._settle = self.client.register_script(SETTLE)
        self._renew = self.client.register_script(RENEW)
        self._logged_at = -LOG_EVERY_SECONDS

    def _failed(self, action: str, exc: BaseException) -> None:
        self.metrics.quota_store_errors.labels(action).inc()
        now = time.monotonic()
        if now - self._logged_at >= LOG_EVERY_SECONDS:
            self._logged_at = now
            log.warning("Redis quota store unreachable (%s: %s); %s", type(exc).__name__, exc,
                        {"fail_open": "admitting requests unchecked (fail-open)",
                         "fail_closed": "refusing requests with 503 (fail-closed)",
                         "settle": "a settlement was lost"}[action])

    async def admit(self, tenant: str, limits: QuotaLimits, cost: int,
                    lease_id: str) -> Admission:
        args: list[str | int] = [limits.tokens_per_minute, limits.requests_per_minute, limits.max_concurrent,
                cost, lease_id, self.lease_ms, BUCKET_TTL_MS]
        try:
            async with asyncio.timeout(self.deadline):
                refused, wait, tok, req = await self._admit(keys=_keys(tenant), args=args)
        except (RedisError, OSError, TimeoutError) as exc:
            self._failed("fail_open" if self.fail_open else "fail_closed", exc)
            return Admission(self.fail_open, None if self.fail_open else "store", 1.0, limits,
                             float(limits.tokens_per_minute), float(limits.requests_per_minute),
                             enforced=False)
        refused_by = refused.decode() or None
        return Admission(refused_by is None, refused_by, float(wait), limits, float(tok),
                         float(req))

    async def settle(self, tenant: str, limits: QuotaLimits, delta_tokens: int,
                     lease_id: str) -> None:
        try:
            async with asyncio.timeout(self.deadline):
                await self._settle(keys=_keys(tenant), args=[
                    limits.tokens_per_minute, delta_tokens, lease_id, BUCKET_TTL_MS])
        except (RedisError, OSError, TimeoutError) as exc:
            self._failed("settle", exc)

    async def renew(self, tenant_to_leases: dict[str, list[str]]) -> None:
        try:
            async with asyncio.timeout(self.deadline * max(1, len(tenant_to_leases))):
                for tenant, leases in tenant_to_leases.items():
                    await self._renew(keys=_keys(tenant)[1:], args=[self.lease_ms, *leases])
        except (RedisError, OSError, TimeoutError) as exc:
            self._failed("settle", exc)

    async def close(self) -> None:
        await self.client.aclose()
