"""The operator authenticates as a real cluster asks: every credential kind, through AuthProxy.

AuthProxy (auth_proxy.py) sits in front of kmock on 127.0.0.1 and refuses, with 401, any request
without an accepted bearer token or client certificate. The operator runs in this event loop
(`kopf.operator` with the `Settings` in its memo, as main.py runs it) and must reconcile an
InferenceService with: a kubeconfig token; a kubeconfig tokenFile rotated mid-run, the old token
then refused (our client and kopf's watch/patch calls both move to the new one); and the in-cluster
service account (KUBERNETES_SERVICE_HOST/PORT and a token, ca.crt, namespace directory) over TLS.
Exec plugins and client certificates are checked on single calls.
"""

from __future__ import annotations

import asyncio
import base64
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from auth_proxy import AuthProxy, kubeconfig, self_signed, server_tls
from kmock_namespaces import namespaces_served
from kvasir_operator import k8s, kubeauth
from kvasir_operator.settings import Settings
from lightkube.core.exceptions import ConfigError
from operator_support import isvc, operator_running, serve_operator_cluster, until

NS = "ns1"
ISVCS = "kvasir.dev/v1alpha1/inferenceservices"
SPEC = {"model": {"uri": "/models/m"}, "resources": {"gpus": 0}}  # local: nothing to read


