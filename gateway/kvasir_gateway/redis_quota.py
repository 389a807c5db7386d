"""The quota state in Redis, so that every gateway replica spends one budget per tenant.

Each tenant has two hashes, `kvasir:quota:{tenant}:tokens` and `...:requests` (one field per
second of the sliding window: what was admitted in it), and a sorted set `...:leases`
(concurrency leases scored by their expiry). The two Lua scripts below read and write them atomically, with Redis's own clock
(`TIME`), so replicas with skewed clocks still agree; `{tenant}` is a hash tag, so both keys of a
tenant land on one Redis Cluster slot. The decisions are the same as `MemoryQuotaStore`'s.

Redis unreachable or slow (every call has a short socket timeout and an overall deadline): the
store answers at once as configured, admitting with `enforced=False` (fail-open) or refusing
with `refused_by="store"` (fail-closed, a 503), counts it in
`kvasir_gateway_quota_store_errors_total` and logs one line per `LOG_EVERY_SECONDS`. The state is
Redis's memory: a Redis restarted without persistence starts every window afresh
(docs/gateway.md, "Quotas", says which setting avoids it).
"""

from __future__ import annotations

import asyncio
import logging
import time

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from kvasir_gateway.config import QuotaLimits
from kvasir_gateway.metrics import GatewayMetrics
from kvasir_gateway.quota import KEEP_SECONDS, Admission

log = logging.getLogger("kvasir_gateway.quota")
LOG_EVERY_SECONDS = 10.0

_CLOCK = f"""
local keep = {KEEP_SECONDS}
local t = redis.call('TIME')
local now_s = tonumber(t[1])
local now = now_s + tonumber(t[2]) / 1000000
"""

# window(key, cap, cost) -> used, wait_seconds, reset_seconds: quota.window_state in Lua.
_WINDOW = _CLOCK + """
local function window(key, cap, cost)
  if cap <= 0 then return 0, 0, 0 end
  local flat = redis.call('HGETALL', key)
  local seconds, counts, old, used = {}, {}, {}, 0
  for i = 1, #flat, 2 do
    local second, n = tonumber(flat[i]), tonumber(flat[i + 1])
    if second <= now_s - keep then
      table.insert(old, flat[i])
    else
      table.insert(seconds, second)
      counts[second] = n
      used = used + n
    end
  end
  if #old > 0 then redis.call('HDEL', key, unpack(old)) end
  table.sort(seconds)
  local wait, reset = 0, 0
  if used + cost > cap then
    local freed, need = 0, used + cost - cap
    for _, second in ipairs(seconds) do
      freed = freed + counts[second]
      if freed >= need then wait = second + keep - now; break end
    end
  end
  if #seconds > 0 then reset = seconds[#seconds] + keep - now end
  return used, wait, reset
end
"""

# KEYS: tokens, requests, leases. ARGV: tpm, rpm, max_concurrent, cost, lease_id, lease_ms.
ADMIT = _WINDOW + """
local tpm, rpm, conc = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local cost = tonumber(ARGV[4])
local tok_used, tok_wait, tok_reset = window(KEYS[1], tpm, cost)
local req_used, req_wait, req_reset = window(KEYS[2], rpm, 1)
local lease_ms = tonumber(ARGV[6])
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now * 1000)
local running = redis.call('ZCARD', KEYS[3])
local refused, wait = '', 0
if tpm > 0 and cost > tpm then refused = 'too_large'
elseif tpm > 0 and tok_wait > 0 then refused, wait = 'tokens', tok_wait
elseif rpm > 0 and req_wait > 0 then refused, wait = 'requests', req_wait
elseif conc > 0 and running >= conc then refused, wait = 'concurrent', 1
end
if refused == '' then
  if tpm > 0 then
    redis.call('HINCRBY', KEYS[1], now_s, cost)
    redis.call('EXPIRE', KEYS[1], 120)
    tok_used, tok_reset = tok_used + cost, now_s + keep - now
  end
  if rpm > 0 then
    redis.call('HINCRBY', KEYS[2], now_s, 1)
    redis.call('EXPIRE', KEYS[2], 120)
    req_used, req_reset = req_used + 1, now_s + keep - now
  end
  if conc > 0 then
    redis.call('ZADD', KEYS[3], now * 1000 + lease_ms, ARGV[5])
    redis.call('PEXPIRE', KEYS[3], lease_ms)
  end
end
return {refused, tostring(wait), tpm - tok_used, rpm - req_used, tostring(tok_reset),
        tostring(req_reset), now_s}
"""

# KEYS: tokens, leases. ARGV: delta_tokens, lease_id, window_second.
SETTLE = _CLOCK + """
redis.call('ZREM', KEYS[2], ARGV[2])
local delta, second = tonumber(ARGV[1]), tonumber(ARGV[3])
if delta ~= 0 and second > now_s - keep and redis.call('HEXISTS', KEYS[1], ARGV[3]) == 1 then
  if redis.call('HINCRBY', KEYS[1], ARGV[3], delta) < 0 then
    redis.call('HSET', KEYS[1], ARGV[3], 0)
  end
end
return 1
"""

# KEYS: leases. ARGV: lease_ms, lease ids... (only leases still held are extended: XX)
RENEW = _CLOCK + """
for i = 2, #ARGV do
  redis.call('ZADD', KEYS[1], 'XX', now * 1000 + tonumber(ARGV[1]), ARGV[i])
end
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[1]))
return 1
"""


def _keys(tenant: str) -> tuple[str, str, str]:
    """Its tokens and requests per second, and its leases; `{tenant}` is the hash tag."""
    base = f"kvasir:quota:{{{tenant}}}"
    return f"{base}:tokens", f"{base}:requests", f"{base}:leases"


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
        args: list[str | int] = [limits.tokens_per_minute, limits.requests_per_minute,
                                 limits.max_concurrent, cost, lease_id, self.lease_ms]
        try:
            async with asyncio.timeout(self.deadline):
                refused, wait, tok, req, tok_reset, req_reset, second = await self._admit(
                    keys=list(_keys(tenant)), args=args)
        except (RedisError, OSError, TimeoutError) as exc:
            self._failed("fail_open" if self.fail_open else "fail_closed", exc)
            return Admission(self.fail_open, None if self.fail_open else "store", 1.0, limits,
                             float(limits.tokens_per_minute), float(limits.requests_per_minute),
                             enforced=False)
        refused_by = refused.decode() or None
        return Admission(refused_by is None, refused_by, float(wait), limits, float(tok),
                         float(req), float(tok_reset), float(req_reset), int(second))

    async def settle(self, tenant: str, limits: QuotaLimits, delta_tokens: int,
                     lease_id: str, window_second: int) -> None:
        tokens, _, leases = _keys(tenant)
        try:
            async with asyncio.timeout(self.deadline):
                await self._settle(keys=[tokens, leases],
                                   args=[delta_tokens, lease_id, window_second])
        except (RedisError, OSError, TimeoutError) as exc:
            self._failed("settle", exc)

    async def renew(self, tenant_to_leases: dict[str, list[str]]) -> None:
        try:
            async with asyncio.timeout(self.deadline * max(1, len(tenant_to_leases))):
                for tenant, leases in tenant_to_leases.items():
                    await self._renew(keys=[_keys(tenant)[2]], args=[self.lease_ms, *leases])
        except (RedisError, OSError, TimeoutError) as exc:
            self._failed("settle", exc)

    async def close(self) -> None:
        await self.client.aclose()
