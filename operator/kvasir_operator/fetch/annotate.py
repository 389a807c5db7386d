"""Publish fetch progress on the pod as the `kvasir.dev/fetch-progress` annotation.

The initContainer runs as the pod's service account; the downward API gives it POD_NAME and
POD_NAMESPACE. The operator reads the annotation into `status.download`. Progress is a courtesy:
every failure here (no RBAC, API server down, no config) is logged once and swallowed, it never
fails or slows the fetch (each patch has a short timeout and runs on the progress thread).

The client is lightkube's (as the operator's and the gateway's), synchronous here: the in-pod
service account, else $KUBECONFIG / ~/.kube/config.
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

    def _client(self) -> Any:
        if self._api is None:
            import httpx2
            from lightkube import Client
            from lightkube.config.kubeconfig import KubeConfig

            self._api = Client(config=KubeConfig.from_env(),
                               timeout=httpx2.Timeout(_PATCH_TIMEOUT_S), trust_env=False)
        return self._api

    def patch(self, progress: dict[str, Any]) -> bool:
        """Merge-patch the annotation; False (after one warning line) when it could not."""
        from lightkube.resources.core_v1 import Pod
        from lightkube.types import PatchType

        body = {"metadata": {"annotations": {ANNOTATION: json.dumps(progress, sort_keys=True)}}}
        try:
            self._client().patch(Pod, self.name, body, namespace=self.namespace,
                                 patch_type=PatchType.MERGE)
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
