"""What one request is charged (`Exchange.tokens_to_settle`), event by event, without a server:
the same cases tests/gateway/test_quota.py and test_cascade.py drive through the gateway."""

from __future__ import annotations

from kvasir_gateway.exchange import Exchange

ANSWER = {"choices": [{"text": "four"}], "usage": {"prompt_tokens": 9, "completion_tokens": 3}}


def test_nothing_answered_costs_nothing() -> None:
    assert Exchange(prompt_tokens=10).tokens_to_settle(None, 0) == 0


def test_an_answer_read_whole_is_charged_its_usage() -> None:
    exchange = Exchange(prompt_tokens=10)
    exchange.replica_answered()
    exchange.relaying(200)
    exchange.read_whole(ANSWER)
    assert exchange.tokens_to_settle(None, 0) == 12
    assert (exchange.final_completion_tokens, exchange.answer) == (3, "four")


def test_a_cut_off_stream_is_charged_the_prompt_and_the_chunks_relayed() -> None:
    exchange = Exchange(prompt_tokens=10)
    exchange.replica_answered()
    exchange.relaying(200)
    exchange.response_started()
    exchange.cut_off()
    assert exchange.tokens_to_settle(None, 4) == 14
    assert exchange.tokens_to_settle(30, 4) == 30  # the stream's own usage, when it came


def test_an_engine_refusal_costs_nothing() -> None:
    exchange = Exchange(prompt_tokens=10)
    exchange.replica_answered()
    exchange.relaying(429)
    assert exchange.tokens_to_settle(None, 0) == 0


def test_a_cascade_charges_every_attempt() -> None:
    exchange = Exchange(prompt_tokens=10)
    exchange.hold_prompt()
    assert exchange.tokens_to_settle(None, 0) == 10  # cut off while the small pool reads
    exchange.release_prompt()
    exchange.escalated("small", used_tokens=15, num_completion_tokens=5)
    exchange.hold_prompt()
    exchange.release_prompt()
    exchange.answered_whole(ANSWER, used_tokens=12, num_completion_tokens=3)
    assert exchange.tokens_to_settle(None, 0) == 27
    assert exchange.finish("medium") == [("small", 5), ("medium", 3)]
