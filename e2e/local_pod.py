"""`make e2e-local`: the pod the operator renders, run as the kubelet would, on this machine alone.

No cluster and no registry: the images of `make images` are run with `buildah run --isolation
chroot` (podman's runtimes fail on these machines, docs/images.md), in the host's network
namespace, so every address is loopback. The model is uploaded to a moto S3 server on 127.0.0.1;
the InferenceService's Deployment is rendered by the operator's own renderer; then each
initContainer and the engine container run with the pod's image, user, capabilities, volumes
(host directories standing in for hostPath, emptyDir and the projected token), env and command,
and the probes are polled at the rendered periods. Pass: the weights are fetched and verified,
/ready turns 200 within the startup probe's budget, a completion is served (also through the
gateway image), SIGTERM after the preStop drains an in-flight request and the engine exits 0, a
second pod start finds the cache verified and downloads nothing, and the operator image answers
its liveness endpoint. After each container, its image's root filesystem is checked for writes:
buildah cannot mount it read-only, so readOnlyRootFilesystem is verified instead of enforced
(e2e/buildah_pod.py).

Two deviations, both forced by the host network: the engine binds 127.0.0.1 instead of 0.0.0.0
(a pod's 0.0.0.0 is its own namespace), and its port is $E2E_PORT (18000) so as not to collide
with anything else on the machine; the probes follow the port.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from buildah_pod import Pod, fail, log, main_process, run_image, stop_image

REPO = Path(__file__).resolve().parent.parent
TAG = os.environ.get("TAG", "dev")
WORK = Path(os.environ.get("E2E_WORK", "/var/tmp/kvasir-e2e-local"))
PORT = int(os.environ.get("E2E_PORT", "18000"))
S3_PORT = int(os.environ.get("E2E_S3_PORT", "18001"))
GATEWAY_PORT = int(os.environ.get("E2E_GATEWAY_PORT", "18002"))
HEALTH_PORT = int(os.environ.get("E2E_OPERATOR_HEALTH_PORT", "18003"))
BUCKET, PREFIX = "models", "smollm2"
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
               "AWS_DEFAULT_REGION": "us-east-1"}


def http(method: str, url: str, body: dict[str, Any] | None = None,
         timeout: float = 5.0) -> tuple[int, str]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except (OSError, TimeoutError) as exc:
        return 0, str(exc)


# --- the InferenceService, its model in S3, and the Deployment the operator renders -----------

def start_s3(model_file: Path) -> tuple[subprocess.Popen[bytes], Path]:
    import boto3
    from kvasir_operator.fetch.manifest import write_manifest

    log_path = WORK / "moto.log"
    moto = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                             str(S3_PORT)], stdout=log_path.open("wb"), stderr=subprocess.STDOUT)
    endpoint = f"http://127.0.0.1:{S3_PORT}"
    while http("GET", endpoint)[0] == 0:
        time.sleep(0.2)
    upload = WORK / "upload"
    upload.mkdir()
    shutil.copy(model_file, upload / model_file.name)
    write_manifest(upload)
    s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                      aws_access_key_id="testing", aws_secret_access_key="testing")
    s3.create_bucket(Bucket=BUCKET)
    for path in sorted(upload.iterdir()):
        s3.upload_file(str(path), BUCKET, f"{PREFIX}/{path.name}")
    log(f"s3://{BUCKET}/{PREFIX}/ on {endpoint}: " + ", ".join(
        f"{p.name} ({p.stat().st_size} bytes)" for p in sorted(upload.iterdir())))
    return moto, log_path


def render_pod(weights_bytes: int) -> dict[str, Any]:
    from kvasir_operator.render import Owner, render_deployment
    from kvasir_operator.spec import spec_hash
    from kvasir_operator.spec_parse import parse_spec

    raw = {"model": {"uri": f"s3://{BUCKET}/{PREFIX}", "name": "smollm2",
                     "credentialsSecret": "s3-creds"},
           "engine": {"image": f"kvasir-engine:{TAG}", "imagePullPolicy": "Never"},
           "fetch": {"image": f"kvasir-operator:{TAG}",
                     "endpointUrl": f"http://127.0.0.1:{S3_PORT}", "region": "us-east-1"},
           "cache": {"type": "hostPath", "path": str(WORK / "node-cache")},
           "resources": {"gpus": 0, "cpu": "2", "memory": "2Gi"}}
    spec = parse_spec("smollm2", raw)
    deployment = render_deployment(spec, Owner("smollm2", "default", "uid-e2e"),
                                   spec_hash(spec), weights_bytes)
    (WORK / "deployment.json").write_text(json.dumps(deployment, indent=2))
    pod: dict[str, Any] = deployment["spec"]["template"]["spec"]
    return pod


# --- the pod, container by container, as the kubelet starts it ---------------------------------

def secret_env() -> dict[str, str]:
    return dict(CREDENTIALS)  # the Secret `s3-creds` that envFrom names


def run_init_containers(pod: Pod) -> str:
    output = ""
    for container in pod.spec["initContainers"]:
        env = secret_env() if container.get("envFrom") else {}
        args = pod.run_args(container, env)
        started = time.monotonic()
        done = subprocess.run(args, capture_output=True, text=True)
        text = (done.stdout + done.stderr).strip()
        for line in text.splitlines()[-4:]:
            log(f"  {container['name']}| {line}")
        log(f"initContainer {container['name']} exited {done.returncode} "
            f"in {time.monotonic() - started:.1f}s")
        if done.returncode != 0:
            fail(f"initContainer {container['name']} failed")
        pod.check_root_unwritten(container, pod.containers[-1])
        output += text
    return output


def loopback(container: dict[str, Any]) -> dict[str, Any]:
    args = list(container["args"])
    args[args.index("--host") + 1] = "127.0.0.1"
    args[args.index("--port") + 1] = str(PORT)
    return {**container, "args": args}


def probe_until_ready(engine: dict[str, Any], process: subprocess.Popen[bytes]) -> float:
    """Poll as the kubelet does: the startup probe every periodSeconds until it passes or its
    failureThreshold is spent; then readiness at its period. Returns seconds to /ready 200."""
    startup, ready = engine["startupProbe"], engine["readinessProbe"]
    budget = startup["periodSeconds"] * startup["failureThreshold"]
    started = time.monotonic()
    for attempt in range(startup["failureThreshold"]):
        if process.poll() is not None:
            fail(f"engine exited {process.returncode} during startup")
        code, _ = http("GET", f"http://127.0.0.1:{PORT}{startup['httpGet']['path']}",
                       timeout=startup["timeoutSeconds"])
        if code == 200:
            log(f"startupProbe {startup['httpGet']['path']} 200 after "
                f"{time.monotonic() - started:.1f}s (attempt {attempt + 1}, budget {budget}s)")
            break
        time.sleep(startup["periodSeconds"])
    else:
        fail(f"startupProbe never passed within {budget}s")
    while True:
        code, body = http("GET", f"http://127.0.0.1:{PORT}{ready['httpGet']['path']}",
                          timeout=ready["timeoutSeconds"])
        elapsed = time.monotonic() - started
        if code == 200:
            log(f"readinessProbe /ready 200 at {elapsed:.1f}s after the engine started")
            return elapsed
        if elapsed > budget:
            fail(f"/ready not 200 within the startup budget ({budget}s): {code} {body[:200]}")
        time.sleep(ready["periodSeconds"])


def completion(port: int, prompt: str, max_tokens: int) -> dict[str, Any]:
    code, body = http("POST", f"http://127.0.0.1:{port}/v1/completions",
                      {"model": "smollm2", "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0}, timeout=120)
    if code != 200:
        fail(f"completion on :{port} answered {code}: {body[:300]}")
    answer: dict[str, Any] = json.loads(body)
    return answer


def watch_probes(engine: dict[str, Any], process: subprocess.Popen[bytes],
                 restarts: list[float]) -> None:
    """After the startup probe, the kubelet polls readiness and liveness at their periods until
    the container ends: each change of answer is logged; liveness failing failureThreshold
    times in a row would be a restart, recorded in `restarts` (the run fails on it)."""
    def poll() -> None:
        probes = {"readinessProbe": engine["readinessProbe"],
                  "livenessProbe": engine["livenessProbe"]}
        due = dict.fromkeys(probes, time.monotonic())
        last: dict[str, int] = {}
        misses = 0
        while process.poll() is None:
            for name, probe in probes.items():
                if time.monotonic() < due[name]:
                    continue
                due[name] += probe["periodSeconds"]
                code, _ = http("GET", f"http://127.0.0.1:{PORT}{probe['httpGet']['path']}",
                               timeout=probe["timeoutSeconds"])
                if process.poll() is not None:
                    return
                if code != last.get(name):
                    log(f"{name} {probe['httpGet']['path']}: {code or 'no answer'}")
                    last[name] = code
                if name == "livenessProbe":
                    misses = 0 if code == 200 else misses + 1
                    if misses >= probe["failureThreshold"]:
                        log("livenessProbe failed: the kubelet would restart the engine")
                        restarts.append(time.monotonic())
                        misses = 0
            time.sleep(0.2)

    threading.Thread(target=poll, daemon=True).start()


def run_engine(pod: Pod, with_gateway: bool) -> None:
    engine = loopback(pod.spec["containers"][0])
    args = pod.run_args(engine, {})
    log("engine: " + " ".join([*engine["command"], *engine["args"]]))
    out = (pod.root / "engine.log").open("wb")
    process = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        probe_until_ready(engine, process)
        restarts: list[float] = []
        watch_probes(engine, process, restarts)
        answer = completion(PORT, "The capital of France is", 12)
        log(f"completion: {answer['choices'][0]['text']!r} "
            f"({answer['usage']['completion_tokens']} tokens)")
        if with_gateway:
            run_gateway()
        drain(pod, engine, process)
        if restarts:
            fail("the liveness probe failed while the engine ran")
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        pod.check_root_unwritten(engine, pod.containers[-1])


def drain(pod: Pod, engine: dict[str, Any], process: subprocess.Popen[bytes]) -> None:
    """The kubelet's termination: the preStop hook (exec, in the container), then SIGTERM to the
    main process, then up to the grace period before SIGKILL. A request sent just before the
    SIGTERM must still be answered in full."""
    grace = pod.spec["terminationGracePeriodSeconds"]
    pre_stop = engine["lifecycle"]["preStop"]["exec"]["command"]
    log(f"terminating: preStop {pre_stop}, then SIGTERM (grace {grace}s)")
    started = time.monotonic()
    subprocess.run(["buildah", "run", "--isolation", "chroot", "--user", "1000:1000",
                    pod.containers[-1], "--", *pre_stop], check=True)
    in_flight: dict[str, Any] = {}
    request = threading.Thread(target=lambda: in_flight.update(
        completion(PORT, "Write a short story about a lighthouse:", 48)))
    request.start()
    time.sleep(0.5)
    os.kill(main_process(process), signal.SIGTERM)
    try:
        code = process.wait(timeout=max(1.0, grace - (time.monotonic() - started)))
    except subprocess.TimeoutExpired:
        fail(f"engine still running after the {grace}s grace period (the kubelet kills it)")
    request.join(timeout=5)
    tokens = in_flight.get("usage", {}).get("completion_tokens")
    log(f"engine exited {code} {time.monotonic() - started:.1f}s after termination began; "
        f"the in-flight request finished with {tokens} tokens")
    if code != 0 or not tokens:
        fail("the drain did not finish the in-flight request and exit 0")


# --- the gateway and the operator images -------------------------------------------------------

def run_gateway() -> None:
    gateway = run_image(
        WORK, "e2e-gateway", f"kvasir-gateway:{TAG}",
        ["kvasir-gateway", "--host=127.0.0.1", f"--port={GATEWAY_PORT}",
         f"--backend=http://127.0.0.1:{PORT}"], f"http://127.0.0.1:{GATEWAY_PORT}/health")
    try:
        answer = completion(GATEWAY_PORT, "The capital of France is", 12)
        log(f"through the gateway: {answer['choices'][0]['text']!r}")
    finally:
        log(f"gateway exited {stop_image(gateway)} on SIGTERM")


def run_operator() -> None:
    """The operator image with a kubeconfig naming an API server on 127.0.0.1 that is not
    there: kopf's liveness endpoint must still answer (the pod is not restarted while the API
    server is away)."""
    config = WORK / "kubeconfig"
    config.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "local",
        "clusters": [{"name": "local", "cluster": {"server": "http://127.0.0.1:18004"}}],
        "contexts": [{"name": "local", "context": {"cluster": "local", "user": "u"}}],
        "users": [{"name": "u", "user": {"token": "t"}}]}))
    config.chmod(0o644)
    operator = run_image(
        WORK, "e2e-operator", f"kvasir-operator:{TAG}",
        ["kvasir-operator", "run", "--all-namespaces",
         f"--liveness=http://127.0.0.1:{HEALTH_PORT}/healthz"],
        f"http://127.0.0.1:{HEALTH_PORT}/healthz", env={"KUBECONFIG": "/etc/kvasir/kubeconfig"},
        volumes=(f"{config}:/etc/kvasir/kubeconfig:ro",))
    log(f"operator exited {stop_image(operator)} on SIGTERM")


def fetch_without_cache_owner(pod_spec: dict[str, Any]) -> None:
    """Why `cache-owner` exists: the same fetch into a hostPath as the kubelet creates it (root,
    0755) fails."""
    spec = json.loads(json.dumps(pod_spec))
    for volume in spec["volumes"]:
        if volume["name"] == "cache":
            volume["hostPath"]["path"] = str(WORK / "root-owned-cache")
    fetch = next(c for c in spec["initContainers"] if c["name"] == "kvasir-fetch")
    pod = Pod(spec, "smollm2-pod-0", WORK)
    try:
        done = subprocess.run(pod.run_args(fetch, secret_env()), capture_output=True, text=True)
    finally:
        pod.remove()
    # The fetcher's own last line (buildah adds its exit-status lines after it).
    last = ([line for line in done.stderr.splitlines() if line.startswith("kvasir-fetch:")]
            or [""])[-1]
    log(f"without cache-owner: kvasir-fetch exited {done.returncode}: {last}")
    if done.returncode == 0:
        fail("kvasir-fetch wrote a root-owned hostPath: cache-owner would not be needed")


def main() -> None:
    from kvasir_engine.args import default_model_path

    for image in ("kvasir-engine", "kvasir-operator", "kvasir-gateway"):
        if subprocess.run(["buildah", "inspect", "--type", "image", f"{image}:{TAG}"],
                          capture_output=True).returncode != 0:
            fail(f"{image}:{TAG} is missing: make images")
    subprocess.run(["buildah", "rm", "--all"], capture_output=True)
    shutil.rmtree(WORK, ignore_errors=True)
    WORK.mkdir(parents=True)
    model = Path(default_model_path())
    moto, moto_log = start_s3(model)
    try:
        pod_spec = render_pod(model.stat().st_size)
        log("rendered: initContainers " + ", ".join(c["name"] for c in pod_spec["initContainers"])
            + f"; cache hostPath {WORK / 'node-cache'} (absent: made root-owned 0755)")
        fetch_without_cache_owner(pod_spec)
        for attempt, name in enumerate(("smollm2-pod-1", "smollm2-pod-2")):
            log(f"--- pod {name} ---")
            weights = f"GET /{BUCKET}/{PREFIX}/{model.name}"
            gets_before = moto_log.read_text().count(weights)
            pod = Pod(pod_spec, name, WORK)
            try:
                fetch_log = run_init_containers(pod)
                gets = moto_log.read_text().count(weights) - gets_before
                log(f"S3 GETs of the weights during this fetch: {gets}")
                if attempt == 1 and (gets or "(no-op)" not in fetch_log):
                    fail("the second pod start downloaded again instead of reusing the cache")
                run_engine(pod, with_gateway=attempt == 0)
            finally:
                pod.remove()
        run_operator()
    finally:
        moto.terminate()
        moto.wait()
    log("e2e-local ok: fetch -> ready -> completion -> drain, cache reused, gateway, operator")


if __name__ == "__main__":
    main()
