"""The chart's Grafana dashboards and alert rules against a real Prometheus (issue 37).

Debian's `prometheus` scrapes a real tiny engine (prefix caching, n-gram speculation, a short
queue) and a real gateway in front of it and of a second engine (a cascade's large pool), all
on 127.0.0.1, while a bounded load runs: tenants through the gateway (the small pool, an alias
that shadows, an alias that escalates), a quota storm, a burst straight at the engine that fills
its queue. Then
every dashboard panel's query must return data (a query naming a metric nobody exports returns
none, so a renamed or missing metric fails here), every alert rule of the chart's PrometheusRule
must evaluate without error, the burst must drive KvasirRequestsWaiting to pending and the
quota storm KvasirTenantThrottled (the stalled engine's alert is held by promtool only). The
alerts' thresholds and `for` are held by `promtool test rules` (promtool/*_test.yml).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

pytest.importorskip("torch")
from gateway_support import KEYS, free_port, gateway, post, wait_until  # noqa: E402
from harness import live_server, tiny_config  # noqa: E402
from helm_support import CHART, template  # noqa: E402
from helpers import write_checkpoint  # noqa: E402
from kvasir_engine.config import SpeculativeConfig  # noqa: E402
from kvasir_gateway.aliases import parse_routing  # noqa: E402
from kvasir_gateway.config import QuotaLimits  # noqa: E402

PROMETHEUS = shutil.which("prometheus")
DASHBOARDS = sorted((CHART / "dashboards").glob("*.json"))
PROMTOOL_TESTS = Path(__file__).parent / "promtool"
DATA_DIR = os.environ.get("KVASIR_DASHBOARD_DATA")  # where to keep the panels' query results
GATEWAY_KEY = "gw-dashboards-secret"
# Grafana's variables in the queries: every namespace, model, replica and tenant; a rate window
# of several 1 s scrapes.
VARIABLES = {"$__rate_interval": "10s", "$namespace": ".*", "$model": ".*", "$replica": ".*",
             "$tenant": ".*", "$inferenceservice": ".*"}
REPEATING = "Hello world! Hello world! Hello world! Hello world! Hello"  # n-gram drafts
# Two pools of the same tiny model: "easy" answers from the small one and shadows every answer
# to the large one; no answer is confident enough for "strict", which always escalates.
ROUTING = {
    "aliases": {
        "easy": {"cascade": ["small", "large"], "shadow": {"fraction": 1.0},
                 "checks": {"min_mean_logprob": -100.0, "length": False}},
        "strict": {"cascade": ["small", "large"],
                   "checks": {"min_mean_logprob": -0.0001, "length": False}},
    },
    "pools": {"small": {"cost_per_hour": 1.0, "full_load_tokens_per_second": 500},
              "large": {"cost_per_hour": 4.0, "full_load_tokens_per_second": 200}},
}


def panels(path: Path) -> list[dict[str, Any]]:
    return [p for p in json.loads(path.read_text())["panels"] if p["type"] != "row"]


def test_the_dashboards_are_grafana_json_with_the_variables() -> None:
    assert [p.stem for p in DASHBOARDS] == ["engine", "gateway", "operator"]
    uids = set()
    for path in DASHBOARDS:
        board = json.loads(path.read_text())
        uids.add(board["uid"])
        names = {v["name"] for v in board["templating"]["list"]}
        # the operator's series are per InferenceService, not per tenant
        assert {"datasource", "namespace", "inferenceservice" if path.stem == "operator"
                else "tenant"} <= names
        ids = [p["id"] for p in board["panels"]]
        assert len(ids) == len(set(ids))
        for panel in panels(path):
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
            assert panel["targets"] and all(t["expr"] for t in panel["targets"]), panel["title"]
    assert {"model", "replica"} <= {v["name"] for v in json.loads(
        (CHART / "dashboards" / "engine.json").read_text())["templating"]["list"]}
    assert len(uids) == len(DASHBOARDS)


def test_the_chart_ships_them_as_configmaps_for_grafanas_sidecar(helm: str) -> None:
    assert not [d for d in template(helm) if "dashboard" in d["metadata"]["name"]]
    maps = [d for d in template(helm, "dashboards.enabled=true",
                                "dashboards.annotations.grafana_folder=Kvasir")
            if d["kind"] == "ConfigMap" and "dashboard" in d["metadata"]["name"]]
    assert len(maps) == len(DASHBOARDS)
    for cm in maps:
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert cm["metadata"]["annotations"] == {"grafana_folder": "Kvasir"}
        (name, text), = cm["data"].items()
        assert json.loads(text) == json.loads((CHART / "dashboards" / name[7:]).read_text())
    # the gateway dashboard's series: a ServiceMonitor on the gateway's Service with the engines'
    docs = template(helm, "metrics.serviceMonitor.enabled=true", "gateway.enabled=true")
    service, = [d for d in docs if d["kind"] == "Service" and "gateway" in d["metadata"]["name"]]
    monitors = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ServiceMonitor"}
    gateway_monitor = monitors[service["metadata"]["name"]]
    assert gateway_monitor["spec"]["selector"]["matchLabels"].items() <= \
        service["metadata"]["labels"].items()
    assert gateway_monitor["spec"]["endpoints"][0]["port"] == service["spec"]["ports"][0]["name"]
    assert len(monitors) == 2
    # the operator dashboard's series: a PodMonitor on the operator's metrics port
    operator, = [d for d in docs if d["kind"] == "Deployment"
                 and "gateway" not in d["metadata"]["name"]]
    monitor, = [d for d in docs if d["kind"] == "PodMonitor"]
    port = monitor["spec"]["podMetricsEndpoints"][0]["port"]
    container, = operator["spec"]["template"]["spec"]["containers"]
    assert port in {p["name"] for p in container["ports"]}
    assert any(a.startswith("--metrics-port=") for a in container["args"])
    assert monitor["spec"]["selector"]["matchLabels"].items() <= \
        operator["spec"]["template"]["metadata"]["labels"].items()


class Prometheus:
    """`prometheus` on 127.0.0.1 scraping `targets` every second, with `rules` loaded."""

    def __init__(self, workdir: Path, targets: dict[str, str], rules: dict[str, Any]) -> None:
        (workdir / "rules.yml").write_text(yaml.safe_dump(rules))
        config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                  "rule_files": [str(workdir / "rules.yml")],
                  # the labels a ServiceMonitor's scrape adds in a cluster; the operator's
                  # PodMonitor honours its metrics' own namespace label (the chart's)
                  "scrape_configs": [{"job_name": job, "honor_labels": job == "operator",
                                      "static_configs": [{"targets": [t], "labels": {
                                          "namespace": "kvasir", "pod": f"{job}-0"}}]}
                                     for job, t in targets.items()]}
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        port = free_port()
        self.url = f"http://127.0.0.1:{port}/api/v1"
        self.log = (workdir / "prometheus.log").open("w")
        self.process = subprocess.Popen(
            [str(PROMETHEUS), f"--config.file={workdir / 'prometheus.yml'}",
             f"--storage.tsdb.path={workdir / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}"],
            stdout=subprocess.DEVNULL, stderr=self.log)

    def api(self, path: str, **params: Any) -> Any:
        body = httpx.get(self.url + path, params=params, timeout=10).json()
        assert body["status"] == "success", (params, body)
        return body["data"]

    def up(self, num_targets: int) -> bool:
        with contextlib.suppress(httpx.HTTPError, ValueError, AssertionError, KeyError):
            return len([t for t in self.api("/targets")["activeTargets"]
                        if t["health"] == "up"]) == num_targets
        return False

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=30)
        self.log.close()


def alert_rules(helm: str, *sets: str) -> dict[str, Any]:
    """The chart's PrometheusRule groups, as a Prometheus rules file."""
    rule, = [d for d in template(helm, "metrics.prometheusRule.enabled=true", *sets)
             if d["kind"] == "PrometheusRule"]
    return {"groups": rule["spec"]["groups"]}


