"""The sampler's maths: greedy, filters, penalties, seeds and the sampled distribution."""

from __future__ import annotations

import math

import torch
from kvasir_engine.core.request import SamplingParams
from kvasir_engine.layers.sampler import apply_penalties, filtered_probs, sample
from kvasir_engine.worker.input_batch import RequestState, build_sampling_tensors

VOCAB = 8


def tensors(params: list[SamplingParams], prompts: list[list[int]] | None = None,
            outputs: list[list[int]] | None = None, eos: frozenset[int] = frozenset()):  # type: ignore[no-untyped-def]
    prompts = prompts or [[0]] * len(params)
    outputs = outputs or [[]] * len(params)
    states = [RequestState(f"r{i}", p + o, len(p), sp)
              for i, (p, o, sp) in enumerate(zip(prompts, outputs, params, strict=True))]
    return build_sampling_tensors(states, torch.device("cpu"), VOCAB, eos)


def test_greedy_is_argmax() -> None:
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(0))
    out = sample(logits, tensors([SamplingParams(temperature=0)] * 4))
    assert out.token_ids.tolist() == logits.argmax(-1).tolist()


def test_top_k_top_p_min_p_masks() -> None:
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1, 0, 0, 0, 0]]) + 1e-12)
    kept = lambda sp: (filtered_probs(logits, tensors([sp])) > 0).nonzero()[:, 1].tolist()  # noqa: E731
    assert kept(SamplingParams(top_k=2)) == [0, 1]
    assert kept(SamplingParams(top_p=0.65)) == [0, 1]  # 0.4 + 0.3 >= 0.65
    assert kept(SamplingParams(top_p=0.69)) == [0, 1]
    assert kept(SamplingParams(top_p=0.71)) == [0, 1, 2]
    assert kept(SamplingParams(min_p=0.45)) == [0, 1, 2]  # p >= 0.45 * 0.4
    assert kept(SamplingParams(min_p=0.6)) == [0, 1]
    assert kept(SamplingParams(top_p=0.01)) == [0]  # the best token always survives
    probs = filtered_probs(logits, tensors([SamplingParams(top_k=2)]))
    torch.testing.assert_close(probs[0, :2], torch.tensor([4 / 7, 3 / 7]))


def test_penalties_follow_vllm_semantics() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, 1.0, 0.5, 0.0, 0.0, 0.0]])
    st = tensors([SamplingParams(repetition_penalty=2.0)], prompts=[[0]], outputs=[[1]])
    got = apply_penalties(logits.clone(), st)[0]
    assert got[0] == 1.0 and got[1] == -4.0 and got[2] == 1.0  # prompt and output tokens
    st = tensors([SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)],
                 prompts=[[2]], outputs=[[3, 3, 4]])
    got = apply_penalties(logits.clone(), st)[0]
    assert got[2] == 1.0  # prompt tokens get no frequency/presence penalty
    assert got[3] == 1.0 - 2 * 0.5 - 0.25
    assert got[4] == 0.5 - 0.5 - 0.25


def test_min_tokens_bans_eos_and_stop_ids() -> None:
    logits = torch.tensor([[0.0, 0.0, 9.0, 8.0, 7.0, 0.0, 0.0, 0.0]])
    sp = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=(3,))
    assert sample(logits, tensors([sp], eos=frozenset({2}))).token_ids.tolist() == [4]
    done = tensors([sp], outputs=[[5, 5]], eos=frozenset({2}))
    assert sample(logits, done).token_ids.tolist() == [2]


def test_seeded_rows_are_reproducible_and_independent_of_the_batch() -> None:
    logits = torch.zeros(3, VOCAB)
    seeded = SamplingParams(temperature=1.0, seed=1234)
    alone = [sample(logits[:1], tensors([seeded], outputs=[[0] * n])).token_ids.item()
             for n in range(20)]
    batch = [SamplingParams(temperature=1.0), seeded, SamplingParams(temperature=1.0, seed=7)]
    engine_generator = torch.Generator().manual_seed(99)
    in_batch = [sample(logits, tensors(batch, outputs=[[0] * n] * 3),
                       engine_generator).token_ids[1].item() for n in range(20)]
    assert alone == in_batch
    assert len(set(alone)) > 1  # it does vary from step to step


def test_temperature_shapes_the_distribution() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2, 1e-9, 1e-9, 1e-9, 1e-9, 1e-9]])).repeat(4000, 1)
    generator = torch.Generator().manual_seed(0)
    for temperature in (1.0, 0.5):
        st = tensors([SamplingParams(temperature=temperature)] * 4000)
        counts = torch.bincount(sample(logits, st, generator).token_ids, minlength=VOCAB)
        expected = torch.softmax(logits[0] / temperature, dim=-1)
        # 4000 draws: 4 standard deviations of a binomial at most.
        tolerance = 4 * torch.sqrt(expected * (1 - expected) / 4000)
        assert ((counts / 4000 - expected).abs() <= tolerance + 1e-6).all(), temperature


def test_logprobs_are_raw_model_logprobs() -> None:
    logits = torch.tensor([[3.0, 1.0, 0.0, -1.0, -2.0, -3.0, -4.0, -5.0]])
    sp = SamplingParams(temperature=0, logprobs=3, repetition_penalty=2.0)
    out = sample(logits, tensors([sp], prompts=[[0]]))
    raw = torch.log_softmax(logits, -1)[0]
    assert out.token_ids.tolist() == [0]  # 3/2 = 1.5 still beats 1.0
    assert math.isclose(out.logprobs.logprobs.item(), raw[0].item(), rel_tol=1e-6)
    assert out.logprobs.ranks.tolist() == [1]
    assert out.logprobs.top_token_ids.tolist() == [[0, 1, 2]]
    torch.testing.assert_close(out.logprobs.top_logprobs[0], raw[:3])
