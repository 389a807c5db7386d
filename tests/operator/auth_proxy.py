"""An API server front door on 127.0.0.1 that REQUIRES credentials, in front of kmock.

kmock accepts anonymous calls, so on its own it cannot tell whether the operator authenticates.
`AuthProxy` forwards every request to kmock only when it carries `Authorization: Bearer <t>` with
`t` in `accepted` (or, with TLS and `client_ca`, a client certificate that CA signed); any other
request gets the API server's 401 Status. `accepted` may change while it runs: that is how a test
rotates a token and has the old one refused. Watch streams are forwarded chunk by chunk.
Every request is recorded as (user agent, token or None, HTTP status).

`self_signed` makes the certificate material for TLS with the `cryptography` package.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import ssl
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from aiohttp import web

HOP_HEADERS = {"host", "content-length", "transfer-encoding", "connection", "authorization"}


@dataclass
class Seen:
    user_agent: str
    token: str | None
    status: int


@dataclass
class AuthProxy:
    upstream: str
    accepted: set[str] = field(default_factory=set)
    ssl_context: ssl.SSLContext | None = None
    seen: list[Seen] = field(default_factory=list)
    url: str = ""
    _runner: web.AppRunner | None = None
    _session: aiohttp.ClientSession | None = None

    def _token(self, request: web.Request) -> str | None:
        scheme, _sep, token = request.headers.get("Authorization", "").partition(" ")
        return token if scheme == "Bearer" and token else None

    def _has_client_cert(self, request: web.Request) -> bool:
        transport = request.transport
        peer = transport.get_extra_info("peercert") if transport is not None else None
        return bool(peer)

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        token, agent = self._token(request), request.headers.get("User-Agent", "")
        if token not in self.accepted and not self._has_client_cert(request):
            self.seen.append(Seen(agent, token, 401))
            body = {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                    "reason": "Unauthorized", "message": "Unauthorized", "code": 401}
            return web.json_response(body, status=401)
        assert self._session is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        async with self._session.request(request.method, self.upstream + request.path_qs,
                                         data=await request.read(), headers=headers) as up:
            self.seen.append(Seen(agent, token, up.status))
            resp = web.StreamResponse(status=up.status, headers={
                k: v for k, v in up.headers.items() if k.lower() not in HOP_HEADERS})
            await resp.prepare(request)
            async for chunk in up.content.iter_any():
                await resp.write(chunk)
            await resp.write_eof()
            return resp

    async def start(self) -> str:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        # A client that went away cancels its forwarded request (watch streams included), and
        # the shutdown does not wait a minute for streams that kmock keeps open.
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True,
                                     shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0, ssl_context=self.ssl_context)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"{'https' if self.ssl_context else 'http'}://127.0.0.1:{port}"
        return self.url

    async def stop(self) -> None:
        # Upstream first: that ends the forwarded watch streams, which would hold the shutdown.
        if self._session is not None:
            await self._session.close()
        if self._runner is not None:
            await self._runner.cleanup()

    def statuses(self, agent_prefix: str) -> list[tuple[str | None, int]]:
        return [(s.token, s.status) for s in self.seen if s.user_agent.startswith(agent_prefix)]


@dataclass(frozen=True)
class Pem:
    cert: bytes
    key: bytes

    def write(self, directory: Path, name: str) -> tuple[Path, Path]:
        cert, key = directory / f"{name}.crt", directory / f"{name}.key"
        cert.write_bytes(self.cert)
        key.write_bytes(self.key)
        return cert, key


def self_signed(common_name: str, *, is_server: bool) -> Pem:
    """A self-signed certificate (its own CA) for 127.0.0.1, or a client's."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = datetime.datetime.now(datetime.UTC)
    usage = ExtendedKeyUsageOID.SERVER_AUTH if is_server else ExtendedKeyUsageOID.CLIENT_AUTH
    builder = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
               .add_extension(x509.ExtendedKeyUsage([usage]), critical=False))
    if is_server:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    cert = builder.sign(key, hashes.SHA256())
    return Pem(cert.public_bytes(serialization.Encoding.PEM),
               key.private_bytes(serialization.Encoding.PEM,
                                 serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption()))


def server_tls(server: Pem, directory: Path, client_ca: Pem | None = None) -> ssl.SSLContext:
    cert, key = server.write(directory, "server")
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert, key)
    if client_ca is not None:
        ca_file = directory / "client-ca.crt"
        ca_file.write_bytes(client_ca.cert)
        ctx.load_verify_locations(cafile=str(ca_file))
        ctx.verify_mode = ssl.CERT_OPTIONAL  # a token is accepted too
    return ctx


def kubeconfig(path: Path, server: str, user: dict[str, object],
               cluster: dict[str, object] | None = None) -> Path:
    """A one-context kubeconfig (JSON is YAML)."""
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "k", "cluster": {"server": server, **(cluster or {})}}],
        "users": [{"name": "u", "user": user}],
        "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u", "namespace": "ns1"}}],
    }))
    return path
