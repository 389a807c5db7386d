"""Bearer API keys to tenants, checked in constant time from the headers, before any body is
read or any route runs (a refused upload is drained and discarded, never buffered).

Keys come from `--api-key` (repeatable), `--api-key-file` and `KVASIR_API_KEYS` (tenants.py
parses them). The tenant a request belongs to is put into its ASGI scope under `TENANT_SCOPE_KEY`
for the routes (`tenant_of`). A request carrying a trusted gateway's key
(`--trusted-gateway-key-file`) may name its tenant in the `x-kvasir-tenant` header; anyone else
sending that header gets 403, so a client cannot claim another tenant's cache or quota. With no
keys of either kind every request is the anonymous tenant. Probes and metrics stay open so that
kubelet and Prometheus need no secret.
"""

from __future__ import annotations

import asyncio
import hmac

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from kvasir_engine.core.request import ANONYMOUS_TENANT
from kvasir_engine.server.body_limit import BODYLESS_METHODS, drain, send_refusal
from kvasir_engine.server.tenants import TENANT_NAME_RULE, KeyRing, is_tenant_name

EXEMPT_PATHS = frozenset({"/health", "/ready", "/metrics"})
TENANT_HEADER = b"x-kvasir-tenant"
TENANT_SCOPE_KEY = "kvasir.tenant_id"
GATEWAY_SCOPE_KEY = "kvasir.is_gateway"  # the caller holds a trusted gateway's key
# The tenant of a gateway request that names none (the gateway's own calls: /v1/models ...).
GATEWAY_DEFAULT_TENANT = ANONYMOUS_TENANT


def is_bearer(request: Request, token: str) -> bool:
    """Whether the request carries `Authorization: Bearer <token>` (compared in constant time)."""
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(),
                                                              token.encode())


def tenant_of(request: Request) -> str:
    return str(request.scope.get(TENANT_SCOPE_KEY, ANONYMOUS_TENANT))


def is_gateway(request: Request) -> bool:
    return bool(request.scope.get(GATEWAY_SCOPE_KEY, False))


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, api_keys: KeyRing, gateway_keys: KeyRing,
                 body_timeout_s: float = 30.0) -> None:
        self.app = app
        self.api_keys = api_keys
        self.gateway_keys = gateway_keys
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in EXEMPT_PATHS:
            await self.app(scope, receive, send)
            return
        authorization, named_tenant = "", None
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                authorization = value.decode("latin-1")
            elif name == TENANT_HEADER:
                named_tenant = value.decode("latin-1").strip()
        scheme, _, token = authorization.partition(" ")
        token = token.strip() if scheme.lower() == "bearer" else ""
        # Both lookups always run, so timing does not tell a gateway key from a tenant's.
        gateway = self.gateway_keys.tenant_for(token) if token else None
        tenant = self.api_keys.tenant_for(token) if token else None
        if gateway is not None:
            if named_tenant is not None and not is_tenant_name(named_tenant):
                await self._refuse(scope, receive, send, 400, f"x-kvasir-tenant "
                                   f"{named_tenant!r} is not {TENANT_NAME_RULE}",
                                   "invalid_tenant")
                return
            tenant = named_tenant or GATEWAY_DEFAULT_TENANT
        elif named_tenant is not None:
            await self._refuse(scope, receive, send, 403, "the x-kvasir-tenant header is "
                               "honoured only with the trusted gateway's key",
                               "tenant_header_forbidden")
            return
        elif not (self.api_keys or self.gateway_keys):
            tenant = ANONYMOUS_TENANT
        if tenant is None:
            await self._refuse(scope, receive, send, 401,
                               "missing API key: send 'Authorization: Bearer <key>'"
                               if not authorization else "invalid API key", "invalid_api_key")
            return
        scope[TENANT_SCOPE_KEY] = tenant
        scope[GATEWAY_SCOPE_KEY] = gateway is not None
        await self.app(scope, receive, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, status: int,
                      message: str, code: str) -> None:
        if scope["method"] not in BODYLESS_METHODS:
            # The unread body is drained (bounded, discarded), so the client reads this
            # answer instead of a reset connection; nothing of it is kept.
            await drain(receive, asyncio.get_running_loop().time() + self.body_timeout_s)
        await send_refusal(send, status, message, code,
                           [(b"www-authenticate", b"Bearer")] if status == 401 else None)
