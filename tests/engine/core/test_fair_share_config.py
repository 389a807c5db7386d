"""The fair-share flags: --scheduling-policy, --tenant-weight, --max-running-seqs-per-tenant,
--max-prefill-tokens-over-share."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from helpers import write_checkpoint
from kvasir_engine.args import (
    DEFAULT_CPU_PREFILL_TOKENS_OVER_SHARE,
    add_engine_args,
    apply_env_defaults,
    engine_config_from_args,
)
from kvasir_engine.config import SchedulerConfig


def _scheduler_config(model: Path, *flags: str,
                      environ: dict[str, str] | None = None) -> SchedulerConfig:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    apply_env_defaults(parser, environ or {})
    ns = parser.parse_args([str(model), "--device", "cpu", *flags])
    return engine_config_from_args(ns).scheduler


def test_defaults_are_fair_with_no_weights_and_no_bound(tmp_path: Path) -> None:
    config = _scheduler_config(write_checkpoint(tmp_path / "m", "llama"))
    assert (config.policy, config.tenant_weights, config.max_running_seqs_per_tenant) == \
        ("fair", (), None)
    assert config.max_prefill_tokens_over_share == DEFAULT_CPU_PREFILL_TOKENS_OVER_SHARE == 64


def test_flags_reach_the_scheduler_config(tmp_path: Path) -> None:
    config = _scheduler_config(
        write_checkpoint(tmp_path / "m", "llama"), "--scheduling-policy", "fcfs",
        "--tenant-weight", "team-a=2", "--tenant-weight", "b=0.5",
        "--max-running-seqs-per-tenant", "3", "--max-prefill-tokens-over-share", "0")
    assert config.policy == "fcfs"
    assert config.max_prefill_tokens_over_share == 0
    assert config.tenant_weights == (("team-a", 2.0), ("b", 0.5))
    assert config.max_running_seqs_per_tenant == 3


def test_tenant_weights_from_the_environment(tmp_path: Path) -> None:
    config = _scheduler_config(write_checkpoint(tmp_path / "m", "llama"),
                               environ={"KVASIR_TENANT_WEIGHT": "a=3,b=1"})
    assert config.tenant_weights == (("a", 3.0), ("b", 1.0))


@pytest.mark.parametrize("flag", ["a", "=2", "a=", "a=x", "a=nan"])
def test_malformed_tenant_weight_names_the_flag(tmp_path: Path, flag: str) -> None:
    with pytest.raises(ValueError, match="--tenant-weight must look like TENANT=WEIGHT"):
        _scheduler_config(write_checkpoint(tmp_path / "m", "llama"), "--tenant-weight", flag)


@pytest.mark.parametrize(("kwargs", "flag"), [
    ({"policy": "priority"}, "--scheduling-policy"),
    ({"tenant_weights": (("a", 0.0),)}, "--tenant-weight a"),
    ({"tenant_weights": (("a", -1.0),)}, "--tenant-weight a"),
    ({"tenant_weights": (("a", float("inf")),)}, "--tenant-weight a"),
    ({"tenant_weights": (("a", 1.0), ("a", 2.0))}, "--tenant-weight: a tenant is given twice"),
    ({"tenant_weights": (("", 1.0),)}, "--tenant-weight: the tenant name"),
    ({"max_running_seqs_per_tenant": 0}, "--max-running-seqs-per-tenant"),
    ({"max_prefill_tokens_over_share": -1}, "--max-prefill-tokens-over-share"),
])
def test_bad_values_raise_value_error_naming_the_flag(kwargs: dict[str, object],
                                                      flag: str) -> None:
    with pytest.raises(ValueError, match=flag):
        SchedulerConfig(max_model_len=64, **kwargs)  # type: ignore[arg-type]
