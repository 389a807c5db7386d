#!/usr/bin/env bash
# End-to-end scenario against the current kube context (kind with the CPU engine, or a GPU
# cluster): install the chart, apply an InferenceService, wait Ready, send a completion, scale,
# delete. Usage: e2e/scenario.sh [NAME] (default smollm2: e2e/$NAME.yaml).
# Images first (docs/images.md): `make images`, then on kind `kind load docker-image
# kvasir-engine:dev kvasir-operator:dev kvasir-gateway:dev` (with buildah: `buildah push IMAGE
# docker-archive:/tmp/x.tar:IMAGE` and `kind load image-archive /tmp/x.tar`); KIND_CLUSTER=NAME
# makes this script load them. A GPU cluster pulls from a registry: OPERATOR_IMAGE/OPERATOR_TAG
# name the operator, the InferenceService's engine.image and fetch.image the others.
set -euo pipefail
cd "$(dirname "$0")/.."
name=${1:-smollm2}
ns=${E2E_NAMESPACE:-kvasir-e2e}
helm=${HELM:-helm}
kubectl get --raw /version >/dev/null
if [ -n "${KIND_CLUSTER:-}" ]; then
  for image in kvasir-engine:dev kvasir-operator:dev kvasir-gateway:dev; do
    if docker image inspect "$image" >/dev/null 2>&1; then
      kind load docker-image --name "$KIND_CLUSTER" "$image"
    else
      archive=$(mktemp --suffix=.tar)
      buildah push "$image" "docker-archive:$archive:$image"
      kind load image-archive --name "$KIND_CLUSTER" "$archive"
      rm -f "$archive"
    fi
  done
fi
kubectl create namespace "$ns" --dry-run=client -o yaml | kubectl apply -f -
# Serve the e2e namespace only (--namespace NS; the chart also creates the engine ServiceAccount
# there, so the fetch initContainer can publish its progress).
"$helm" upgrade --install kvasir charts/kvasir --namespace "$ns" --wait --set "watchNamespaces={$ns}" \
    --set image.repository="${OPERATOR_IMAGE:-kvasir-operator}" --set image.tag="${OPERATOR_TAG:-dev}"
kubectl -n "$ns" apply -f "e2e/$name.yaml"
kubectl -n "$ns" wait "kisvc/$name" --for=jsonpath='{.status.phase}'=Ready --timeout=20m
kubectl -n "$ns" get kisvc "$name" -o wide
# Where the capacity inputs came from (the source, or the spec's sizeBytes/architecture).
kubectl -n "$ns" get kisvc "$name" -o jsonpath='{.status.conditions[?(@.type=="ModelInspected")].message}{"\n"}'
kubectl -n "$ns" run "curl-$RANDOM" --rm -i --restart=Never --image=curlimages/curl -- \
    -sf "http://$name.$ns.svc/v1/completions" -H 'Content-Type: application/json' \
    -d "{\"model\": \"$name\", \"prompt\": \"Hello\", \"max_tokens\": 8}"
kubectl -n "$ns" scale "kisvc/$name" --replicas=2
kubectl -n "$ns" wait "deployment/$name" --for=jsonpath='{.spec.replicas}'=2 --timeout=2m
kubectl -n "$ns" delete "kisvc/$name" --wait
kubectl -n "$ns" wait "deployment/$name" --for=delete --timeout=2m
echo "e2e ok: $name"
