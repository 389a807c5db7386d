"""`--speculative-config`: vLLM's JSON, every mistake one line naming the key, before any load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import write_checkpoint
from kvasir_engine.args import DEFAULT_SPEC_DISABLE_BY_BATCH_SIZE
from kvasir_engine.main import main
from test_engine_args import _config


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("llama"), "llama")


def test_ngram_config_as_vllm_spells_it(model: Path) -> None:
    flag = json.dumps({"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 6,
                       "prompt_lookup_min": 3})
    spec = _config(model, "--speculative-config", flag).speculative
    assert spec is not None and spec.method == "ngram" and spec.num_speculative_tokens == 5
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == (3, 6)
    assert spec.disable_by_batch_size == DEFAULT_SPEC_DISABLE_BY_BATCH_SIZE["cpu"]
    assert _config(model).speculative is None


@pytest.mark.parametrize(("given", "message"), [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "must be a JSON object"),
    ('{"method": "ngram"}', "num_speculative_tokens is required"),
    ('{"method": "eagle", "num_speculative_tokens": 2}', "method must be one of"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}', "unknown key 'lookahead'"),
    ('{"method": "ngram", "num_speculative_tokens": "2"}', "num_speculative_tokens must be an int"),
    ('{"method": "ngram", "num_speculative_tokens": true}', "num_speculative_tokens must be an int"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must be in"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, '
     '"prompt_lookup_max": 2}', "prompt_lookup_min <= prompt_lookup_max"),
    ('{"num_speculative_tokens": 2}', 'give "method"'),
    ('{"model": "/nowhere/at/all", "num_speculative_tokens": 2}', "model path does not exist"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "min_acceptance_rate": 2}',
     "min_acceptance_rate must be in"),
])
def test_bad_configs_fail_at_start_with_one_line(model: Path, given: str, message: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["generate", str(model), "--device", "cpu", "--speculative-config", given,
                 "--prompt", "hi"])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1 and "--speculative-config" in err and message in err, err


def test_speculation_with_pipeline_stages_is_refused_at_start(
        model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["generate", str(model), "--device", "cpu", "--pipeline-parallel-size", "2",
                 "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}',
                 "--prompt", "hi"])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1 and "--pipeline-parallel-size 2" in err, err
