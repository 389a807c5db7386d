"""`kv_transfer_params` is checked strictly before anything runs: a 400 naming the field for a
transfer this engine's role cannot do, a shape the protocol does not have, or a request a
transfer cannot serve."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from disagg_pair import API_KEY, consumer_config, consumer_server
from harness import LiveServer
from helpers import write_checkpoint
from processes import free_port

REMOTE = {"do_remote_prefill": True, "remote_engine_id": "p", "remote_host": "127.0.0.1",
          "remote_port": 9, "remote_request_id": "cmpl-x"}


@pytest.fixture(scope="module")
def consumer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    model = write_checkpoint(tmp_path_factory.mktemp("tiny-llama"), "llama")
    with consumer_server(consumer_config(model)) as live:
        yield live


@pytest.mark.parametrize(("extra", "param", "message"), [
    ({"kv_transfer_params": {"do_remote_decode": True}}, "kv_transfer_params.do_remote_decode",
     "not a KV producer"),
    ({"kv_transfer_params": {"do_remote_prefill": True, "remote_host": "127.0.0.1"}},
     "kv_transfer_params.remote_engine_id", "required with do_remote_prefill"),
    ({"kv_transfer_params": {**REMOTE, "remote_port": 70000}},
     "kv_transfer_params.remote_port", "less than or equal to 65535"),
    ({"kv_transfer_params": {**REMOTE, "remote_port": "9"}},
     "kv_transfer_params.remote_port", "integer"),
    ({"kv_transfer_params": {**REMOTE, "remote_port": 65535, "tp_size": 2}},
     "kv_transfer_params.tp_size", "rank r serves on remote_port + r"),
    ({"kv_transfer_params": {**REMOTE, "do_remote_decode": True}},
     "kv_transfer_params.do_remote_prefill", "excludes do_remote_decode"),
    ({"kv_transfer_params": {**REMOTE, "remote_block_ids": [-1]}},
     "kv_transfer_params.remote_block_ids.0", "greater than or equal to 0"),
    ({"kv_transfer_params": {**REMOTE, "remote_cache": "x"}},
     "kv_transfer_params.remote_cache", "Extra inputs"),
    ({"kv_transfer_params": REMOTE, "n": 2}, "kv_transfer_params", "n = 1"),
    ({"kv_transfer_params": REMOTE, "prompt": [[5, 6], [7, 8]]}, "kv_transfer_params",
     "one prompt"),
    ({"kv_transfer_params": REMOTE, "prompt_logprobs": 1}, "kv_transfer_params",
     "prompt logprobs"),
])
def test_a_transfer_that_cannot_be_done_is_a_400_naming_the_field(
        consumer: LiveServer, extra: dict[str, Any], param: str, message: str) -> None:
    body = {"prompt": [5, 6, 7, 8, 9], "max_tokens": 2, **extra}
    resp = consumer.post("/v1/completions", api_key=API_KEY, json=body)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and message in error["message"], error


def test_params_with_no_transfer_asked_change_nothing(consumer: LiveServer) -> None:
    body = {"prompt": [5, 6, 7, 8, 9], "max_tokens": 3, "temperature": 0}
    plain = consumer.post("/v1/completions", api_key=API_KEY, json=body).json()
    with_params = consumer.post("/v1/completions", api_key=API_KEY, json={
        **body, "kv_transfer_params": {"do_remote_decode": False, "remote_host": None}}).json()
    assert with_params["choices"][0]["text"] == plain["choices"][0]["text"]
    assert "kv_transfer_params" not in with_params and "kv_transfer_params" not in plain


def test_a_producers_answer_is_not_streamed(tmp_path: Path) -> None:
    model = write_checkpoint(tmp_path / "tiny-llama", "llama")
    config = consumer_config(model)
    assert config.kv_transfer is not None
    config = dataclasses.replace(config, kv_transfer=dataclasses.replace(
        config.kv_transfer, kv_role="kv_both", kv_port=free_port()))
    with consumer_server(config) as both:
        resp = both.post("/v1/completions", api_key=API_KEY, json={
            "prompt": [5, 6, 7], "stream": True, "kv_transfer_params": {"do_remote_decode": True}})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "stream", resp.text
