"""The HTTP side of disaggregated prefill and decode (docs/disaggregation.md), as vLLM's
disaggregation proxy drives it: the same request is sent twice.

1. To a producer, with `kv_transfer_params: {"do_remote_decode": true}`: it runs the prompt
   and samples one token (`max_tokens` is 1, whatever was asked), keeps the prompt's blocks for
   the consumer, and answers with `kv_transfer_params` saying where they are.
2. To a consumer, with those params and `do_remote_prefill: true`: before the request is
   admitted the blocks it lacks are fetched (kv_transfer/connector.py) and staged; it then
   decodes as if it had run the prefill. A fetch that fails in any way leaves the request to
   prefill here, counted by reason: the answer is the same, only later.

Checked before anything runs: the role is this engine's, one prompt, one choice, no prompt
logprobs (they need the prompt computed here), and a producer's answer is not streamed (it
carries the params).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from kvasir_engine.frontend.engine_types import RequestSpec
from kvasir_engine.kv.hashing import hash_full_blocks
from kvasir_engine.kv_transfer.connector import RemotePrefill
from kvasir_engine.server.errors import bad_request
from kvasir_engine.server.protocol import KVTransferParams
from kvasir_engine.server.state import ServerState

PARAM = "kv_transfer_params"


def check_request(state: ServerState, params: KVTransferParams | None, num_prompts: int,
                  n: int, is_stream: bool, wants_prompt_logprobs: bool) -> None:
    """400 naming the field for a transfer this engine or this request cannot do."""
    if params is None or not (params.do_remote_decode or params.do_remote_prefill):
        return
    transfer = state.engine_config.kv_transfer
    if params.do_remote_decode and (transfer is None or not transfer.is_producer):
        raise bad_request("kv_transfer_params.do_remote_decode: this engine is not a KV "
                          "producer (--kv-transfer-config kv_role)", f"{PARAM}.do_remote_decode")
    if params.do_remote_prefill and (transfer is None or not transfer.is_consumer):
        raise bad_request("kv_transfer_params.do_remote_prefill: this engine is not a KV "
                          "consumer (--kv-transfer-config kv_role)",
                          f"{PARAM}.do_remote_prefill")
    if num_prompts != 1 or n != 1:
        raise bad_request("kv_transfer_params: a KV transfer takes one prompt and n = 1", PARAM)
    if wants_prompt_logprobs:
        raise bad_request("kv_transfer_params: prompt logprobs need the prompt computed here; "
                          "leave them out of a disaggregated request", PARAM)
    if params.do_remote_decode and is_stream:
        raise bad_request("kv_transfer_params.do_remote_decode: needs stream false (the "
                          "answer carries the transfer's kv_transfer_params)", "stream")


def is_prefill_only(params: KVTransferParams | None) -> bool:
    return params is not None and params.do_remote_decode


async def receive_blocks(state: ServerState, params: KVTransferParams | None,
                         specs: Sequence[RequestSpec]) -> list[RequestSpec]:
    """A producer's request marked to keep its blocks; a consumer's with its prompt's K/V
    fetched and staged (or as it was, to prefill here, when the fetch failed)."""
    if params is None or not (params.do_remote_decode or params.do_remote_prefill):
        return list(specs)
    if params.do_remote_decode:
        return [dataclasses.replace(spec, do_remote_decode=True) for spec in specs]
    connector = state.kv_connector
    assert connector is not None and params.remote_host is not None
    assert params.remote_port is not None and params.remote_engine_id is not None
    assert params.remote_request_id is not None
    remote = RemotePrefill(params.remote_engine_id, params.remote_host, params.remote_port,
                           params.remote_request_id, params.tp_size or 1)
    received = []
    for spec in specs:
        load = await connector.receive(remote, spec.prompt_token_ids, spec.cache_salt,
                                       _num_held_blocks(state, spec))
        received.append(dataclasses.replace(spec, kv_load=load))
    return received


def _num_held_blocks(state: ServerState, spec: RequestSpec) -> int:
    """The prompt's leading blocks this engine's prefix cache holds: those are not fetched."""
    view = state.prefix_cache_view
    if view is None:
        return 0
    block_size = state.engine_config.cache.block_size
    num_full = (len(spec.prompt_token_ids) - 1) // block_size
    return view.num_leading_held(hash_full_blocks(spec.prompt_token_ids[:num_full * block_size],
                                                  block_size, None, spec.cache_salt))


def discard_staged(state: ServerState, specs: Sequence[RequestSpec]) -> None:
    """Staged blocks a request never took (it ended, or was refused, before its admission)."""
    if state.kv_connector is not None:
        for spec in specs:
            if spec.kv_load is not None:
                state.kv_connector.discard(spec.kv_load.staging_id)


def with_transfer_params(body: dict[str, Any], params: dict[str, Any] | None) -> dict[str, Any]:
    """A producer's answer carries `kv_transfer_params` (vLLM's field); others are unchanged."""
    if params is not None:
        body["kv_transfer_params"] = params
    return body
