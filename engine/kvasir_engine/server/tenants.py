"""Tenants: API keys parsed into (tenant, sha256 digest) pairs, looked up in constant time, and
the prefix-cache salt each tenant's requests get.

A key entry is `tenant:key` (the first colon separates them) or a bare key, which is its own
tenant named `key-<12 hex digits of an HMAC-SHA256 of it>` under the server's label secret
(`--tenant-label-secret`; random per process when not given). Never the key itself, nor an
unsalted hash of it: tenant names reach logs and metric labels, and a plain SHA-256 of a weak
key (`password123`) is reversed offline from a word list (issue 39). After parsing only digests are kept. A lookup hashes the candidate once and
compares it with every digest (`hmac.compare_digest`, no early exit), so the time taken says
nothing about which key, or whether any, matched.

The salt is what `kv/hashing.py` chains into the first block of every prompt: derived here from
the tenant (or the shared group an operator put it in) and a request's own `cache_salt`, so two
tenants never produce the same block hash and a request's salt can narrow, never widen, sharing.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

# Safe in a metric label, a log line and an HTTP header; what a key file and the gateway header
# may name.
TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
TENANT_NAME_RULE = "1-64 characters of A-Z a-z 0-9 . _ -, starting with a letter or digit"


def digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


def is_tenant_name(name: str) -> bool:
    return TENANT_NAME.fullmatch(name) is not None


@dataclass(frozen=True)
class TenantKey:
    tenant_id: str
    key_digest: bytes  # sha256 of the key; the key itself is not kept

    def __repr__(self) -> str:  # no digest in logs or tracebacks either
        return f"TenantKey(tenant_id={self.tenant_id!r})"


def bare_key_tenant(key: str, label_secret: bytes) -> str:
    """The tenant name of a bare key: a keyed hash, which nobody without the secret can test a
    guessed key against."""
    mac = hmac.new(label_secret, key.encode("utf-8"), hashlib.sha256).hexdigest()
    return f"key-{mac[:12]}"


def parse_key_entry(entry: str, where: str, label_secret: bytes) -> TenantKey:
    """`tenant:key` or a bare key; `where` names the source in errors ("--api-key-file:3");
    `label_secret` keys the name of a bare key's tenant (`bare_key_tenant`)."""
    text = entry.strip()
    tenant, sep, key = text.partition(":")
    if not sep:
        tenant, key = "", text
        if not key:
            raise ValueError(f"{where}: empty key")
        return TenantKey(bare_key_tenant(key, label_secret), digest(key))
    tenant, key = tenant.strip(), key.strip()
    if not tenant:
        raise ValueError(f"{where}: empty tenant name before ':'")
    if not is_tenant_name(tenant):
        raise ValueError(f"{where}: tenant name {tenant!r} is not {TENANT_NAME_RULE}")
    if not key:
        raise ValueError(f"{where}: empty key after '{tenant}:'")
    return TenantKey(tenant, digest(key))


def parse_key_lines(text: str, source: str,
                    label_secret: bytes) -> list[tuple[str, TenantKey]]:
    """Non-blank, non-comment lines of a key file as (`source:line`, key); `#` starts a comment."""
    entries = []
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        if stripped and not stripped.startswith("#"):
            where = f"{source}:{number}"
            entries.append((where, parse_key_entry(stripped, where, label_secret)))
    return entries


def merge_keys(entries: Iterable[tuple[str, TenantKey]]) -> tuple[TenantKey, ...]:
    """One entry per key. A key given twice is an error naming both places, unless both name
    the same tenant from different sources (the same key in --api-key and KVASIR_API_KEYS)."""
    seen: dict[bytes, tuple[str, TenantKey]] = {}
    for where, key in entries:
        first = seen.get(key.key_digest)
        if first is None:
            seen[key.key_digest] = (where, key)
            continue
        first_where, first_key = first
        same_source = first_where.rpartition(":")[0] == where.rpartition(":")[0]
        if same_source or first_key.tenant_id != key.tenant_id:
            raise ValueError(f"{where}: duplicate key (already given at {first_where} for "
                             f"tenant {first_key.tenant_id!r})")
    return tuple(key for _, key in seen.values())


class KeyRing:
    """Digests of the accepted keys and their tenants; `tenant_for` is constant-time."""

    def __init__(self, keys: Sequence[TenantKey]) -> None:
        self._keys = tuple(keys)

    def __bool__(self) -> bool:
        return bool(self._keys)

    def tenant_for(self, candidate: str) -> str | None:
        given = digest(candidate)
        found: str | None = None
        for key in self._keys:
            if hmac.compare_digest(given, key.key_digest):
                found = key.tenant_id
        return found


def parse_shared_groups(given: Sequence[str]) -> tuple[frozenset[str], ...]:
    """`--prefix-cache-shared-tenants a,b` (repeatable): each flag one group sharing one salt."""
    groups: list[frozenset[str]] = []
    owner: dict[str, int] = {}
    for index, item in enumerate(given):
        names = [n.strip() for n in item.split(",") if n.strip()]
        where = f"--prefix-cache-shared-tenants {item!r}"
        if len(names) < 2:
            raise ValueError(f"{where}: a shared group needs at least two tenants")
        for name in names:
            if not is_tenant_name(name):
                raise ValueError(f"{where}: tenant name {name!r} is not {TENANT_NAME_RULE}")
            if name in owner and owner[name] != index:
                raise ValueError(f"{where}: tenant {name!r} is already in another shared group")
            owner[name] = index
        groups.append(frozenset(names))
    return tuple(groups)


def cache_salt_for(tenant_id: str, shared_groups: Sequence[frozenset[str]],
                   request_salt: str | None) -> str:
    """The salt of a request's block-hash chain: its tenant's (or its shared group's), combined
    with the request's own `cache_salt`. JSON keeps the parts apart unambiguously."""
    group = next((g for g in shared_groups if tenant_id in g), None)
    parts = ["group", *sorted(group)] if group is not None else ["tenant", tenant_id]
    if request_salt is not None:
        parts += ["request", request_salt]
    return json.dumps(parts, ensure_ascii=True, separators=(",", ":"))
