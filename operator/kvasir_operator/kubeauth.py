"""API credentials, loaded by lightkube: one source for our client and for kopf's own login.

lightkube's kubeconfig loader and httpx transport do what the `kubernetes` package's loaders did
only in part: bearer `token`, `tokenFile` (re-read when the API server answers 401, as client-go
does, so a rotated file is picked up mid-run), `exec` plugins (re-run on 401), basic auth, client
certificates (files or embedded data) and the cluster CA. In a pod, the service-account directory
(token, ca.crt, namespace) and KUBERNETES_SERVICE_HOST/PORT come from `Settings`, so tests point
them at a temporary directory.

kopf authenticates its watch streams with its own `ConnectionInfo`; `kopf_connection` builds it
from the same config and a fresh credential (the token file read now, the exec plugin run now).
kopf calls its login handler again whenever the API server refuses the credential it has, which
is how a rotated token reaches kopf too.
"""

from __future__ import annotations

from pathlib import Path

import httpx2
import kopf
import lightkube
from lightkube.config import client_adapter
from lightkube.config.kubeconfig import KubeConfig, SingleConfig
from lightkube.config.models import Cluster, User
from lightkube.core.exceptions import ConfigError

from kvasir_operator.settings import Settings

DEFAULT_KUBECONFIG = "~/.kube/config"


def in_cluster_config(settings: Settings) -> SingleConfig:
    """The pod's service account: token file (re-read on 401), CA and namespace."""
    account = Path(settings.service_account_dir)
    token, ca = account / "token", account / "ca.crt"
    if not token.is_file():
        raise ConfigError(f"in-cluster: no service-account token at {token}")
    namespace_file = account / "namespace"
    namespace = namespace_file.read_text().strip() if namespace_file.is_file() else None
    host = settings.kubernetes_service_host or ""
    if ":" in host:  # IPv6
        host = f"[{host}]"
    cluster = Cluster(server=f"https://{host}:{settings.kubernetes_service_port}",
                      certificate_auth=str(ca) if ca.is_file() else None)
    return _select(KubeConfig.from_one(cluster=cluster, user=User(token_file=str(token)),
                                       namespace=namespace), None)


def load_config(settings: Settings) -> SingleConfig:
    """In-cluster when the settings say so (and the pod has a token), else the kubeconfig's
    (chosen) context."""
    path = Path(settings.kubeconfig or DEFAULT_KUBECONFIG).expanduser()
    if settings.in_cluster:
        try:
            return in_cluster_config(settings)
        except ConfigError as exc:
            if not path.is_file():  # a pod without a mounted token and no kubeconfig either
                raise ConfigError(f"{exc}, and no kubeconfig at {path}") from exc
    if not path.is_file():
        raise ConfigError(f"no kubeconfig at {path} and not in a cluster")
    return _select(KubeConfig.from_file(path), settings.context)


def server_config(server: str) -> SingleConfig:
    """A config for a server that needs no credentials (an emulator on loopback)."""
    return _select(KubeConfig.from_one(cluster=Cluster(server=server), user=User()), None)


def _select(config: KubeConfig, context: str | None) -> SingleConfig:
    selected = config.get(context_name=context)
    if selected is None:
        raise ConfigError(f"kubeconfig: no context {context!r} and no current-context")
    return selected


def async_client(config: SingleConfig, *, user_agent: str,
                 timeout_seconds: float) -> lightkube.AsyncClient:
    """lightkube's AsyncClient for `config`, naming `user_agent` in the API server's audit log.

    Its httpx client (TLS and the auth flow lightkube built from `config`) is the one transport
    of every request; lightkube takes no headers, so the User-Agent is set on that client."""
    client = lightkube.AsyncClient(config, timeout=httpx2.Timeout(timeout_seconds),
                                   trust_env=False)
    transport_of(client).headers["User-Agent"] = user_agent
    return client


def transport_of(client: lightkube.AsyncClient) -> httpx2.AsyncClient:
    """The httpx client inside lightkube's client (its base URL, TLS and credentials)."""
    http = client._client._client  # lightkube exposes no accessor for it
    assert isinstance(http, httpx2.AsyncClient)
    return http


def _authorization(config: SingleConfig) -> str | None:
    """The Authorization header lightkube's auth flow puts on a request, obtained now."""
    auth = client_adapter.user_auth(config.user)  # a fresh flow: nothing cached from before
    if auth is None:
        return None
    request = httpx2.Request("GET", config.cluster.server)
    flow = auth.sync_auth_flow(request)
    sent = next(flow)
    flow.close()
    value = sent.headers.get("Authorization")
    return str(value) if value else None


def kopf_connection(config: SingleConfig) -> kopf.ConnectionInfo:
    cluster, user = config.cluster, config.user or User()
    ca_path = config.abs_file(cluster.certificate_auth) if cluster.certificate_auth else None
    header = _authorization(config)
    scheme, _sep, credential = (header or "").partition(" ")
    username = password = None
    token: str | None = credential or None
    if scheme == "Basic":  # kopf takes basic auth as username and password
        username, password, token = user.username, user.password, None
    return kopf.ConnectionInfo(
        server=cluster.server,
        ca_path=str(ca_path) if ca_path else None,
        ca_data=cluster.certificate_auth_data,  # base64, as kubeconfig holds it; kopf decodes
        insecure=cluster.insecure or None,
        scheme=scheme or None, token=token, username=username, password=password,
        certificate_path=str(config.abs_file(user.client_cert)) if user.client_cert else None,
        certificate_data=user.client_cert_data,
        private_key_path=str(config.abs_file(user.client_key)) if user.client_key else None,
        private_key_data=user.client_key_data,
        default_namespace=config.context.namespace)

