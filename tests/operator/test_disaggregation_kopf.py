"""A disaggregated InferenceService under the real operator (kopf, against kmock on 127.0.0.1):
both role Deployments created, a role's readiness reaching status.roles through the Deployment's
watch event (not the periodic resync), a role Deployment deleted by hand brought back, and
turning disaggregation off bringing the plain Deployment back (issue 33)."""

from __future__ import annotations

from typing import Any

import pytest
from kvasir_operator import k8s
from operator_support import isvc, until
from rbac_table import unlisted
from test_operator_kopf import TEST_AGENT, cluster, running_operator  # noqa: F401

NS = "ns1"
ISVCS = "kvasir.dev/v1alpha1/inferenceservices"
SPEC = {"model": {"uri": "/opt/model"}, "resources": {"gpus": 0},
        "autoscaling": {"mode": "none"},
        "disaggregation": {"enabled": True, "prefill": {"replicas": 1},
                           "decode": {"replicas": 1}}}


@pytest.mark.asyncio
async def test_the_operator_runs_both_roles_and_follows_their_readiness(cluster: Any) -> None:  # noqa: F811
    kmock, client = cluster
    kmock.objects[ISVCS, NS, "llm"] = isvc("llm", NS, "uid-1", SPEC)

    async def roles() -> dict[str, Any]:
        obj = await client.get(k8s.INFERENCESERVICES, NS, "llm")
        return dict(((obj or {}).get("status") or {}).get("roles") or {})

    async with running_operator():
        for role in ("prefill", "decode"):
            await until(f"the {role} Deployment",
                        lambda role=role: client.get(k8s.DEPLOYMENTS, NS, f"llm-{role}"))
        await until("status.roles", roles)
        for role in ("prefill", "decode"):  # what the Deployment controller would report
            await client.patch_merge(k8s.DEPLOYMENTS, NS, f"llm-{role}", {"status": {
                "replicas": 1, "readyReplicas": 1, "updatedReplicas": 1}})

        async def both_ready() -> bool:
            now = await roles()
            return all((now.get(r) or {}).get("readyReplicas") == 1
                       for r in ("prefill", "decode"))

        await until("both roles ready in status.roles", both_ready)
        obj = await client.get(k8s.INFERENCESERVICES, NS, "llm")
        assert obj is not None and obj["status"]["phase"] == "Ready"

        assert await client.delete(k8s.DEPLOYMENTS, NS, "llm-decode")
        await until("the decode Deployment back",
                    lambda: client.get(k8s.DEPLOYMENTS, NS, "llm-decode"))

        await client.patch_merge(k8s.INFERENCESERVICES, NS, "llm", {
            "spec": {"disaggregation": {"enabled": False}}, "metadata": {"generation": 2}})
        await until("the plain Deployment", lambda: client.get(k8s.DEPLOYMENTS, NS, "llm"))

        async def roles_gone() -> bool:
            left = [await client.get(k8s.DEPLOYMENTS, NS, f"llm-{r}")
                    for r in ("prefill", "decode")]
            return left == [None, None]

        await until("the role Deployments deleted", roles_gone)
    requests = [r for r in kmock if r.headers.get("User-Agent") != TEST_AGENT]
    assert unlisted(requests) == set()
