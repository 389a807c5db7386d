"""Publish fetch progress on the pod as the `kvasir.dev/fetch-progress` annotation.

The initContainer runs as the pod's service account; the downward API gives it POD_NAME and
POD_NAMESPACE. The operator reads the annotation into `status.download`. Progress is a courtesy:
every failure here (no RBAC, API server down, no config) is logged once and swallowed, it never
fails or slows the fetch (each patch has a short timeout and runs on the progress thread).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

ANNOTATION = "kvasir.dev/fetch-progress"
_PATCH_TIMEOUT_S = 5.0


class PodAnnotator:
    def __init__(self, name: str, namespace: str) -> None:
        self.name = name
        self.namespace = namespace
        self._api: Any = None
        self._warned = False

    @classmethod
    def from_env(cls) -> PodAnnotator | None:
        name, namespace = os.environ.get("POD_NAME"), os.environ.get("POD_NAMESPACE")
        return cls(name, namespace) if name and namespace else None

    def _core_api(self) -> Any:
        if self._api is None:
            from kubernetes import client, config

            try:
                config.load_incluster_config()  # type: ignore[no-untyped-call]
            except config.ConfigException:
                config.load_kube_config()  # type: ignore[no-untyped-call]
            self._api = client.CoreV1Api()
        return self._api

    def patch(self, progress: dict[str, Any]) -> bool:
        """Merge-patch the annotation; False (after one warning line) when it could not."""
        body = {"metadata": {"annotations": {ANNOTATION: json.dumps(progress, sort_keys=True)}}}
        try:
            self._core_api().patch_namespaced_pod(
                self.name,
                self.namespace,
                body,
                _content_type="application/merge-patch+json",
                _request_timeout=_PATCH_TIMEOUT_S,
            )
            return True
        except Exception as exc:  # noqa: BLE001 - progress must never fail the fetch
            if not self._warned:
                self._warned = True
                reason = getattr(exc, "reason", None) or type(exc).__name__
                print(
                    f"kvasir-fetch: warning: cannot annotate pod {self.namespace}/{self.name} "
                    f"({reason}); continuing without progress annotations",
                    file=sys.stderr,
                    flush=True,
                )
            return False
