"""Flags and key files: what cannot work is refused at start with one line naming the flag."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from kvasir_gateway.config import QuotaLimits, config_from_args, parse_quota
from kvasir_gateway.tenants import KeyFile, KeyRing, parse_key_file


def test_flags_parse_into_one_config(tmp_path: Path) -> None:
    upstream = tmp_path / "gw.key"
    upstream.write_text("secret\n")
    config = config_from_args([
        "--backend", "http://a:8000", "--backend", "http://b:8000", "--tokens-per-minute", "100",
        "--quota", "team-a=tpm:5,concurrent:2", "--upstream-key-file", str(upstream),
        "--redis-failure", "closed", "--routing", "round_robin", "--prefix-miss-weight", "1.5",
        "--load-tokens-per-request", "32", "--disaggregation", "never",
        "--disaggregation-min-prompt-tokens", "0", "--disaggregation-prefill-timeout", "2.5"])
    assert config.backends == ("http://a:8000", "http://b:8000")
    assert config.limits_for("team-a") == QuotaLimits(5, 0, 2)
    assert config.limits_for("other") == QuotaLimits(100, 0, 0)
    assert config.upstream_key == "secret" and not config.redis_fail_open
    assert config.routing == "round_robin"
    assert (config.prefix_miss_weight, config.load_tokens_per_request) == (1.5, 32.0)
    assert (config.disaggregation, config.disaggregation_min_prompt_tokens,
            config.disaggregation_prefill_timeout_seconds) == ("never", 0, 2.5)
    defaults = config_from_args([])
    assert defaults.load_bound == 0.6
    assert (defaults.disaggregation, defaults.disaggregation_min_prompt_tokens) == ("auto", 128)


@pytest.mark.parametrize("argv, message", [
    (["--backend", "a:8000"], "--backend 'a:8000' must start with http"),
    (["--quota", "team-a"], "--quota 'team-a': expected TENANT="),
    (["--quota", "team-a=tpm:x"], "tpm needs an integer"),
    (["--quota", "team-a=burst:5"], "is not one of tpm:N"),
    (["--quota", "bad name=tpm:5"], "--quota tenant 'bad name'"),
    (["--tokens-per-minute", "-1"], "tokens_per_minute must be >= 0"),
    (["--load-bound", "0"], "--load-bound must be > 0"),
    (["--prefix-miss-weight", "-1"], "--prefix-miss-weight must be >= 0, got -1.0"),
    (["--load-tokens-per-request", "-0.5"], "--load-tokens-per-request must be >= 0, got -0.5"),
    (["--prefix-hash-timeout", "0"], "--prefix-hash-timeout must be > 0"),
    (["--prefix-pending-seconds", "-1"], "--prefix-pending-seconds must be >= 0"),
    (["--endpoint-slices", "svc"], "expected NAMESPACE/SERVICE"),
    (["--disaggregation-min-prompt-tokens", "-1"],
     "--disaggregation-min-prompt-tokens must be >= 0, got -1"),
    (["--disaggregation-prefill-timeout", "0"], "--disaggregation-prefill-timeout must be > 0"),
])
def test_bad_flags_name_themselves(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        config_from_args(argv)
    assert parse_quota("t=rpm:3")[1].requests_per_minute == 3


def test_the_command_exits_2_with_one_line() -> None:
    out = subprocess.run([sys.executable, "-m", "kvasir_gateway.main", "--quota", "x"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "kvasir-gateway: error: --quota 'x': expected TENANT=tpm:N,rpm:N,concurrent:N"]


def test_key_file_format_and_errors(tmp_path: Path) -> None:
    ring = KeyRing(parse_key_file("# c\nalice:sk-1\n\n  sk-bare  \nbob: sk-2 \n", "keys"))
    assert ring.tenant_for("sk-1") == "alice" and ring.tenant_for("sk-2") == "bob"
    assert (ring.tenant_for("sk-bare") or "").startswith("key-")
    assert ring.tenant_for("sk-3") is None and ring.tenant_for("") is None
    for text, message in [(":k", "keys:1: empty tenant"), ("a:", "keys:1: empty key"),
                          ("a b:k", "keys:1: tenant name 'a b'"),
                          ("a:k\nb:k", "keys:2: duplicate key")]:
        with pytest.raises(ValueError, match=message):
            parse_key_file(text, "keys")
    missing = tmp_path / "nope"
    with pytest.raises(ValueError, match="--api-key-file"):
        KeyFile(str(missing))
    assert "sk-1" not in repr(ring.__dict__)  # digests only


def test_idle_upstream_connections_are_dropped_before_the_engine_closes_them() -> None:
    # An idle pooled connection that the engine's uvicorn is closing just as the gateway
    # reuses it comes back as "connection reset" and ejected a healthy replica (bench/gateway.py).
    import uvicorn
    from kvasir_gateway.client import UPSTREAM_KEEPALIVE_SECONDS

    assert 0 < UPSTREAM_KEEPALIVE_SECONDS < uvicorn.Config(app=None).timeout_keep_alive


def test_sigterm_stops_the_gateway_with_exit_0() -> None:
    """The kubelet's SIGTERM is the normal stop: the process exits 0, not by the signal (143)."""
    import signal
    import socket
    import time
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    process = subprocess.Popen([sys.executable, "-m", "kvasir_gateway.main", "--host",
                                "127.0.0.1", "--port", str(port), "--backend",
                                "http://127.0.0.1:9"], stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1):
                    break
            except OSError:
                assert time.monotonic() < deadline and process.poll() is None
                time.sleep(0.1)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
    finally:
        process.kill()

