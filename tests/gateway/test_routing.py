"""Routing decisions: prefix affinity, the work score (pending prefill, misses, load), the
bounded-load rule, load from the replicas' metrics, ejection; as pure decisions and through the
gateway in front of fake engines."""

from __future__ import annotations

import json
import threading

import httpx
from gateway_support import FakeEngine, fake_engines, gateway, post, wait_until
from kvasir_gateway.replicas import Replica, parse_load
from kvasir_gateway.router import (
    Costs,
    PrefixIndex,
    PromptBlocks,
    block_hashes,
    pick,
    pick_least_load,
    pick_round_robin,
    prompt_text,
)

SYSTEM = {tenant: f"You are the assistant of {tenant}. " + "Policy text. " * 80
          for tenant in ("alice", "bob", "carol", "dave", "erin", "frank")}


def hashes(text: str, tenant: str = "t") -> list[bytes]:
    return block_hashes(text, f"{tenant}\x00m", 64, 32)


def blocks(text: str) -> PromptBlocks:
    """The prompt as the approximate router sees it: 64-char blocks of 16 tokens."""
    return PromptBlocks(hashes(text), len(text) / 4, 16)


def test_block_hashes_are_chained_salted_and_full_blocks_only() -> None:
    a = hashes("x" * 64 * 3 + "tail")
    assert len(a) == 3
    assert hashes("x" * 64 * 2 + "y" * 64)[:2] == a[:2]  # same leading blocks, same hashes
    assert hashes("y" + "x" * 64 * 3)[0] != a[0]
    assert hashes("x" * 64 * 3, tenant="other") != a[:3]  # per tenant, as the engine's cache
    assert hashes("short") == []
    assert len(hashes("x" * 64 * 100)) == 32


def test_prompt_text_of_chat_and_completion_bodies() -> None:
    chat = {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]}
    assert prompt_text(chat, 100) == "<system>S<user>U"
    assert prompt_text({"prompt": ["first", "second"]}, 100) == "first"
    assert prompt_text({"prompt": "p"}, 100) == "p"
    # Only the head is built, whatever the body's size; it reads as the whole text's head.
    assert prompt_text(chat, 5) == "<syst"
    ids = list(range(100_000))
    assert prompt_text({"prompt": ids}, 16) == json.dumps(ids)[:16]
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}] * 10**5}]}
    assert prompt_text(parts, 40) == "<user>" + json.dumps(parts["messages"][0]["content"])[:34]


def test_prefix_affinity_wins_within_the_bound() -> None:
    replicas = [Replica(f"http://r{i}", is_ready=True) for i in range(3)]
    index = PrefixIndex(1000)
    text = "z" * 64 * 4
    first = pick(replicas, blocks(text), index, 0.25)
    assert first is not None and first.reason == "new" and first.uncached_tokens == 64
    index.record(hashes(text), first.replica.url)
    again = blocks(text + "w" * 64 * 2)
    assert again.hashes[:4] == hashes(text)
    choice = pick(replicas, again, index, 0.25)
    assert choice is not None and choice.replica is first.replica and choice.reason == "prefix"
    assert choice.hit_fraction == 4 / len(again.hashes)
    assert choice.uncached_tokens == 32  # the two blocks it does not hold, 16 tokens each


def test_a_new_prompt_goes_where_the_least_work_waits() -> None:
    replicas = [Replica(f"http://r{i}", is_ready=True) for i in range(3)]
    prompt = blocks("n" * 64 * 8)
    unloaded = pick(replicas, prompt, PrefixIndex(10), 0.25)
    assert unloaded is not None and unloaded.reason == "new"
    # The rendezvous favourite gets queued prefill: the new prompt goes to another replica.
    unloaded.replica.pending_prefill_tokens = 500
    moved = pick(replicas, prompt, PrefixIndex(10), 0.25)
    assert moved is not None and moved.replica is not unloaded.replica
    # Equal work: every gateway picks the same replica (the rendezvous order), not a random one.
    unloaded.replica.pending_prefill_tokens = 0
    assert all(pick(replicas, prompt, PrefixIndex(10), 0.25) == unloaded for _ in range(3))
    # ... unless another has more free KV cache.
    unloaded.replica.kv_cache_usage = 0.5
    roomier = pick(replicas, prompt, PrefixIndex(10), 0.25)
    assert roomier is not None and roomier.replica is not unloaded.replica