def test_promtool_unit_tests_of_the_alerts(helm: str, tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian's `prometheus` package; .ci/run installs it)")
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(alert_rules(helm, "gateway.enabled=true")))
    for case in PROMTOOL_TESTS.glob("*_test.yml"):
        shutil.copy(case, tmp_path)
        run = subprocess.run([promtool, "test", "rules", case.name], cwd=tmp_path,
                             capture_output=True, text=True, timeout=60)
        assert run.returncode == 0, run.stdout + run.stderr


def burst(engine_url: str, num_clients: int = 12, rounds: int = 3) -> None:
    """Straight at the engine, all at once: fills its queue (two running, four waiting) and the
    rest is refused with 429, again on each round while the queue is still full."""
    def client() -> None:
        body = {"model": "small", "prompt": REPEATING, "max_tokens": 200, "ignore_eos": True}
        for _ in range(rounds):
            httpx.post(engine_url + "/v1/completions", json=body, timeout=120,
                       headers={"authorization": "Bearer sk-direct"})
            time.sleep(0.3)

    clients = [threading.Thread(target=client) for _ in range(num_clients)]
    for thread in clients:
        thread.start()
    for thread in clients:
        thread.join(timeout=120)


def drive_load(engine_url: str, gateway_url: str) -> None:
    """Bounded: a few seconds of tenants through the gateway, a quota storm, a queue burst."""
    def tenant(key: str, rounds: int, pause: float) -> None:
        for i in range(rounds):  # the small pool, and the aliases cascading to the large one
            body = {"model": ("small", "easy", "small", "strict")[i % 4], "max_tokens": 24,
                    "prompt": REPEATING + f" {i % 3}", "temperature": 0,
                    "stream": i % 2 == 1, "ignore_eos": True}
            post(gateway_url, "/v1/completions", body, key=key, timeout=60)
            time.sleep(pause)

    # bob's storm spread over a few scrapes, so that its refusals rise under Prometheus's eyes
    work = [threading.Thread(target=tenant, args=(KEYS["alice"], 12, 0.0)) for _ in range(3)]
    work += [threading.Thread(target=tenant, args=(KEYS["bob"], 10, 0.4))]
    work += [threading.Thread(target=burst, args=(engine_url,))]
    for thread in work:
        thread.start()
        time.sleep(0.25)
    for thread in work:
        thread.join(timeout=120)


