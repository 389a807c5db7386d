"""A pre-quantized checkpoint served over HTTP: the compressed-tensors W4A16 (asymmetric) and
W8A8 checkpoints on the native tiles, the FP8 one dequantized, each through a live server
(tests/engine/server/harness.py) started from the flags a user would give (no --quantization),
with greedy completions equal to the offline engine's on the same checkpoint."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from ct_checkpoints import write_compressed_checkpoint
from harness import API_KEY, live_server
from kvasir_engine.args import add_engine_args, engine_config_from_args
from kvasir_engine.core.request import SamplingParams
from kvasir_engine.frontend.llm_engine import LLMEngine

pytest.importorskip("compressed_tensors")

PROMPT = [5, 17, 42, 99, 120, 7, 250, 33]


@pytest.mark.parametrize("scheme,runs_as", [("w4a16_asym", "int4"), ("w8a8", "int8"),
                                            ("fp8", None)])
def test_quantized_checkpoint_serves_completions(tmp_path: Path, scheme: str,
                                                 runs_as: str | None) -> None:
    directory = write_compressed_checkpoint(tmp_path / scheme, scheme, intermediate_size=128)
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    config = engine_config_from_args(parser.parse_args(
        [str(directory), "--device", "cpu", "--max-model-len", "128", "--block-size", "4",
         "--kv-cache-memory", str(4 << 20)]))
    assert config.model.quantization == runs_as
    offline = LLMEngine.from_config(config).generate(
        [PROMPT], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    with live_server(config) as server:
        body = server.post("/v1/completions", json={
            "model": config.model.served_model_name, "prompt": PROMPT, "max_tokens": 8,
            "temperature": 0.0, "ignore_eos": True}).json()
        version = server.get("/version", headers={"Authorization": f"Bearer {API_KEY}"}).json()
    assert body["usage"]["completion_tokens"] == 8, body
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["choices"][0]["text"] == offline[0].text
    if runs_as is not None and version["kernels"]["native_cpu_kernels"]:
        assert version["kernels"]["matmul"] == "native"


@pytest.mark.parametrize("scheme,flags,message", [
    ("w4a16", ["--quantization", "int8"],
     "--quantization int8 disagrees with the checkpoint's compressed-tensors W4A16 "
     "(pack-quantized, group 32, symmetric), which runs as int4; omit --quantization"),
    ("w4a16_g16", [], "compressed-tensors int4 group (pack-quantized): int4 needs groups of a "
                      "multiple of 32 weights or one scale per channel, got strategy group "
                      "group_size 16"),
])
def test_serve_refuses_at_start_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                              scheme: str, flags: list[str],
                                              message: str) -> None:
    from kvasir_engine.main import main

    directory = write_compressed_checkpoint(tmp_path / scheme, scheme, intermediate_size=128)
    capsys.readouterr()
    assert main(["serve", str(directory), "--device", "cpu", "--port", "0", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and message in err and "Traceback" not in err, err
