"""The router's view of this engine's prefix cache: what it holds, and what a prompt would hash to.

Two routes for the gateway's precise prefix routing (docs/gateway.md, "Precise prefix routing"):

- `GET /kvasir/prefix-cache?instance=ID&since=SEQ`: the block hashes the prefix cache holds, as
  changes since the caller's last answer or the whole set (frontend/prefix_cache_view.py);
- `POST /kvasir/prefix-hashes/completions` and `.../chat/completions`: the body of the
  generation request itself, answered with the short hashes of its prompt's leading full blocks,
  tokenized, templated and salted exactly as the generation route would (the tenant the gateway
  names, its shared group, the request's `cache_salt`), so the router needs no tokenizer and
  no copy of the salt rules. `max_blocks` (1-1024, default 64) bounds the answer.

Both answer only the trusted gateway when keys are configured (403 otherwise): held hashes would
let a tenant test whether another tenant's guessed prompt is cached. With no keys at all (one
anonymous tenant) they are open like every other route. 404 when prefix caching is off.
"""

from __future__ import annotations

from typing import Any

from fastapi import Request

from kvasir_engine.frontend.prefix_cache_view import PrefixCacheView, prefix_block_hashes
from kvasir_engine.server.auth import is_gateway, tenant_of
from kvasir_engine.server.chat import encode_messages
from kvasir_engine.server.completions import tokenize_prompts
from kvasir_engine.server.errors import APIError, bad_request
from kvasir_engine.server.generation import check_model
from kvasir_engine.server.protocol import ChatCompletionRequest, CompletionRequest
from kvasir_engine.server.state import ServerState
from kvasir_engine.server.tenants import cache_salt_for

MAX_BLOCKS_LIMIT = 1024


def _view(state: ServerState, request: Request) -> PrefixCacheView:
    config = state.server_config
    if (config.api_keys or config.trusted_gateway_keys) and not is_gateway(request):
        raise APIError(403, "the prefix-cache routes answer only the trusted gateway's key "
                            "(--trusted-gateway-key-file)", code="gateway_only")
    if state.prefix_cache_view is None:
        raise APIError(404, "prefix caching is off (--no-enable-prefix-caching)",
                       code="prefix_caching_disabled")
    return state.prefix_cache_view


def _int_param(request: Request, name: str, default: int | None, low: int,
               high: int | None = None) -> int | None:
    text = request.query_params.get(name)
    if text is None or text == "":
        return default
    try:
        value = int(text)
    except ValueError:
        raise bad_request(f"{name} must be an integer, got {text!r}", name) from None
    if value < low or (high is not None and value > high):
        raise bad_request(f"{name} must be in [{low}, {high if high is not None else 'inf'}], "
                          f"got {value}", name)
    return value


def held_blocks(state: ServerState, request: Request) -> dict[str, Any]:
    view = _view(state, request)
    since = _int_param(request, "since", None, 0)
    return view.since(request.query_params.get("instance"), since)


def prompt_block_hashes(state: ServerState, request: Request,
                        req: CompletionRequest | ChatCompletionRequest) -> dict[str, Any]:
    view = _view(state, request)
    max_blocks = _int_param(request, "max_blocks", 64, 1, MAX_BLOCKS_LIMIT) or 64
    check_model(state, req.model)
    if isinstance(req, ChatCompletionRequest):
        token_ids = encode_messages(state, req.messages, req.add_generation_prompt)
    else:
        token_ids = tokenize_prompts(state, req)[0]  # a batch is routed by its first prompt
    salt = cache_salt_for(tenant_of(request), state.server_config.prefix_cache_shared_tenants,
                          req.cache_salt)
    hashes = prefix_block_hashes(token_ids, view.block_size, salt, max_blocks)
    return {"instance": view.instance_id, "block_size": view.block_size,
            "num_tokens": len(token_ids), "block_hashes": hashes}