def test_a_prefix_stays_home_until_a_miss_elsewhere_costs_less() -> None:
    home, other = Replica("http://home", is_ready=True), Replica("http://other", is_ready=True)
    index = PrefixIndex(100)
    system = "s" * 64 * 16  # 16 blocks, 256 tokens
    index.record(hashes(system), home.url)
    prompt = blocks(system + "q" * 64)  # 16 tokens of question
    costs = Costs(miss_weight=2.0, tokens_per_request=16.0)
    # At home: pending + 16; elsewhere: 2 x 272. Queued prefill below the difference keeps it home.
    home.pending_prefill_tokens = 500
    stay = pick([home, other], prompt, index, 10.0, costs)
    assert stay is not None and stay.replica is home and stay.reason == "prefix"
    home.pending_prefill_tokens = 540
    moved = pick([home, other], prompt, index, 10.0, costs)
    assert moved is not None and moved.replica is other and moved.reason == "moved"
    assert moved.uncached_tokens == 272 and moved.hit_fraction == 0
    # Requests in flight count too: 3 x 16 tokens more at home tips the same balance.
    home.pending_prefill_tokens, home.num_in_flight = 500, 3
    assert pick([home, other], prompt, index, 10.0, costs).replica is other  # type: ignore[union-attr]
    # With a miss weighed as its tokens only, the same queue already moves it.
    home.pending_prefill_tokens, home.num_in_flight = 300, 0
    assert pick([home, other], prompt, index, 10.0, Costs(1.0, 16.0)).replica is other  # type: ignore[union-attr]


def test_bounded_load_moves_a_hot_prefix_off_a_full_replica() -> None:
    replicas = [Replica(f"http://r{i}", is_ready=True) for i in range(3)]
    index = PrefixIndex(1000)
    text = "hot" * 200
    home = pick(replicas, blocks(text), index, 0.25)
    assert home is not None
    index.record(hashes(text), home.replica.url)
    home.replica.num_in_flight = 2  # total 2+1 over 3 replicas: cap ceil(1.25) = 2; 2+1 > 2
    moved = pick(replicas, blocks(text), index, 0.25)
    assert moved is not None and moved.replica is not home.replica and moved.reason == "moved"


def test_queue_from_metrics_counts_as_load() -> None:
    text = ('# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{model_name="m"} 7\n'
            '# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{model_name="m"} 0.8\n')
    assert parse_load(text) == (7.0, 0.8)
    busy, idle = Replica("http://busy", is_ready=True, num_waiting=7), Replica(
        "http://idle", is_ready=True)
    choice = pick([busy, idle], PromptBlocks([], 0, 16), PrefixIndex(10), 0.25)
    assert choice is not None and choice.replica is idle and choice.reason == "least_load"


