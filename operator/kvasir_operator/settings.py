"""The operator's settings: one frozen object, built once from the environment and the CLI.

`main.py` builds it (`Settings.from_env(os.environ)` plus the command line) and the startup
handler keeps it in kopf's memo; nothing else in the operator reads the environment. Tests build
one directly, which is how they point the API loader at a temporary kubeconfig or service-account
directory instead of patching globals.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from kvasir_operator import labels

SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
SCRAPE_ROUTES = ("auto", "direct", "proxy")


def _float(env: Mapping[str, str], key: str, default: float) -> float:
    text = env.get(key)
    if text is None or text == "":
        return default
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{key}: not a number: {text!r}") from None


@dataclass(frozen=True)
class Settings:
    # Where the API credentials come from. In-cluster when kubernetes_service_host is set (the
    # kubelet's env in a pod): token, ca.crt and namespace under service_account_dir, the token
    # re-read when the API server refuses it (the kubelet rotates it). Else the kubeconfig.
    kubeconfig: str | None = None  # None: ~/.kube/config
    context: str | None = None
    kubernetes_service_host: str | None = None
    kubernetes_service_port: str = "443"
    service_account_dir: str = SERVICE_ACCOUNT_DIR
    # Reconcile: a slow safety net (children's events are the fast path) and the retry backoff
    # of a failed reconcile: base x 2^retry seconds, capped.
    reconcile_interval_seconds: float = 60.0
    retry_base_seconds: float = 5.0
    retry_max_seconds: float = 300.0
    engine_service_account: str = labels.ENGINE_SERVICE_ACCOUNT
    # Reading a model's size and shape from its source before rendering.
    model_probe_timeout_seconds: float = 20.0
    model_probe_retry_seconds: float = 300.0
    pvc_root: str = "/mnt/kvasir-pvc"
    # The builtin autoscaler's /metrics scrape: direct to pod IPs, or through the pod proxy.
    scrape_route: str = "auto"
    scrape_timeout_seconds: float = 5.0

    def __post_init__(self) -> None:
        if self.scrape_route not in SCRAPE_ROUTES:
            raise ValueError(f"KVASIR_AUTOSCALER_SCRAPE: must be one of "
                             f"{'|'.join(SCRAPE_ROUTES)}, got {self.scrape_route!r}")
        for name in ("reconcile_interval_seconds", "retry_base_seconds", "retry_max_seconds",
                     "model_probe_timeout_seconds", "scrape_timeout_seconds"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")

    @property
    def in_cluster(self) -> bool:
        return bool(self.kubernetes_service_host)

    @property
    def scrape_direct(self) -> bool:
        """Scrape pod IPs directly: in the cluster ("auto"), or when asked."""
        return self.in_cluster if self.scrape_route == "auto" else self.scrape_route == "direct"

    def retry_delay(self, retry: int) -> float:
        """Seconds before retry number `retry` (0-based) of a failed reconcile."""
        return float(min(self.retry_max_seconds, self.retry_base_seconds * 2 ** min(retry, 30)))

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Settings:
        # KUBECONFIG may list several files (kubectl merges them); the first one is used.
        kubeconfig = next((p for p in (env.get("KUBECONFIG") or "").split(":") if p), None)
        return cls(
            kubeconfig=kubeconfig,
            kubernetes_service_host=env.get("KUBERNETES_SERVICE_HOST") or None,
            kubernetes_service_port=env.get("KUBERNETES_SERVICE_PORT") or "443",
            service_account_dir=env.get("KVASIR_SERVICE_ACCOUNT_DIR") or SERVICE_ACCOUNT_DIR,
            reconcile_interval_seconds=_float(env, "KVASIR_RECONCILE_INTERVAL_SECONDS", 60.0),
            retry_base_seconds=_float(env, "KVASIR_RETRY_BASE_SECONDS", 5.0),
            retry_max_seconds=_float(env, "KVASIR_RETRY_MAX_SECONDS", 300.0),
            engine_service_account=(env.get("KVASIR_ENGINE_SERVICE_ACCOUNT")
                                    or labels.ENGINE_SERVICE_ACCOUNT),
            model_probe_timeout_seconds=_float(env, "KVASIR_MODEL_PROBE_TIMEOUT_SECONDS", 20.0),
            model_probe_retry_seconds=_float(env, "KVASIR_MODEL_PROBE_RETRY_SECONDS", 300.0),
            pvc_root=env.get("KVASIR_PVC_ROOT") or "/mnt/kvasir-pvc",
            scrape_route=env.get("KVASIR_AUTOSCALER_SCRAPE") or "auto",
            scrape_timeout_seconds=_float(env, "KVASIR_AUTOSCALER_SCRAPE_TIMEOUT", 5.0),
        )
