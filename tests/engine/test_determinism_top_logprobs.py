"""OpenAI's `top_logprobs` (chat) and `logprobs` (completions) give exactly N alternatives, ties
broken by token id (lower first); TGI's `top_n_tokens` keeps every token tied with the n-th."""

from __future__ import annotations

import pytest
import torch

from opentgi.engine.output.stop_checker import StopChecker
from opentgi.engine.request import GenerationRequest, SamplingParams, StoppingParams
from opentgi.engine.sampling.sampler import Sampler
from opentgi.engine.scheduling.sequence import Sequence

torch.set_num_threads(1)


def make_seq(top_n: int, ties: bool) -> Sequence:
    req = GenerationRequest([1, 2, 3], SamplingParams(), StoppingParams(max_new_tokens=4), top_n_tokens=top_n,
                            top_n_ties=ties)
    return Sequence(req, 0, seed=0, detokenizer=None, stop_checker=StopChecker(req.stopping, [0], 1 << 20),
                    processors=[])


def test_exactly_n_with_ties_in_token_id_order():
    logits = torch.tensor([[1.0, 3.0, 2.0, 3.0, 2.0, 2.0, 0.0, 2.0]])
    sampler = Sampler(8, torch.device("cpu"))
    exact = sampler.sample([make_seq(3, ties=False)], logits).top[0]
    assert [t for t, _ in exact] == [1, 3, 2]  # the two 3.0s by id, then the lowest id of the 2.0s
    tgi = sampler.sample([make_seq(3, ties=True)], logits).top[0]
    assert [t for t, _ in tgi] == [1, 3, 2, 4, 5, 7]  # every token tied with the 3rd
    log_probs = torch.log_softmax(logits[0], -1)
    assert all(lp == log_probs[t].item() for t, lp in exact + tgi)


def test_exactly_n_when_a_tie_runs_past_the_candidate_window():
    """Forty tokens tie for the 2nd place: topk's window (n + 16) holds an arbitrary part of them,
    the answer still names the lowest ids."""
    vocab = 100
    logits = torch.zeros(1, vocab)
    logits[0, torch.arange(60, 20, -1)] = 1.0  # ids 21..60 tie
    logits[0, 90] = 5.0
    top = Sampler(vocab, torch.device("cpu")).sample([make_seq(3, ties=False)], logits).top[0]
    assert [t for t, _ in top] == [90, 21, 22]


@pytest.fixture()
def tied_logits(engine, monkeypatch):
    """The tiny model's logits rounded to whole numbers: ties at nearly every step."""
    _, eng = engine
    model = eng.core.runner.model
    real = model.compute_logits
    monkeypatch.setattr(model, "compute_logits", lambda hidden: real(hidden).mul(0.5).round())


def test_openai_routes_give_exactly_n_and_tgi_keeps_ties(client, tied_logits):
    chat = client.post("/v1/chat/completions", json={
        "model": "tgi", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 6,
        "temperature": 0, "logprobs": True, "top_logprobs": 2}).json()
    content = chat["choices"][0]["logprobs"]["content"]
    assert content and all(len(entry["top_logprobs"]) == 2 for entry in content)
    completion = client.post("/v1/completions", json={
        "model": "tgi", "prompt": "Hello", "max_tokens": 6, "temperature": 0, "logprobs": 2}).json()
    tops = completion["choices"][0]["logprobs"]["top_logprobs"]
    # a map by text: two ids that decode alike would merge, never more than 2
    assert tops and all(1 <= len(top) <= 2 for top in tops)
    generated = client.post("/generate", json={"inputs": "Hello", "parameters": {
        "max_new_tokens": 6, "top_n_tokens": 2, "details": True}}).json()
    top_tokens = generated["details"]["top_tokens"]
    assert all(len(top) >= 2 for top in top_tokens)
    assert any(len(top) > 2 for top in top_tokens)  # TGI's ties, all of them