@pytest_asyncio.fixture
async def direct(kmock: Any, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[k8s.K8sClient]:
    """kmock serving the operator's resources; a client that talks to it directly."""
    serve_operator_cluster(kmock, (NS,))
    with namespaces_served(monkeypatch):
        async with k8s.K8sClient(str(kmock.url), user_agent="kvasir-tests") as client:
            yield client


@pytest_asyncio.fixture
async def proxy(kmock: Any) -> AsyncIterator[AuthProxy]:
    front = AuthProxy(str(kmock.url).rstrip("/"))
    await front.start()
    yield front
    await front.stop()


@pytest_asyncio.fixture
async def tls_proxy(kmock: Any, tmp_path: Path) -> AsyncIterator[tuple[AuthProxy, Path, Any]]:
    """TLS with a self-signed server certificate; clients also accepted by a certificate."""
    server, client_ca = self_signed("127.0.0.1", is_server=True), self_signed("kvasir",
                                                                            is_server=False)
    front = AuthProxy(str(kmock.url).rstrip("/"),
                      ssl_context=server_tls(server, tmp_path, client_ca))
    await front.start()
    ca = tmp_path / "ca.crt"
    ca.write_bytes(server.cert)
    yield front, ca, client_ca
    await front.stop()


async def _deployment(client: k8s.K8sClient, name: str) -> Any:
    return await client.get(k8s.DEPLOYMENTS, NS, name)


async def _reconciled(client: k8s.K8sClient, name: str) -> bool:
    obj = await client.get(k8s.INFERENCESERVICES, NS, name)
    return bool(obj and (obj.get("status") or {}).get("url")
                and await _deployment(client, name))


@pytest.mark.asyncio
async def test_anonymous_calls_are_refused(proxy: AuthProxy) -> None:
    async with k8s.K8sClient(proxy.url) as anonymous:
        with pytest.raises(k8s.ApiError) as info:
            await anonymous.list(k8s.PODS, NS)
    assert info.value.status == 401 and proxy.seen[-1].token is None


@pytest.mark.asyncio
async def test_kubeconfig_token(kmock: Any, direct: k8s.K8sClient, proxy: AuthProxy,
                                tmp_path: Path) -> None:
    proxy.accepted = {"tok-a"}
    config = kubeconfig(tmp_path / "kubeconfig", proxy.url, {"token": "tok-a"})
    kmock.objects[ISVCS, NS, "a"] = isvc("a", NS, "uid-a", SPEC)
    async with operator_running(Settings(kubeconfig=str(config))):
        await until("a reconciled", lambda: _reconciled(direct, "a"))
    ours, kopfs = proxy.statuses("kvasir-operator"), proxy.statuses("kopf")
    assert ours and kopfs, "both our client and kopf's went through the proxy"
    assert {token for token, _ in ours + kopfs} == {"tok-a"}
    assert not [s for s in proxy.seen if s.status == 401]


@pytest.mark.asyncio
async def test_token_file_rotated_mid_run(kmock: Any, direct: k8s.K8sClient, proxy: AuthProxy,
                                          tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("tok-1\n")
    proxy.accepted = {"tok-1"}
    config = kubeconfig(tmp_path / "kubeconfig", proxy.url, {"tokenFile": str(token_file)})
    kmock.objects[ISVCS, NS, "a"] = isvc("a", NS, "uid-a", SPEC)
    async with operator_running(Settings(kubeconfig=str(config))):
        await until("a reconciled", lambda: _reconciled(direct, "a"))
        # The kubelet rotates the token; the API server refuses the old one from now on.
        token_file.write_text("tok-2\n")
        proxy.accepted = {"tok-2"}
        num_before = len(proxy.seen)
        await direct.apply(isvc("b", NS, "uid-b", SPEC))
        await until("b reconciled", lambda: _reconciled(direct, "b"))

        def moved(agent: str) -> bool:
            after = [(s.token, s.status) for s in proxy.seen[num_before:]
                     if s.user_agent.startswith(agent)]
            return ("tok-2", 200) in after or ("tok-2", 201) in after

        await until("kopf on the new token", lambda: asyncio.sleep(0, moved("kopf")))
    assert moved("kvasir-operator")
    refused = [s for s in proxy.seen[num_before:] if s.status == 401]
    assert refused and {s.token for s in refused} == {"tok-1"}, "only the old token is refused"


@pytest.mark.asyncio
async def test_in_cluster_service_account_over_tls(
        kmock: Any, direct: k8s.K8sClient, tls_proxy: tuple[AuthProxy, Path, Any],
        tmp_path: Path) -> None:
    proxy, ca, _client_ca = tls_proxy
    account = tmp_path / "serviceaccount"
    account.mkdir()
    (account / "token").write_text("sa-token")
    (account / "ca.crt").write_bytes(ca.read_bytes())
    (account / "namespace").write_text(NS)
    proxy.accepted = {"sa-token"}
    port = proxy.url.rsplit(":", 1)[1]
    settings = Settings(kubernetes_service_host="127.0.0.1", kubernetes_service_port=port,
                        service_account_dir=str(account), kubeconfig="/nonexistent")
    assert settings.in_cluster and settings.scrape_direct
    kmock.objects[ISVCS, NS, "a"] = isvc("a", NS, "uid-a", SPEC)
    async with operator_running(settings):
        await until("a reconciled", lambda: _reconciled(direct, "a"))
        assert {token for token, _ in proxy.statuses("")} == {"sa-token"}
        assert proxy.statuses("kopf") and proxy.statuses("kvasir-operator")
        # The kubelet rotates the projected token: the next calls move to the new one.
        (account / "token").write_text("sa-token-2")
        proxy.accepted = {"sa-token-2"}
        await direct.apply(isvc("b", NS, "uid-b", SPEC))
        await until("b reconciled", lambda: _reconciled(direct, "b"))
    assert ("sa-token-2", 200) in proxy.statuses("kvasir-operator")


def test_in_cluster_settings_come_from_the_pod_env(tmp_path: Path) -> None:
    env = {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "KUBERNETES_SERVICE_PORT": "6443",
           "KVASIR_SERVICE_ACCOUNT_DIR": str(tmp_path)}
    settings = Settings.from_env(env)
    (tmp_path / "token").write_text("t")
    config = kubeauth.load_config(settings)
    assert config.cluster.server == "https://10.0.0.1:6443"
    assert config.user is not None and config.user.token_file == str(tmp_path / "token")
    assert not Settings.from_env({}).in_cluster
    # A pod without a mounted token falls back to a kubeconfig, else says what is missing.
    no_token = Settings(kubernetes_service_host="10.0.0.1", service_account_dir=str(tmp_path / "x"),
                        kubeconfig=str(kubeconfig(tmp_path / "kc", "http://127.0.0.1:1", {})))
    assert kubeauth.load_config(no_token).cluster.server == "http://127.0.0.1:1"
    with pytest.raises(ConfigError, match="no service-account token .* and no kubeconfig"):
        kubeauth.load_config(Settings(kubernetes_service_host="10.0.0.1",
                                      service_account_dir=str(tmp_path / "x"),
                                      kubeconfig=str(tmp_path / "none")))
    with pytest.raises(ValueError, match="KVASIR_RETRY_BASE_SECONDS"):
        Settings.from_env({"KVASIR_RETRY_BASE_SECONDS": "soon"})


@pytest.mark.asyncio
async def test_exec_plugin(direct: k8s.K8sClient, proxy: AuthProxy, tmp_path: Path) -> None:
    proxy.accepted = {"tok-exec"}
    credential = {"apiVersion": "client.authentication.k8s.io/v1beta1",
                  "kind": "ExecCredential", "status": {"token": "tok-exec"}}
    config_path = kubeconfig(tmp_path / "kubeconfig", proxy.url, {"exec": {
        "apiVersion": "client.authentication.k8s.io/v1beta1", "command": sys.executable,
        "args": ["-c", f"print({json.dumps(json.dumps(credential))})"]}})
    config = kubeauth.load_config(Settings(kubeconfig=str(config_path)))
    async with k8s.K8sClient(config) as client:
        assert await client.list(k8s.PODS, NS) == []
    info = kubeauth.kopf_connection(config)
    assert (info.scheme, info.token) == ("Bearer", "tok-exec")


@pytest.mark.asyncio
async def test_client_certificate(direct: k8s.K8sClient, tls_proxy: tuple[AuthProxy, Path, Any],
                                  tmp_path: Path) -> None:
    proxy, ca, client_ca = tls_proxy  # no token accepted: only the certificate lets it in
    b64 = {k: base64.b64encode(v).decode() for k, v in
           (("cert", client_ca.cert), ("key", client_ca.key))}
    config_path = kubeconfig(tmp_path / "kubeconfig", proxy.url,
                             {"client-certificate-data": b64["cert"],
                              "client-key-data": b64["key"]},
                             {"certificate-authority": str(ca)})
    config = kubeauth.load_config(Settings(kubeconfig=str(config_path)))
    async with k8s.K8sClient(config) as client:
        assert await client.list(k8s.PODS, NS) == []
    assert proxy.seen[-1].status == 200 and proxy.seen[-1].token is None
    info = kubeauth.kopf_connection(config)
    assert info.certificate_data == b64["cert"] and info.private_key_data == b64["key"]
    assert info.token is None and str(info.ca_path) == str(ca)


def test_the_command_line_picks_the_kubeconfig_and_context(tmp_path: Path) -> None:
    from kvasir_operator.main import parse_args, settings_of

    env = {"KUBECONFIG": f"{tmp_path}/a:{tmp_path}/b", "KVASIR_RECONCILE_INTERVAL_SECONDS": "7"}
    from_env = settings_of(parse_args(["run"]), env)
    assert (from_env.kubeconfig, from_env.context) == (f"{tmp_path}/a", None)
    assert from_env.reconcile_interval_seconds == 7
    chosen = settings_of(parse_args(["run", "--kubeconfig", "/k", "--context", "prod"]), env)
    assert (chosen.kubeconfig, chosen.context) == ("/k", "prod")


@pytest.mark.asyncio
async def test_the_kvasir_operator_command_authenticates(
        kmock: Any, direct: k8s.K8sClient, proxy: AuthProxy, tmp_path: Path) -> None:
    """`kvasir-operator run` as the chart runs it: main.py's Settings, a token, one namespace."""
    import os
    import signal

    proxy.accepted = {"tok-cli"}
    config = kubeconfig(tmp_path / "kubeconfig", proxy.url, {"token": "tok-cli"})
    kmock.objects[ISVCS, NS, "a"] = isvc("a", NS, "uid-a", SPEC)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KUBE", "KVASIR_"))}
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvasir_operator.main", "run", "--namespace", NS,
        "--kubeconfig", str(config), env=env,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
    try:
        await until("a reconciled", lambda: _reconciled(direct, "a"))
    finally:
        process.send_signal(signal.SIGTERM)
        _out, err = await asyncio.wait_for(process.communicate(), timeout=30)
    assert process.returncode == 0, err.decode()[-2000:]
    assert {token for token, _ in proxy.statuses("")} == {"tok-cli"}
    assert proxy.statuses("kopf") and proxy.statuses("kvasir-operator")