def pending(prometheus: Prometheus, alert: str, start: float) -> bool:
    return bool(prometheus.api(
        "/query_range", query=f'ALERTS{{alertname="{alert}", alertstate="pending"}}',
        start=start, end=time.time(), step=1)["result"])


def served(config: Any, name: str) -> Any:
    return dataclasses.replace(config, model=dataclasses.replace(config.model,
                                                                  served_model_name=name))


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, helm: str) -> Iterator[tuple[Prometheus,
                                                                                  float, float]]:
    if PROMETHEUS is None:
        pytest.skip("prometheus is not installed (Debian's `prometheus` package; .ci/run installs it)")
    model = write_checkpoint(tmp_path_factory.mktemp("tiny-dashboards"), "llama")
    base = tiny_config(model, prefix_caching=True, max_queue_len=4, max_num_seqs=2)
    small = dataclasses.replace(base, speculative=SpeculativeConfig(
        "ngram", 3, prompt_lookup_max=3, prompt_lookup_min=1))
    keys = tmp_path_factory.mktemp("keys") / "keys"
    keys.write_text("".join(f"{t}:{k}\n" for t, k in KEYS.items()))
    trust = {"trusted_gateway_keys": (f"gateway:{GATEWAY_KEY}",)}
    with contextlib.ExitStack() as stack:
        engine = stack.enter_context(live_server(served(small, "small"),
                                                 api_keys=("direct:sk-direct",), **trust))
        large = stack.enter_context(live_server(served(tiny_config(model), "large"),
                                                api_keys=(), **trust))
        gw = stack.enter_context(gateway(
            backends=(engine.base_url, large.base_url), api_key_file=str(keys),
            upstream_key=GATEWAY_KEY, routing_table=parse_routing(ROUTING),
            prefix_block_chars=32,  # the prompts' shared start routes by prefix
            tenant_limits={"bob": QuotaLimits(tokens_per_minute=120)}))
        operator_port = free_port()
        stack.enter_context(operator_reporting(operator_port))
        targets = {"engine": engine.base_url[7:], "large": large.base_url[7:],
                   "gateway": gw.url[7:], "operator": f"127.0.0.1:{operator_port}"}
        prometheus = Prometheus(tmp_path_factory.mktemp("prometheus"), targets,
                                # a waiting threshold of 0, so that the burst trips it
                                alert_rules(helm, "gateway.enabled=true",
                                            "metrics.prometheusRule.waitingRequestsThreshold=0",
                                            "metrics.prometheusRule.throttledRatioThreshold=0.1"))
        stack.callback(prometheus.stop)
        wait_until(lambda: prometheus.up(len(targets)), timeout=30,
                   what="prometheus scraping every target")
        start = time.time()
        drive_load(engine.base_url, gw.url)
        time.sleep(3)  # the last scrapes and rule evaluations
        for _ in range(4):  # on a busy machine a queue may fill and drain between two scrapes
            if pending(prometheus, "KvasirRequestsWaiting", start):
                break
            burst(engine.base_url)
            time.sleep(3)
        yield prometheus, start, time.time()


