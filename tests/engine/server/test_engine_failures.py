"""Failures inside the engine, seen over HTTP (issue 39's isolation).

A request whose own data breaks a step gets a 500 naming it while the requests beside it stream
to the end; an error that is the engine's own (the forward pass itself fails) ends every open
request with 503 and tells the process owner, which exits so the pod restarts
(launch.py; the exit itself is covered with a real process by test_rank_death.py).
"""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
from harness import live_server, tiny_config

POISON_TOKEN = 7


def test_a_poisoned_request_gets_500_and_its_neighbours_finish(tiny_model: Path) -> None:
    """Fault injection in the runner's batch preparation: any batch holding a request whose
    prompt contains POISON_TOKEN fails, as top_k = 2**63 once made it fail."""
    fatal: list[str] = []
    with live_server(tiny_config(tiny_model), on_fatal=fatal.append) as server:
        runner = server.state.async_engine.engine_thread.engine.core.executor.runner  # type: ignore[attr-defined]
        real_prepare = runner._prepare  # noqa: SLF001

        def prepare(so):  # type: ignore[no-untyped-def]
            if any(POISON_TOKEN in runner.states[r].token_ids for r in so.num_scheduled_tokens):
                raise ValueError("Overflow when unpacking long long")
            return real_prepare(so)

        runner._prepare = prepare  # noqa: SLF001
        results: list[httpx.Response] = []

        def send(body: dict[str, object]) -> None:
            results.append(server.post("/v1/completions", json=body))

        good = {"prompt": [5, 6, 8, 9], "max_tokens": 40, "ignore_eos": True, "temperature": 0}
        bad = {"prompt": [POISON_TOKEN, 8, 9], "max_tokens": 4, "stream": True}
        threads = [threading.Thread(target=send, args=(good,)) for _ in range(3)]
        threads.append(threading.Thread(target=send, args=(bad,)))
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        bad_resp = server.post("/v1/completions", json={**bad, "stream": False})
        assert bad_resp.status_code == 500, bad_resp.text
        assert bad_resp.json()["error"]["code"] == "request_failed"
        assert "cmpl-" in bad_resp.json()["error"]["message"]
        streamed = [r for r in results if "text/event-stream" in r.headers["content-type"]]
        assert len(streamed) == 1 and '"code": "request_failed"' in streamed[0].text
        for r in results:
            if r not in streamed:
                assert r.status_code == 200, r.text
                assert r.json()["usage"]["completion_tokens"] == 40
        assert server.get("/health").status_code == 200
        assert fatal == []


def test_an_engine_failure_ends_requests_and_tells_the_owner(tiny_model: Path) -> None:
    fatal: list[str] = []
    with live_server(tiny_config(tiny_model), on_fatal=fatal.append) as server:
        runner = server.state.async_engine.engine_thread.engine.core.executor.runner  # type: ignore[attr-defined]

        def broken(*_: object, **__: object) -> None:
            raise RuntimeError("device lost")

        runner._start_forward = broken  # noqa: SLF001
        r = server.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 4})
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "engine_dead"
        assert len(fatal) == 1 and "device lost" in fatal[0]
        assert server.get("/health").status_code == 503
