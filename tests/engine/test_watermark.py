"""The Kirchenbauer soft watermark (engine/sampling/watermark.py): TGI's permutation, per-row seeding, detection
of text sampled from a tiny random-weight model with and without the processor."""

from __future__ import annotations

import pytest
import torch

from opentgi.engine.sampling.watermark import (
    HASH_KEY,
    detect_watermark,
    greenlist_ids,
    make_watermark_processor,
)

torch.set_num_threads(1)

GAMMA, DELTA = 0.5, 2.0
V = 49152


def tgi_reference(scores: torch.Tensor, prev_token: int, gamma: float, delta: float) -> torch.Tensor:
    """TGI's WatermarkLogitsProcessor.__call__ written out step by step (utils/watermark.py)."""
    rng = torch.Generator(device=scores.device)
    rng.manual_seed(HASH_KEY * prev_token)
    vocab_permutation = torch.randperm(scores.shape[-1], device=scores.device, generator=rng)
    greenlist = vocab_permutation[: int(scores.shape[-1] * gamma)]
    mask = torch.zeros_like(scores)
    mask[greenlist] = 1
    out = scores.clone()
    out[mask.bool()] += delta
    return out


@pytest.mark.parametrize("prev_token", [0, 1, 17, 49151])
@pytest.mark.parametrize("gamma", [0.25, 0.5])
def test_processor_matches_tgi_permutation(prev_token, gamma):
    scores = torch.randn(V, generator=torch.Generator().manual_seed(prev_token))
    expected = tgi_reference(scores, prev_token, gamma, DELTA)
    proc = make_watermark_processor(V, gamma, DELTA, last_prompt_token=prev_token)
    proc(scores)
    torch.testing.assert_close(scores, expected, rtol=0, atol=0)
    assert (scores != expected).sum() == 0


def test_green_list_size_and_key():
    ids = greenlist_ids(V, GAMMA, 42)
    assert ids.numel() == V // 2 and ids.unique().numel() == V // 2
    assert not torch.equal(ids, greenlist_ids(V, GAMMA, 43))  # another previous token, another list
    assert torch.equal(ids, greenlist_ids(V, GAMMA, 42))  # deterministic


def test_accept_moves_the_seed_to_the_sequences_own_previous_token():
    proc = make_watermark_processor(V, GAMMA, DELTA, last_prompt_token=7)
    for prev in (7, 1234, 99):
        if prev != 7:
            proc.accept(prev)
        logits = torch.zeros(V)
        proc(logits)
        green = torch.zeros(V, dtype=torch.bool)
        green[greenlist_ids(V, GAMMA, prev)] = True
        assert torch.equal(logits == DELTA, green)
    assert proc.is_terminated() is False


def test_rows_narrower_or_wider_than_the_vocabulary():
    proc = make_watermark_processor(V, GAMMA, DELTA, last_prompt_token=3)
    narrow = torch.zeros(V - 10)
    proc(narrow)
    wide = torch.zeros(V + 10)
    proc(wide)
    assert torch.equal(narrow, wide[: V - 10])
    assert (wide[V:] == 0).all()


def _sample(model, prompt: list[int], seed: int, steps: int, watermark: bool) -> list[int]:
    """Sample from a random-weight model, optionally through the watermark processor."""
    g = torch.Generator().manual_seed(seed)
    proc = make_watermark_processor(model.config.vocab_size, GAMMA, DELTA, last_prompt_token=prompt[-1])
    ids = torch.tensor([prompt])
    past = None
    out: list[int] = []
    with torch.no_grad():
        for _ in range(steps):
            step = model(input_ids=ids if past is None else ids[:, -1:], past_key_values=past, use_cache=True)
            past = step.past_key_values
            logits = step.logits[0, -1].float()
            if watermark:
                proc(logits)
            tok = int(torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=g))
            proc.accept(tok)
            out.append(tok)
            ids = torch.cat([ids, torch.tensor([[tok]])], dim=1)
    return out


@pytest.fixture(scope="module")
def model(tiny_llama):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama, torch_dtype=torch.float32).eval()


@pytest.mark.slow  # the ci tier: a long run
def test_watermarked_generations_are_detected_and_plain_ones_are_not(model):
    prompt = [1, 504, 3458, 314, 253]
    vocab = model.config.vocab_size
    for seed in range(4):
        marked = _sample(model, prompt, seed, steps=80, watermark=True)
        plain = _sample(model, prompt, seed, steps=80, watermark=False)
        d_marked = detect_watermark(marked, vocab, GAMMA, last_prompt_token=prompt[-1])
        d_plain = detect_watermark(plain, vocab, GAMMA, last_prompt_token=prompt[-1])
        assert d_marked.is_watermarked and d_marked.z_score > 4.0, d_marked
        assert d_marked.green_fraction > 0.7 and d_marked.num_scored_tokens == 80
        assert not d_plain.is_watermarked and abs(d_plain.z_score) < 4.0, d_plain
        # Without the last prompt token the first generated token only seeds the second one.
        assert detect_watermark(marked, vocab, GAMMA).num_scored_tokens == 79


def test_detector_on_random_token_streams_stays_near_zero():
    g = torch.Generator().manual_seed(0)
    zs = [detect_watermark(torch.randint(0, V, (200,), generator=g).tolist(), V, GAMMA).z_score
          for _ in range(20)]
    assert max(abs(z) for z in zs) < 4.0
    assert abs(sum(zs) / len(zs)) < 1.0


def test_detector_degenerate_inputs():
    assert detect_watermark([], V, GAMMA).num_scored_tokens == 0
    assert detect_watermark([5], V, GAMMA).is_watermarked is False
    d = detect_watermark([5], V, GAMMA, last_prompt_token=4)
    assert d.num_scored_tokens == 1
