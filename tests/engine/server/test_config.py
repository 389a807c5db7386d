"""Server flags: defaults, KVASIR_ environment fallbacks, key sources, one-line validation."""

from __future__ import annotations

from pathlib import Path

import pytest
from kvasir_engine.main import build_parser
from kvasir_engine.server.config import ServerConfig, server_config_from_args
from kvasir_engine.server.tenants import KeyRing, digest, parse_key_entry


def _config(argv: list[str]) -> ServerConfig:
    return server_config_from_args(build_parser().parse_args(["serve", *argv]))


def test_defaults_and_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVASIR_API_KEYS", raising=False)
    assert _config([]) == ServerConfig()
    c = _config(["--host", "127.0.0.1", "--port", "9000", "--max-n", "3", "--log-requests",
                 "--shutdown-grace-seconds", "2.5", "--no-warmup"])
    assert (c.host, c.port, c.max_n, c.log_requests, c.shutdown_grace_seconds, c.warmup) == (
        "127.0.0.1", 9000, 3, True, 2.5, False)


def test_every_server_flag_reads_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {"HOST": "::1", "PORT": "8123", "MAX_BODY_BYTES": "4096", "MAX_N": "2",
                        "LOG_REQUESTS": "true", "SHUTDOWN_GRACE_SECONDS": "7",
                        "READY_TIMEOUT_SECONDS": "3", "HEALTH_STALL_SECONDS": "9",
                        "NO_WARMUP": "1"}.items():
        monkeypatch.setenv(f"KVASIR_{name}", value)
    c = _config([])
    assert (c.host, c.port, c.max_body_bytes, c.max_n, c.log_requests) == (
        "::1", 8123, 4096, 2, True)
    assert (c.shutdown_grace_seconds, c.ready_timeout_seconds, c.health_stall_seconds) == (
        7.0, 3.0, 9.0)
    assert c.warmup is False
    assert _config(["--port", "9999"]).port == 9999  # the flag wins over the environment


def test_api_keys_from_flags_file_and_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    keys_file = tmp_path / "keys"
    keys_file.write_text("# team keys\nfile-key\n\n  spaced-key  \nteam-a:sk-a\n")
    monkeypatch.setenv("KVASIR_API_KEYS", "env-a, env-b,,")
    c = _config(["--api-key", "flag-a", "--api-key", "flag-b", "--api-key-file", str(keys_file)])
    keys = ("flag-a", "flag-b", "env-a", "env-b", "file-key", "spaced-key", "sk-a")
    # Only digests are kept; a bare key is its own tenant, named after its digest.
    assert [k.key_digest for k in c.api_keys] == [digest(k) for k in keys]
    # Named by a keyed hash, never the key's plain sha256 (a weak key is reversed offline).
    label = c.api_keys[0].tenant_id
    assert label.startswith("key-") and len(label) == 16
    assert label != f"key-{digest('flag-a').hex()[:12]}"
    again = _config(["--api-key", "flag-a", "--tenant-label-secret", "s3cret"])
    same = _config(["--api-key", "flag-a", "--tenant-label-secret", "s3cret"])
    assert again.api_keys[0].tenant_id == same.api_keys[0].tenant_id != label
    assert c.api_keys[-1].tenant_id == "team-a"
    assert "flag-a" not in repr(c)
    with pytest.raises(ValueError, match="--api-key-file"):
        _config(["--api-key-file", str(tmp_path / "missing")])


def test_bad_values_name_the_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="--port"):
        _config(["--port", "70000"])
    with pytest.raises(ValueError, match="--shutdown-grace-seconds"):
        _config(["--shutdown-grace-seconds", "0"])
    monkeypatch.setenv("KVASIR_MAX_N", "many")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve"])


def test_key_check_matches_exactly() -> None:
    ring = KeyRing([parse_key_entry("a:alpha", "x", b""), parse_key_entry("b:beta", "x", b"")])
    assert ring.tenant_for("beta") == "b" and ring.tenant_for("bet") is None
    assert ring.tenant_for("") is None and ring.tenant_for("alphaX") is None