def test_pending_prefill_counts_until_the_first_chunk() -> None:
    fake = FakeEngine(num_chunks=3, first_chunk_delay=1.0, chunk_delay=1.0)
    prompt = "p" * 4000  # 1,000 tokens at 4 characters a token
    with fake_engines(fake) as [engine], gateway(backends=(engine.url,)) as gw:
        wait_until(lambda: httpx.get(gw.url + "/ready").json().get("replicas") == 1)
        replica = next(iter(gw.app.state.gateway.replicas.replicas.values()))
        seen: list[float] = []

        def stream() -> None:
            with httpx.stream("POST", gw.url + "/v1/completions", timeout=10, json={
                    "model": "tiny", "prompt": prompt, "max_tokens": 3, "stream": True}) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data: {"):
                        seen.append(replica.pending_prefill_tokens)

        thread = threading.Thread(target=stream)
        thread.start()
        wait_until(lambda: replica.num_in_flight == 1, what="the request upstream")
        assert replica.pending_prefill_tokens == 1000  # nothing cached: the whole prompt
        thread.join(timeout=10)
        assert seen and seen[0] == 0  # settled by the time the first chunk reached the client
        assert replica.pending_prefill_tokens == 0 and replica.num_in_flight == 0
        # A buffered answer settles when it ends.
        assert post(gw.url, "/v1/completions", {"model": "tiny", "prompt": prompt,
                                                "max_tokens": 3}).status_code == 200
        assert replica.pending_prefill_tokens == 0


def chat(tenant: str, question: str) -> dict[str, object]:
    return {"model": "tiny", "max_tokens": 4, "messages": [
        {"role": "system", "content": SYSTEM[tenant]}, {"role": "user", "content": question}]}


def test_each_tenants_system_prompt_sticks_to_one_replica() -> None:
    fakes = [FakeEngine() for _ in range(3)]
    with fake_engines(*fakes) as servers, gateway(
            backends=tuple(s.url for s in servers), load_bound=10.0) as gw:
        wait_until(lambda: httpx.get(gw.url + "/ready").json().get("replicas") == 3)
        for round_ in range(3):
            for tenant in SYSTEM:
                assert post(gw.url, "/v1/chat/completions",
                            chat(tenant, f"question {round_}")).status_code == 200
        where: dict[str, set[int]] = {}
        for i, fake in enumerate(fakes):
            for received in fake.received:
                system = received["body"]["messages"][0]["content"]
                where.setdefault(system, set()).add(i)
        assert all(len(replicas) == 1 for replicas in where.values())  # affinity
        assert len(set().union(*where.values())) >= 2  # and the tenants spread out
        text = httpx.get(gw.url + "/metrics").text
        assert 'kvasir_gateway_routing_decisions_total{reason="prefix"} 12.0' in text


def test_a_burst_of_one_new_prefix_lands_together() -> None:
    # The engines take a while to answer (their queue): the burst's later requests must find the
    # first one's prefix recorded at its send, not place it anew on the other replica.
    fakes = [FakeEngine(answer_delay=0.5) for _ in range(2)]
    with fake_engines(*fakes) as servers, gateway(backends=tuple(s.url for s in servers)) as gw:
        wait_until(lambda: httpx.get(gw.url + "/ready").json().get("replicas") == 2)
        statuses: list[int] = []
        threads = [threading.Thread(target=lambda i=i: statuses.append(post(
            gw.url, "/v1/chat/completions", chat("alice", f"question {i}")).status_code))
            for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=10)
        assert statuses == [200] * 4
        assert sorted(len(f.received) for f in fakes) == [0, 4]
        text = httpx.get(gw.url + "/metrics").text
        assert 'kvasir_gateway_routing_decisions_total{reason="new"} 1.0' in text
        assert 'kvasir_gateway_routing_decisions_total{reason="prefix"} 3.0' in text


def test_bound_spreads_concurrent_requests_of_one_prefix() -> None:
    fakes = [FakeEngine(num_chunks=5, chunk_delay=0.2) for _ in range(3)]
    with fake_engines(*fakes) as servers, gateway(
            backends=tuple(s.url for s in servers), load_bound=0.25) as gw:
        wait_until(lambda: httpx.get(gw.url + "/ready").json().get("replicas") == 3)
        streams = []
        with httpx.Client(timeout=10) as client:
            for i in range(6):
                req = client.build_request("POST", gw.url + "/v1/chat/completions",
                                           json={**chat("alice", str(i)), "stream": True})
                streams.append(client.send(req, stream=True))
            counts = sorted(len(f.received) for f in fakes)
            for resp in streams:
                resp.read()
                resp.close()
        # CHWBL: nobody above ceil((1 + 0.25) x 6 / 3) = 3 although all six share one prefix
        assert max(counts) <= 3 and counts[1] > 0


def test_unready_replica_gets_nothing_and_comes_back() -> None:
    sick, well = FakeEngine(), FakeEngine()
    with fake_engines(sick, well) as [a, b], gateway(backends=(a.url, b.url)) as gw:
        wait_until(lambda: httpx.get(gw.url + "/ready").json().get("replicas") == 2)
        sick.is_ready = False
        wait_until(lambda: httpx.get(gw.url + "/ready").json().get("replicas") == 1)
        for tenant in SYSTEM:
            assert post(gw.url, "/v1/chat/completions", chat(tenant, "q")).status_code == 200
        assert len(sick.received) == 0 and len(well.received) == len(SYSTEM)
        sick.is_ready = True
        wait_until(lambda: httpx.get(gw.url + "/ready").json().get("replicas") == 2)


def test_comparison_policies() -> None:
    replicas = [Replica(f"http://r{i}", is_ready=True) for i in range(3)]
    turns = [pick_round_robin(replicas, t) for t in range(6)]
    assert [c.replica.url for c in turns if c] == ["http://r0", "http://r1", "http://r2"] * 2
    replicas[0].num_in_flight, replicas[1].num_waiting = 3, 1
    least = pick_least_load(replicas)
    assert least is not None and least.replica.url == "http://r2"


def test_models_are_the_union_and_route_by_model() -> None:
    small, large = FakeEngine(model="small"), FakeEngine(model="large")
    with fake_engines(small, large) as [a, b], gateway(backends=(a.url, b.url)) as gw:
        wait_until(lambda: httpx.get(gw.url + "/ready").json().get("replicas") == 2)
        ids = [m["id"] for m in httpx.get(gw.url + "/v1/models").json()["data"]]
        assert ids == ["large", "small"]
        for _ in range(3):
            body = {"model": "large", "prompt": "x" * 700, "max_tokens": 1}
            assert post(gw.url, "/v1/completions", body).status_code == 200
        assert len(large.received) == 3 and not small.received


def test_one_missed_probe_does_not_take_a_replica_out() -> None:
    import asyncio

    from kvasir_gateway.metrics import GatewayMetrics
    from kvasir_gateway.replicas import ReplicaSet

    fake = FakeEngine()
    with fake_engines(fake) as [engine]:
        async def scenario() -> list[bool]:
            replicas = ReplicaSet(GatewayMetrics(), headers={}, probe_interval=1,
                                  probe_timeout=1, eject_seconds=5, failure_threshold=3)
            replicas.open()
            replicas.set_urls({engine.url})
            replica = replicas.replicas[engine.url]
            seen = []
            for ready in (True, False, False, False, True):
                fake.is_ready = ready
                await replicas.probe(replica)
                seen.append(replica.is_ready)
            await replicas.close()
            return seen

        assert asyncio.run(scenario()) == [True, True, True, False, True]
