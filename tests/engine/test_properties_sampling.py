"""Property tests of the sampler on random logits and random batch compositions:

- a seeded row draws the same tokens whatever its batch neighbours (their number, order and
  parameters) -- TGI's and vLLM's promise for `seed`;
- top-k, top-p and typical-p never pick a token outside their set (computed here from the
  definitions, ties counted in the row's favour);
- greedy rows take the argmax, whatever the sampled rows beside them do.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from opentgi.engine.output.stop_checker import StopChecker
from opentgi.engine.request import GenerationRequest, SamplingParams, StoppingParams
from opentgi.engine.sampling.sampler import Sampler
from opentgi.engine.scheduling.sequence import Sequence
from tests.helpers.hypothesis_profiles import examples

CPU = torch.device("cpu")
EPS = 1e-4  # float32 rounding of cumulative probabilities at a set's border
TIE = 1e-5  # float32 rounding of logits / typicality scores: closer than this counts as a tie


def make_seq(params: SamplingParams, seed: int | None = None) -> Sequence:
    req = GenerationRequest([1, 2, 3], params, StoppingParams(max_new_tokens=8))
    return Sequence(req, 0, seed=seed if seed is not None else 0, detokenizer=None,
                    stop_checker=StopChecker(req.stopping, [], 1 << 20), processors=[])


sampled_params = st.builds(
    SamplingParams, do_sample=st.just(True),
    temperature=st.sampled_from([1.0, 0.5, 0.7, 1.3, 2.0]),
    top_k=st.one_of(st.just(0), st.integers(1, 40)),
    top_p=st.one_of(st.just(1.0), st.floats(0.05, 0.99)),
    typical_p=st.one_of(st.just(1.0), st.just(1.0), st.floats(0.05, 0.99)),
)
# One warper at a time: with tied logits, which members of a tie group at a set's border top-k and
# top-p keep is arbitrary (position in a sort), and the next warper's set depends on it.
one_warper_params = st.one_of(
    st.builds(SamplingParams, do_sample=st.just(True), temperature=st.sampled_from([1.0, 0.7, 2.0]),
              top_k=st.integers(1, 40)),
    st.builds(SamplingParams, do_sample=st.just(True), top_p=st.floats(0.05, 0.99)),
    st.builds(SamplingParams, do_sample=st.just(True), typical_p=st.floats(0.05, 0.99)),
)
any_params = st.one_of(sampled_params, st.just(SamplingParams(do_sample=False)))


@st.composite
def logits_rows(draw, rows: int, ties: bool | None = None) -> torch.Tensor:
    """[rows, V] random logits: V small or past the sampler's candidate window, some ties, some -inf."""
    vocab = draw(st.sampled_from([5, 37, 300, 1500]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    logits = torch.randn(rows, vocab, generator=g) * draw(st.sampled_from([0.1, 1.0, 4.0, 12.0]))
    if draw(st.booleans()) if ties is None else ties:
        logits = logits.round()  # ties
    if draw(st.booleans()):
        logits[torch.rand(rows, vocab, generator=g) < 0.3] = float("-inf")
        logits[:, 0] = logits[:, 0].clamp(min=-1e4)  # at least one finite logit per row
    return logits


# --- the sets, from the definitions ---------------------------------------------------------------
def allowed(params: SamplingParams, logits: torch.Tensor) -> torch.Tensor:
    """Tokens the row's warpers may keep, [V] bool: HF/TGI's order (temperature, top-k, top-p,
    typical-p), each on the distribution the previous left; a token tied with a kept one is allowed."""
    s = logits.double() / params.temperature
    keep = torch.isfinite(s)
    if 0 < params.top_k < s.numel():
        kth = s.topk(params.top_k).values[-1]
        keep &= s >= kth - TIE
    if 0 < params.top_p < 1:
        p = torch.softmax(s.masked_fill(~keep, float("-inf")), dim=-1)
        above = torch.stack([p[s > v + TIE].sum() for v in s])  # mass strictly more likely than each token
        keep &= above < params.top_p + EPS
    if 0 < params.typical_p < 1:
        logp = torch.log_softmax(s.masked_fill(~keep, float("-inf")), dim=-1)
        p = logp.exp()
        entropy = -torch.nan_to_num(p * logp).sum()
        shift = (-logp - entropy).abs()
        closer = torch.stack([p[shift < v - TIE].sum() for v in shift])  # mass strictly more typical
        keep &= closer < params.typical_p + EPS
    return keep


@settings(max_examples=examples(60))
@given(data=st.data(), rows=st.integers(1, 6))
def test_warpers_never_pick_outside_their_set(data, rows):
    ties = data.draw(st.booleans())
    params = [data.draw(one_warper_params if ties else sampled_params) for _ in range(rows)]
    logits = data.draw(logits_rows(rows, ties))
    vocab = logits.shape[1]
    seqs = [make_seq(p, seed=data.draw(st.integers(0, 2**32))) for p in params]
    sampler = Sampler(vocab, CPU)
    for _ in range(3):  # a few draws per row from its generator
        chosen = sampler.sample(seqs, logits).token_ids
        for row, token in enumerate(chosen):
            keep = allowed(params[row], logits[row])
            assert keep[token], (row, params[row], token, int(keep.sum()))


@settings(max_examples=examples(60))
@given(data=st.data(), params=sampled_params, seed=st.integers(0, 2**63), steps=st.integers(1, 3))
def test_seeded_row_is_the_same_whatever_its_neighbours(data, params, seed, steps):
    logits_all = data.draw(logits_rows(8))
    vocab = logits_all.shape[1]
    target = logits_all[0]

    def run(neighbours: list[SamplingParams], position: int) -> list[int]:
        seqs = [make_seq(p, seed=i + 1000) for i, p in enumerate(neighbours)]
        me = make_seq(params, seed=seed)
        seqs.insert(position, me)
        logits = torch.cat([logits_all[1:1 + len(neighbours)], target.unsqueeze(0)])
        order = list(range(len(neighbours)))
        order.insert(position, len(neighbours))
        logits = logits[order]
        sampler = Sampler(vocab, CPU)
        return [sampler.sample(seqs, logits).token_ids[position] for _ in range(steps)]

    alone = run([], 0)
    neighbours = data.draw(st.lists(any_params, max_size=5))
    position = data.draw(st.integers(0, len(neighbours)))
    assert run(neighbours, position) == alone


@settings(max_examples=examples(60))
@given(data=st.data(), rows=st.integers(1, 6))
def test_greedy_rows_take_the_argmax(data, rows):
    params = [data.draw(any_params) for _ in range(rows)]
    logits = data.draw(logits_rows(rows))
    seqs = [make_seq(p, seed=i) for i, p in enumerate(params)]
    out = Sampler(logits.shape[1], CPU).sample(seqs, logits)
    argmax = logits.argmax(dim=-1).tolist()
    for row, p in enumerate(params):
        if not p.do_sample:
            assert out.token_ids[row] == argmax[row]
