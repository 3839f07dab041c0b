"""The batched sampler: per-row parameters against transformers' own logits processors, sampled
distributions on a toy vocabulary, seeds, logprobs and top-n ties."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from opentgi.engine.output.stop_checker import StopChecker
from opentgi.engine.request import GenerationRequest, SamplingParams, StoppingParams
from opentgi.engine.sampling.sampler import Sampler, greedy_token_list, greedy_tokens
from opentgi.engine.scheduling.sequence import Sequence

torch.set_num_threads(1)


def make_seq(sampling: SamplingParams, prompt=(1, 2, 3), top_n: int = 0, seed: int | None = 0,
             min_new_tokens: int = 0, processors=(), needs_logprobs: bool = True) -> Sequence:
    req = GenerationRequest(list(prompt), sampling, StoppingParams(max_new_tokens=8, min_new_tokens=min_new_tokens),
                            top_n_tokens=top_n, needs_logprobs=needs_logprobs)
    return Sequence(req, 0, seed=seed, detokenizer=None, stop_checker=StopChecker(req.stopping, [0], 1 << 20),
                    processors=list(processors))


def warped(sampler: Sampler, seqs, logits):
    batch = sampler.batch_for(seqs)
    scores = sampler._process(batch, logits.clone())
    s = scores.index_select(0, batch.sample_index) / batch.temperature
    return sampler._warp(batch, s)


def test_warpers_match_transformers():
    torch.manual_seed(0)
    V = 50
    logits = torch.randn(4, V) * 3
    params = [SamplingParams(do_sample=True, temperature=0.7, top_k=5),
              SamplingParams(do_sample=True, top_p=0.8),
              SamplingParams(do_sample=True, typical_p=0.6),
              SamplingParams(do_sample=True, temperature=1.3, top_k=10, top_p=0.9)]
    seqs = [make_seq(p) for p in params]
    ours = warped(Sampler(V, torch.device("cpu")), seqs, logits)
    refs = [
        [TemperatureLogitsWarper(0.7), TopKLogitsWarper(5)],
        [TopPLogitsWarper(0.8)],
        [TypicalLogitsWarper(0.6)],
        [TemperatureLogitsWarper(1.3), TopKLogitsWarper(10), TopPLogitsWarper(0.9)],
    ]
    for row, procs in enumerate(refs):
        ref = logits[row:row + 1].clone()
        for p in procs:
            ref = p(None, ref)
        assert torch.equal(torch.isinf(ours[row]), torch.isinf(ref[0])), row
        keep = ~torch.isinf(ref[0])
        torch.testing.assert_close(ours[row][keep], ref[0][keep])


@pytest.mark.parametrize("rows", [
    [SamplingParams(do_sample=True, top_k=50), SamplingParams(do_sample=True, temperature=0.7, top_k=7)],
    [SamplingParams(do_sample=True, top_p=0.9), SamplingParams(do_sample=True, temperature=0.5, top_p=0.3),
     SamplingParams(do_sample=True, top_k=20, top_p=0.8), SamplingParams(do_sample=True, top_k=2000)],
])
def test_topk_candidates_give_the_full_sort_distribution(rows):
    """The sampler's topk path (a nucleus inside CANDIDATES tokens) equals the warpers over the whole
    vocabulary; a row that needs the whole vocabulary sends the batch to the full path."""
    V = 3000
    torch.manual_seed(4)
    logits = torch.randn(len(rows), V) * 4
    sampler = Sampler(V, torch.device("cpu"))
    seqs = [make_seq(p) for p in rows]
    batch = sampler.batch_for(seqs)
    s = logits / batch.temperature
    probs, ids = sampler._candidate_probs(batch, s)
    full = torch.zeros(len(rows), V).scatter_(1, ids, probs)
    torch.testing.assert_close(full, torch.softmax(warped(sampler, seqs, logits), -1), atol=1e-6, rtol=1e-5)
    flat = torch.zeros(1, V)  # uniform: a 0.9 nucleus needs 2,700 tokens
    wide = [make_seq(SamplingParams(do_sample=True, top_p=0.9))]
    assert sampler._candidate_probs(sampler.batch_for(wide), flat) is None
    plain = [make_seq(SamplingParams(do_sample=True, top_k=5)), make_seq(SamplingParams(do_sample=True))]
    assert sampler._candidate_probs(sampler.batch_for(plain), torch.randn(2, V)) is None


def test_repetition_penalty_matches_transformers_and_greedy_rows_use_it():
    torch.manual_seed(1)
    V = 30
    logits = torch.randn(2, V) * 2
    prompts = [(3, 4, 5, 3), (7, 8)]
    seqs = [make_seq(SamplingParams(repetition_penalty=1.7), prompt=prompts[0]),
            make_seq(SamplingParams(repetition_penalty=1.0), prompt=prompts[1])]
    sampler = Sampler(V, torch.device("cpu"))
    scores = sampler._process(sampler.batch_for(seqs), logits.clone())
    ref = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([prompts[0]]), logits[:1].clone())
    torch.testing.assert_close(scores[0], ref[0])
    torch.testing.assert_close(scores[1], logits[1])


def test_frequency_presence_penalty_and_logit_bias():
    V = 10
    seq = make_seq(SamplingParams(frequency_penalty=0.5, presence_penalty=0.25, logit_bias={9: 3.0}),
                   prompt=(1, 1))
    seq.token_ids += [4, 4, 6]  # generated: 4 twice, 6 once (prompt tokens are not counted)
    sampler = Sampler(V, torch.device("cpu"))
    scores = sampler._process(sampler.batch_for([seq]), torch.zeros(1, V))
    expected = torch.zeros(V)
    expected[4] = -(0.5 * 2 + 0.25)
    expected[6] = -(0.5 + 0.25)
    expected[9] = 3.0
    torch.testing.assert_close(scores[0], expected)


def test_min_new_tokens_masks_eos():
    V = 5
    logits = torch.tensor([[10.0, 1.0, 0.0, 0.0, 0.0]])  # eos (0) is the argmax
    seq = make_seq(SamplingParams(), min_new_tokens=1)
    out = Sampler(V, torch.device("cpu")).sample([seq], logits)
    assert out.token_ids == [1]
    assert out.logprobs[0] == pytest.approx(torch.log_softmax(logits[0], -1)[1].item())


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = counts.sum()
    expected = probs * n
    keep = expected > 0
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


@pytest.mark.parametrize("params,expected_fn", [
    (SamplingParams(do_sample=True), lambda l: torch.softmax(l, -1)),
    (SamplingParams(do_sample=True, temperature=0.5), lambda l: torch.softmax(l / 0.5, -1)),
    (SamplingParams(do_sample=True, top_k=3), "top_k"),
    (SamplingParams(do_sample=True, top_p=0.7), "top_p"),
])
def test_sampled_distribution_matches(params, expected_fn):
    V = 6
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -1.0])
    if expected_fn in ("top_k", "top_p"):  # both keep the three best tokens here
        probs = torch.softmax(logits, -1)
        probs[3:] = 0
        probs /= probs.sum()
    else:
        probs = expected_fn(logits)
    seq = make_seq(params, seed=1234)
    sampler = Sampler(V, torch.device("cpu"))
    N = 6000
    counts = torch.zeros(V)
    batch_logits = logits.unsqueeze(0)
    for _ in range(N):
        tok = sampler.sample([seq], batch_logits).token_ids[0]
        counts[tok] += 1
    assert counts[probs == 0].sum() == 0
    df = int((probs > 0).sum()) - 1
    # critical value of chi-square at p = 0.001 (df <= 5): 20.5
    assert chi_square(counts, probs) < 20.5, (counts / N, probs)
    assert df >= 2


def test_seed_reproduces_whatever_the_batch():
    V = 100
    torch.manual_seed(3)
    steps = [torch.randn(3, V) for _ in range(20)]

    def run(rows: list[Sequence], target: int) -> list[int]:
        sampler = Sampler(V, torch.device("cpu"))
        out = []
        for logits in steps:
            toks = sampler.sample(rows, logits[:len(rows)] if target == 0 else logits[[1, 0, 2][:len(rows)]])
            out.append(toks.token_ids[target])
        return out

    alone = run([make_seq(SamplingParams(do_sample=True, temperature=0.9), seed=77)], 0)
    others = [make_seq(SamplingParams(do_sample=True), seed=5), make_seq(SamplingParams(), seed=None)]
    in_batch = run([others[0], make_seq(SamplingParams(do_sample=True, temperature=0.9), seed=77), others[1]], 1)
    assert alone == in_batch
    different_seed = run([make_seq(SamplingParams(do_sample=True, temperature=0.9), seed=78)], 0)
    assert different_seed != alone


def test_seed_reproduces_whichever_path_the_neighbours_choose():
    """Found by tests/engine/test_properties_sampling.py: a top-k / top-p row alone takes the topk
    candidates path; beside a row that needs the whole vocabulary (plain sampling, typical-p) the
    batch takes the full-sort path. The draw used to walk the candidates in value order there and
    the vocabulary in id order here, so the same seed picked another token."""
    V = 50
    torch.manual_seed(4)
    steps = [torch.randn(2, V) for _ in range(20)]

    def run(neighbour: SamplingParams | None) -> list[int]:
        me = make_seq(SamplingParams(do_sample=True, top_k=10), seed=77)
        rows = [me] if neighbour is None else [me, make_seq(neighbour, seed=5)]
        sampler = Sampler(V, torch.device("cpu"))
        return [sampler.sample(rows, logits[:len(rows)]).token_ids[0] for logits in steps]

    alone = run(None)
    assert run(SamplingParams(do_sample=True)) == alone
    assert run(SamplingParams(do_sample=True, typical_p=0.5)) == alone


def test_seed_reproduces_with_tied_logits_whichever_path():
    """Found by tests/engine/test_properties_sampling.py (deep profile): with tied logits (common in
    bfloat16), which tied tokens a top-p nucleus keeps came from the order of an unstable sort on
    one path and of topk on the other; ties now go in token-id order on both."""
    V = 5
    logits = torch.zeros(2, V)

    def run(neighbour: SamplingParams | None, seed: int) -> int:
        me = make_seq(SamplingParams(do_sample=True, top_p=0.5), seed=seed)
        rows = [me] if neighbour is None else [me, make_seq(neighbour, seed=5)]
        return Sampler(V, torch.device("cpu")).sample(rows, logits[:len(rows)]).token_ids[0]

    for seed in range(40):
        alone = run(None, seed)
        assert alone in (0, 1, 2)  # the nucleus: the first three of five tied tokens, by id
        assert run(SamplingParams(do_sample=True), seed) == alone
    # top-k = 1 over ties: the tied token with the lowest id, on either path
    me = make_seq(SamplingParams(do_sample=True, top_k=1), seed=3)
    assert Sampler(V, torch.device("cpu")).sample([me], logits[:1]).token_ids == [0]


def test_top_n_includes_ties_and_uses_raw_logprobs():
    V = 8
    logits = torch.tensor([[3.0, 1.0, 2.0, 2.0, 2.0, 0.0, -1.0, 1.0]])
    seq = make_seq(SamplingParams(repetition_penalty=5.0), prompt=(0,), top_n=2)
    out = Sampler(V, torch.device("cpu")).sample([seq], logits)
    raw = torch.log_softmax(logits[0], -1)
    top = out.top[0]
    assert next(t for t, _ in top) == 0
    assert sorted(t for t, _ in top[1:]) == [2, 3, 4]  # three-way tie at the 2nd value
    for t, lp in top:
        assert lp == pytest.approx(raw[t].item())
    # the penalty made another token the choice; its logprob is still from the raw logits
    assert out.token_ids[0] != 0
    assert out.logprobs[0] == pytest.approx(raw[out.token_ids[0]].item())


class OnlyEven:
    """A RowLogitsProcessor: allows even tokens only, records what it accepted."""

    def __init__(self):
        self.accepted = []

    def __call__(self, logits):
        logits[1::2] = float("-inf")

    def accept(self, token_id):
        self.accepted.append(token_id)

    def is_terminated(self):
        return False


def test_row_processors_apply_to_their_row_only():
    V = 6
    logits = torch.tensor([[0.0, 5.0, 1.0, 0.0, 0.0, 0.0]] * 2)
    proc = OnlyEven()
    seqs = [make_seq(SamplingParams(), processors=[proc]), make_seq(SamplingParams())]
    out = Sampler(V, torch.device("cpu")).sample(seqs, logits)
    assert out.token_ids == [2, 1]
    assert proc.accepted == [2]
    assert math.isfinite(out.logprobs[0])


def test_plain_greedy_rows_take_the_first_best_token_with_its_logprob():
    sampler = Sampler(vocab_size=40, device=torch.device("cpu"))
    seqs = [make_seq(SamplingParams()) for _ in range(3)]
    assert sampler.batch_for(seqs).plain_greedy
    logits = torch.randn(3, 48, generator=torch.Generator().manual_seed(3))
    logits[0, [7, 21]] = 9.0  # a tie: the lower id, as argmax
    logits[1, 45] = 99.0  # past vocab_size (padded LM head rows): never chosen
    out = sampler.sample(seqs, logits)
    expected = logits[:, :40].argmax(-1).tolist()
    assert out.token_ids == expected and out.token_ids[0] == 7
    want = torch.log_softmax(logits[:, :40], -1)[torch.arange(3), torch.tensor(expected)]
    assert out.logprobs == pytest.approx(want.tolist(), abs=1e-5)


def _counting_log_softmax(monkeypatch) -> list:
    """Calls of the vocabulary-wide log-softmax (the sampler's row_log_softmax)."""
    from opentgi.engine.sampling import sampler as sampler_module

    calls = []
    real = sampler_module.row_log_softmax

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(sampler_module, "row_log_softmax", counted)
    return calls


@pytest.mark.parametrize("params", [
    SamplingParams(),  # plain greedy
    SamplingParams(repetition_penalty=1.3, logit_bias={5: 2.0}),  # greedy with processors
    SamplingParams(do_sample=True, temperature=0.8, seed=1),  # sampled over the whole vocabulary
])
def test_no_log_softmax_when_no_row_needs_logprobs(monkeypatch, params):
    """Rows whose logprobs reach no client: the same tokens, no logsumexp over the vocabulary, and
    None (never a number that could pass for one) as their logprob."""
    V = 40
    logits = torch.randn(4, 48, generator=torch.Generator().manual_seed(5))
    logits[0, [7, 21]] = 9.0  # a tie: the lower id, as argmax
    logits[2, 45] = 99.0  # past vocab_size: never chosen
    with_lp = Sampler(V, torch.device("cpu")).sample([make_seq(params, seed=i) for i in range(4)], logits)
    calls = _counting_log_softmax(monkeypatch)
    without = Sampler(V, torch.device("cpu")).sample(
        [make_seq(params, seed=i, needs_logprobs=False) for i in range(4)], logits)
    assert calls == []
    assert without.token_ids == with_lp.token_ids
    assert without.logprobs == [None] * 4
    assert all(math.isfinite(lp) for lp in with_lp.logprobs)


def test_mixed_batch_reports_exact_logprobs_for_the_rows_that_asked():
    V = 40
    logits = torch.randn(4, 40, generator=torch.Generator().manual_seed(6))
    needs = [False, True, False, True]
    seqs = [make_seq(SamplingParams(), needs_logprobs=n) for n in needs]
    out = Sampler(V, torch.device("cpu")).sample(seqs, logits)
    raw = torch.log_softmax(logits, -1)
    assert out.token_ids == logits.argmax(-1).tolist()
    for row, need in enumerate(needs):
        if need:
            assert out.logprobs[row] == pytest.approx(raw[row, out.token_ids[row]].item(), abs=1e-6)
        else:
            assert out.logprobs[row] is None


def test_top_n_alone_computes_logprobs(monkeypatch):
    """top_n_tokens needs the log-softmax even where the flag says otherwise."""
    V = 8
    logits = torch.tensor([[3.0, 1.0, 2.0, 0.0, 0.0, 0.0, -1.0, 1.0]])
    calls = _counting_log_softmax(monkeypatch)
    out = Sampler(V, torch.device("cpu")).sample([make_seq(SamplingParams(), top_n=1, needs_logprobs=False)], logits)
    assert calls
    assert out.top[0] == [(0, pytest.approx(torch.log_softmax(logits[0], -1)[0].item()))]


def test_min_p_per_row_matches_transformers():
    """min_p is a per-row tensor: rows without it are untouched; with it, after temperature (as
    vLLM and transformers order them), it matches transformers' MinPLogitsWarper."""
    torch.manual_seed(1)
    V = 60
    logits = torch.randn(3, V) * 3
    params = [SamplingParams(do_sample=True, min_p=0.2), SamplingParams(do_sample=True),
              SamplingParams(do_sample=True, temperature=0.5, min_p=0.05, top_k=30)]
    ours = warped(Sampler(V, torch.device("cpu")), [make_seq(p) for p in params], logits)
    refs = [[MinPLogitsWarper(0.2)], [], [TemperatureLogitsWarper(0.5), MinPLogitsWarper(0.05), TopKLogitsWarper(30)]]
    for row, procs in enumerate(refs):
        ref = logits[row:row + 1].clone()
        for p in procs:
            ref = p(None, ref)
        assert torch.equal(torch.isinf(ours[row]), torch.isinf(ref[0])), row
    kept = ~torch.isinf(ours[0])
    assert 0 < int(kept.sum()) < V


def test_min_p_sampling_never_draws_below_the_threshold():
    V = 20
    logits = torch.zeros(1, V)
    logits[0, 3] = 5.0  # p(3) / p(other) = e^5: min_p 0.05 leaves token 3 alone
    sampler = Sampler(V, torch.device("cpu"))
    seqs = [make_seq(SamplingParams(do_sample=True, min_p=0.05), seed=s) for s in range(20)]
    drawn = {sampler.sample([seq], logits).token_ids[0] for seq in seqs}
    assert drawn == {3}


def test_greedy_tokens_are_torchs_argmax_ties_nans_and_infinities_too():
    x = torch.randn(5, 300)
    x[0, [3, 200]] = x[0].max() + 1  # a tie: the first
    x[1, [7, 9]] = float("nan")  # a NaN before any number, the first NaN
    x[2] = float("-inf")
    x[3, 299] = float("inf")
    for scores in (x, torch.cat([x, torch.randn(5, 10)], dim=1)[:, :300], x.to(torch.bfloat16)):
        want = scores.argmax(dim=-1)
        got = greedy_tokens(scores)
        assert got.dtype == torch.int64 and torch.equal(got, want)
        assert greedy_token_list(scores) == want.tolist()


def test_a_plain_greedy_batch_without_logprobs_gets_each_rows_argmax():
    seqs = [make_seq(SamplingParams(), needs_logprobs=False) for _ in range(3)]
    logits = torch.randn(3, 50)
    out = Sampler(50, torch.device("cpu")).sample(seqs, logits)
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs == [None] * 3 and out.top == [None] * 3