@contextlib.contextmanager
def operator_reporting(port: int) -> Iterator[Any]:
    """The operator's metrics (kvasir_operator.metrics) served on 127.0.0.1:`port` and fed, for
    as long as the stack runs, as the operator's handlers feed them: statuses the reconcile's
    `plan` derives for a served, a refused and an unapplied InferenceService, and the builtin
    autoscaler's decisions. (The handlers' own calls are tested in tests/operator.)"""
    from kvasir_operator.autoscale.decision import Reason
    from kvasir_operator.metrics import OperatorMetrics
    from kvasir_operator.reconcile import Children, plan
    from kvasir_operator.status import with_apply_failures

    metrics = OperatorMetrics()
    server = metrics.serve(port, "127.0.0.1")

    def body(name: str, spec: dict[str, Any]) -> dict[str, Any]:
        return {"metadata": {"name": name, "namespace": "team-a", "uid": name, "generation": 1},
                "spec": {"model": {"uri": "/models/m", "sizeBytes": 10**6}, **spec}}

    served = plan(body("chat", {"resources": {"gpus": 1}, "replicas": 2}), Children())
    refused = plan(body("bad", {"engine": {"quantization": "int8"},
                                "resources": {"gpus": 1}}), Children())
    unapplied = (("Service chat", 500, "etcd timed out"),)
    unapplied_status = with_apply_failures(served.status, unapplied, {}, 1)
    stop = threading.Event()

    def feed() -> None:
        reasons = [Reason.SCALE_UP, Reason.STABLE, Reason.STABLE, Reason.SCALE_DOWN_DELAYED]
        tick = 0
        while not stop.wait(0.3):
            metrics.observe_reconcile("team-a", "chat", served.status, (), None)
            metrics.observe_reconcile("team-a", "bad", refused.status, (),
                                      refused.spec_error)
            metrics.observe_reconcile("team-a", "chat", unapplied_status, unapplied, None)
            metrics.observe_api_error("team-a", "chat")
            metrics.observe_decision("team-a", "chat", reasons[tick % len(reasons)].value)
            tick += 1

    feeder = threading.Thread(target=feed, daemon=True)
    feeder.start()
    try:
        yield metrics
    finally:
        stop.set()
        feeder.join(timeout=10)
        server.shutdown()


def query(expr: str) -> str:
    for name, value in VARIABLES.items():
        expr = expr.replace(name, value)
    assert "$" not in expr, expr
    return expr


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.stem)
def test_every_panel_shows_data(stack: tuple[Prometheus, float, float], path: Path) -> None:
    prometheus, start, end = stack
    empty, seen = [], []
    for panel in panels(path):
        for target in panel["targets"]:
            result = prometheus.api("/query_range", query=query(target["expr"]), start=start,
                                    end=end, step=1)["result"]
            values = [float(v) for series in result for _, v in series["values"]]
            if not [v for v in values if v == v]:  # none, or NaN only
                empty.append(f"{panel['title']} [{target['legendFormat']}]")
            seen.append({"panel": panel["title"], "unit": panel["fieldConfig"]["defaults"]["unit"],
                         "legend": target["legendFormat"], "result": result})
    if DATA_DIR:  # bench/dashboards.py draws docs/observability.md's pictures from these
        Path(DATA_DIR).mkdir(parents=True, exist_ok=True)
        (Path(DATA_DIR) / f"{path.stem}.json").write_text(json.dumps(
            {"title": json.loads(path.read_text())["title"], "start": start, "targets": seen}))
    assert not empty, f"{path.name}: panels without data: {empty}"


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.stem)
def test_every_variable_has_values(stack: tuple[Prometheus, float, float], path: Path) -> None:
    """Grafana's `label_values(SERIES, LABEL)`: Prometheus's label values among those series."""
    prometheus, _, _ = stack
    for variable in json.loads(path.read_text())["templating"]["list"]:
        if variable["type"] != "query":
            continue
        series, label = re.fullmatch(r"label_values\((.*), (\w+)\)", variable["query"]["query"]).groups()
        values = prometheus.api(f"/label/{label}/values", **{"match[]": query(series)})
        assert values, f"{path.name}: variable {variable['name']} has no values"


def test_every_alert_evaluates_and_a_full_queue_goes_pending(
        stack: tuple[Prometheus, float, float]) -> None:
    prometheus, start, end = stack
    groups = prometheus.api("/rules", type="alert")["groups"]
    rules = [r for g in groups for r in g["rules"]]
    assert rules and all(r["health"] == "ok" for r in rules), rules
    for rule in rules:
        prometheus.api("/query", query=rule["query"], time=end)
    assert {r["name"] for r in rules} == {"KvasirRequestsWaiting", "KvasirKVCacheFull",
                                          "KvasirEngineStalled", "KvasirTenantThrottled"}
    for alert, cause in (("KvasirRequestsWaiting", "the queue bursts"),
                         ("KvasirTenantThrottled", "bob's quota storm")):
        assert pending(prometheus, alert, start), f"{cause} never made {alert} pending"
