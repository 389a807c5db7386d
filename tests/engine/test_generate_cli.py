"""`kvasir-engine generate`, the offline entry point: output shape and clear errors on bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import write_checkpoint, write_corrupt_safetensors
from kvasir_engine.main import main


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("tiny"), "llama", seed=3)


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["generate", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_json_output_for_plain_chat_and_file_prompts(tiny: Path, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text(json.dumps({"messages": [{"role": "user", "content": "Hello"}]})
                            + "\n\n" + json.dumps({"prompt": "The quick brown fox"}) + "\n")
    code, out, err = run(capsys, str(tiny), "--device", "cpu", "--dtype", "float32",
                         "--prompt", "Paged attention", "--prompts-file", str(prompts_file),
                         "--max-tokens", "5", "--ignore-eos", "--output", "json")
    assert code == 0, err
    results = json.loads(out)
    assert len(results) == 3
    for result in results:
        assert len(result["token_ids"]) == 5
        assert result["finish_reason"] == "length"
        assert isinstance(result["text"], str)
    assert results[1]["messages"] == [{"role": "user", "content": "Hello"}]


@pytest.mark.parametrize(("argv", "message"), [
    (["--prompt", ""], "prompt 0: is empty"),
    (["--prompt", "hi", "--max-tokens", "0"], "max_tokens: must be in [1, 2147483647]"),
    (["--prompt", "hi", "--top-p", "1.5"], "top_p: must be in (0, 1]"),
    (["--prompt", "hi", "--top-p", "0"], "top_p: must be in (0, 1]"),
    (["--prompt", "hi", "--temperature", "-1"], "temperature: must be >= 0"),
    (["--prompt", "word " * 300, "--max-tokens", "4"], "exceed --max-model-len 256"),
    (["--prompt", "hi", "--max-model-len", "100000"], "exceeds the model's max_position_embeddings"),
    ([], "give at least one --prompt"),
])
def test_bad_input_is_one_clear_error(tiny: Path, capsys: pytest.CaptureFixture[str],
                                      argv: list[str], message: str) -> None:
    code, _, err = run(capsys, str(tiny), "--device", "cpu", *argv)
    assert code == 2
    assert message in err
    assert "Traceback" not in err


def test_bad_prompts_file_names_the_line(tiny: Path, tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    prompts_file = tmp_path / "bad.jsonl"
    prompts_file.write_text('{"prompt": "ok"}\n{"text": "no prompt field"}\n')
    code, _, err = run(capsys, str(tiny), "--prompts-file", str(prompts_file))
    assert code == 2
    assert f"{prompts_file}:2: needs a 'prompt' or 'messages' field" in err


def test_unknown_model_path(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, _, err = run(capsys, str(tmp_path / "missing"), "--prompt", "hi")
    assert code == 2
    assert "model path does not exist" in err


def test_corrupt_safetensors_names_the_file(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    weights = write_corrupt_safetensors(tmp_path)
    code, _, err = run(capsys, str(tmp_path), "--device", "cpu", "--prompt", "hi")
    assert code == 2
    assert weights.name in err


def test_corrupt_gguf_names_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\x00" * 20)
    code, _, err = run(capsys, str(bad), "--prompt", "hi")
    assert code == 2
    assert "broken.gguf" in err
