"""Read a model's capacity inputs from its source before rendering: weight bytes and shape.

`ModelProbe.facts` lists the source through the fetcher's API (the same listing, manifest and
size checks the initContainer will do), reads `config.json`, and returns `ModelFacts`: what the
capacity check and the startup budget use, and the `ModelInspected` condition that says where
the figures came from. Blocking boto3 calls run in a worker thread under a bounded timeout, so a
slow or unreachable store never blocks a reconcile for long; the spec's `model.sizeBytes` and
`model.architecture` are the fallback.

Results are cached per (namespace, name, uri, generation): a timer tick never re-reads S3. A
failed read is retried after `retry_after_seconds`; meanwhile, and whenever a later generation's
read fails, the last successful read of the same URI is kept (the URI is immutable, so the files
are the same), so a transient store error never changes the startup budget and rolls the pods.

S3 credentials come from `spec.model.credentialsSecret` (the same `AWS_*` keys the fetcher gets
through envFrom), read with the operator's client and handed to boto3 explicitly; never logged.
Without a Secret, boto3's default chain of the operator's own pod applies.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvasir_operator import k8s
from kvasir_operator.fetch import FetchError, FetchOptions, open_source, read_catalog
from kvasir_operator.modelconfig import parse_config, weight_bytes
from kvasir_operator.settings import Settings
from kvasir_operator.spec import Architecture, InferenceServiceSpec, ModelSource

log = logging.getLogger(__name__)
CREDENTIAL_KEYS = {"AWS_ACCESS_KEY_ID": "aws_access_key_id",
                   "AWS_SECRET_ACCESS_KEY": "aws_secret_access_key",
                   "AWS_SESSION_TOKEN": "aws_session_token"}
FETCH_REASONS = {"NotFound": "ModelNotFound", "AccessDenied": "AccessDenied",
                 "InvalidConfig": "InvalidSource", "ChecksumMismatch": "ChecksumMismatch"}
MAX_ENTRIES = 4096


@dataclass(frozen=True)
class ModelFacts:
    weights_bytes: int | None
    architecture: Architecture | None
    from_source: bool  # the condition's status: the source was read
    reason: str
    message: str


@dataclass(frozen=True)
class _Read:
    weights_bytes: int
    num_files: int
    architecture: Architecture | None
    config_problem: str | None  # why config.json gave no shape (absent, invalid)


def facts_from_spec(spec: InferenceServiceSpec, reason: str, why: str) -> ModelFacts:
    m = spec.model
    size = (f"spec.model.sizeBytes ({m.size_bytes})" if m.size_bytes is not None
            else "no spec.model.sizeBytes (startup budget 600 s, no capacity check)")
    arch = ("spec.model.architecture" if m.architecture is not None
            else "no spec.model.architecture (no capacity check)")
    return ModelFacts(m.size_bytes, m.architecture, False, reason, f"{why}; using {size} and {arch}")


def _read_source(uri: str, options: FetchOptions, keys: Mapping[str, str]) -> _Read:
    """Blocking: list the source, check its manifest, read config.json."""
    # The operator holds the keys from the Secret, not in its environment: pass them explicitly.
    source = open_source(uri, options, {CREDENTIAL_KEYS[k]: v for k, v in keys.items()} or None)
    catalog = read_catalog(source, allow_unverified=True)  # sizes only; the fetcher verifies
    total, count = weight_bytes((f.path, f.size) for f in catalog.manifest.files)
    raw = source.read_small("config.json")
    if raw is None:
        return _Read(total, count, None, "no config.json")
    try:
        return _Read(total, count, parse_config(raw), None)
    except ValueError as exc:
        return _Read(total, count, None, str(exc))


def _facts_from_read(spec: InferenceServiceSpec, read: _Read) -> ModelFacts:
    head = f"read {spec.model.uri}: {read.num_files} weight file(s), {read.weights_bytes} bytes"
    a = read.architecture
    if a is not None:
        return ModelFacts(read.weights_bytes, a, True, "ReadFromSource",
                          f"{head}; config.json: {a.num_layers} layers, {a.num_kv_heads} KV "
                          f"heads, head dim {a.head_dim}")
    arch = spec.model.architecture
    tail = ("architecture from spec.model.architecture" if arch is not None
            else "architecture unknown, set spec.model.architecture for the capacity check")
    return ModelFacts(read.weights_bytes, arch, True, "SizeFromSource",
                      f"{head}; {read.config_problem}: {tail}")


class ModelProbe:
    """Per-operator cache of `ModelFacts`; one instance lives in kopf's memo."""

    def __init__(self, *, timeout_seconds: float = 20.0, retry_after_seconds: float = 300.0,
                 pvc_root: str = "/mnt/kvasir-pvc",
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout_seconds = timeout_seconds
        self.retry_after_seconds = retry_after_seconds
        self.pvc_root = pvc_root
        self._clock = clock
        self._done: dict[tuple[str, str, str, int | None], ModelFacts] = {}
        self._last_good: dict[tuple[str, str, str], ModelFacts] = {}
        self._failed_at: dict[tuple[str, str, str, int | None], tuple[float, ModelFacts]] = {}
        self.reads = 0  # source reads started (the cache's effect is visible in tests)

    @classmethod
    def from_settings(cls, settings: Settings) -> ModelProbe:
        return cls(timeout_seconds=settings.model_probe_timeout_seconds,
                   retry_after_seconds=settings.model_probe_retry_seconds,
                   pvc_root=settings.pvc_root)

    async def facts(self, client: k8s.K8sClient, namespace: str, name: str,
                    generation: int | None, spec: InferenceServiceSpec) -> ModelFacts:
        uri = spec.model.uri
        key, good_key = (namespace, name, uri, generation), (namespace, name, uri)
        if key in self._done:
            return self._done[key]
        failed = self._failed_at.get(key)
        if failed is not None and self._clock() - failed[0] < self.retry_after_seconds:
            return self._last_good.get(good_key, failed[1])
        result = await self._inspect(client, namespace, spec)
        if result.from_source:
            self._remember(self._done, key, result)
            self._remember(self._last_good, good_key, result)
            self._failed_at.pop(key, None)
            return result
        self._remember(self._failed_at, key, (self._clock(), result))
        kept = self._last_good.get(good_key)
        if kept is not None:
            log.warning("%s/%s: re-reading %s failed (%s); keeping the last read", namespace,
                        name, uri, result.reason)
            return kept
        return result

    @staticmethod
    def _remember(table: dict[Any, Any], key: Any, value: Any) -> None:
        table[key] = value
        if len(table) > MAX_ENTRIES:
            table.pop(next(iter(table)))

    def _local_root(self, source: ModelSource) -> Path:
        if source.is_pvc:
            return Path(self.pvc_root, source.claim or "", source.path)
        return Path(source.path)

    async def _inspect(self, client: k8s.K8sClient, namespace: str,
                       spec: InferenceServiceSpec) -> ModelFacts:
        source, f = spec.model.source, spec.fetch
        uri = source.uri
        if not source.is_s3 and not self._local_root(source).is_dir():
            if source.is_pvc:
                return facts_from_spec(spec, "SourceNotReachable",
                                       f"{uri}: the claim is not mounted in the operator")
            # Not a failure: the weights ship in the engine image, where the operator cannot
            # look (a path on the operator's own disk is read, for dev runs).
            return facts_from_spec(spec, "InImage", f"{uri}: the weights are in the engine "
                                                    f"image, which the operator does not read")
        keys: dict[str, str] = {}
        env: dict[str, str] = {}
        if source.is_s3 and spec.model.credentials_secret:
            secret = spec.model.credentials_secret
            try:
                env = await _secret_env(client, namespace, secret)
            except (k8s.ApiError, ValueError) as exc:
                return facts_from_spec(spec, "CredentialsUnreadable",
                                       f"Secret {namespace}/{secret}: {exc}")
            keys = {k: v for k, v in env.items() if k in CREDENTIAL_KEYS}
            if "AWS_ACCESS_KEY_ID" not in keys or "AWS_SECRET_ACCESS_KEY" not in keys:
                return facts_from_spec(spec, "CredentialsMissing",
                                       f"Secret {namespace}/{secret} lacks AWS_ACCESS_KEY_ID or "
                                       "AWS_SECRET_ACCESS_KEY")
        try:
            options = FetchOptions(
                endpoint_url=f.endpoint_url or env.get("AWS_ENDPOINT_URL_S3")
                or env.get("AWS_ENDPOINT_URL"),
                region=f.region or env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION"),
                addressing_style=f.addressing_style, stall_timeout=self.timeout_seconds,
                retries=1, pvc_root=self.pvc_root)
        except ValueError as exc:
            return facts_from_spec(spec, "InvalidSource", f"fetch options: {exc}")
        self.reads += 1
        try:
            read = await asyncio.wait_for(asyncio.to_thread(_read_source, uri, options, keys),
                                          self.timeout_seconds)
        except TimeoutError:
            # The worker thread ends on boto3's own timeouts; the reconcile does not wait for it.
            return facts_from_spec(spec, "SourceTimeout",
                                   f"{uri}: no answer within {self.timeout_seconds:g} s")
        except FetchError as exc:
            return facts_from_spec(spec, FETCH_REASONS.get(exc.reason, "SourceUnreachable"),
                                   str(exc))
        except Exception as exc:  # any other store failure: report it and fall back
            return facts_from_spec(spec, "SourceUnreachable", f"{uri}: {type(exc).__name__}: "
                                                              f"{exc}")
        return _facts_from_read(spec, read)


async def _secret_env(client: k8s.K8sClient, namespace: str, name: str) -> dict[str, str]:
    """The Secret's keys decoded; ValueError (naming the key, never a value) when unreadable."""
    secret = await client.get(k8s.SECRETS, namespace, name)
    if secret is None:
        raise ValueError("not found")
    data: Mapping[str, str] = secret.get("data") or {}
    env = {}
    for key, value in data.items():
        try:
            env[key] = base64.b64decode(value, validate=True).decode()
        except ValueError as exc:  # binascii.Error and UnicodeDecodeError are ValueErrors
            raise ValueError(f"key {key} is not base64-encoded UTF-8") from exc
    return env
