"""API keys to tenants: the engine's `--api-key-file` format, kept as hashes, reloaded on change.

A line is `tenant:key` (the first colon separates them) or a bare key, which is its own tenant
`key-<12 hex of its sha256>` (never the key: tenant names reach logs and metric labels); `#`
starts a comment. Only sha256 digests are kept. A lookup hashes the candidate once and compares
it with every digest (`hmac.compare_digest`, no early exit), so timing tells nothing about which
key matched. `KeyFile` re-reads the file when its mtime or size changes (a mounted Secret is
updated by the kubelet swapping a symlink); a file that fails to parse keeps the previous keys
and logs why, so a bad edit never locks every tenant out.
"""

from __future__ import annotations

import hashlib
import hmac
import logging

from kvasir_gateway.config import ANONYMOUS_TENANT, TENANT_NAME_RULE, is_tenant_name
from kvasir_gateway.errors import GatewayError
from kvasir_gateway.watched_file import WatchedFile

log = logging.getLogger("kvasir_gateway.tenants")


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


def parse_key_file(text: str, source: str) -> tuple[tuple[str, bytes], ...]:
    """(tenant, sha256 of key) per entry; errors name `source:line`."""
    entries: dict[bytes, tuple[str, str]] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        where = f"{source}:{number}"
        tenant, sep, key = line.partition(":")
        tenant, key = tenant.strip(), key.strip()
        if not sep:
            key = tenant
            tenant = f"key-{_digest(key).hex()[:12]}"
        elif not tenant:
            raise ValueError(f"{where}: empty tenant name before ':'")
        elif not is_tenant_name(tenant):
            raise ValueError(f"{where}: tenant name {tenant!r} is not {TENANT_NAME_RULE}")
        if not key:
            raise ValueError(f"{where}: empty key")
        d = _digest(key)
        if d in entries:
            raise ValueError(f"{where}: duplicate key (already given at {entries[d][1]})")
        entries[d] = (tenant, where)
    return tuple((tenant, d) for d, (tenant, _) in entries.items())


class KeyRing:
    def __init__(self, entries: tuple[tuple[str, bytes], ...] = ()) -> None:
        self._entries = entries

    def __len__(self) -> int:
        return len(self._entries)

    def tenant_for(self, candidate: str) -> str | None:
        given = _digest(candidate)
        found: str | None = None
        for tenant, d in self._entries:
            if hmac.compare_digest(given, d):
                found = tenant
        return found


class KeyFile:
    """The key ring of one file, re-read when the file changes (`refresh`, called periodically)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.file = WatchedFile(path)
        self.ring = KeyRing()
        self.refresh(strict=True)

    def refresh(self, strict: bool = False) -> bool:
        """Reload if changed; True when new keys were loaded. `strict`: errors raise (start-up)."""
        try:
            text = self.file.read_if_changed()
            if text is None:
                return False
            ring = KeyRing(parse_key_file(text, self.path))
        except (OSError, ValueError, UnicodeDecodeError) as exc:
            if strict:
                raise ValueError(f"--api-key-file: {exc}") from None
            self.file.report(exc, f"the previous {len(self.ring)} keys")
            return False
        self.ring = ring
        self.file.loaded()
        log.info("loaded %d API keys from %s", len(ring), self.path)
        return True


def authenticate(keys: KeyFile | None, authorization: str) -> str:
    """The tenant of an `Authorization` header; no key file: everyone is the anonymous tenant."""
    if keys is None:
        return ANONYMOUS_TENANT
    scheme, _, token = authorization.partition(" ")
    if not authorization:
        raise GatewayError(401, "missing API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key")
    tenant = keys.ring.tenant_for(token.strip()) if scheme.lower() == "bearer" else None
    if tenant is None:
        raise GatewayError(401, "invalid API key", code="invalid_api_key")
    return tenant
