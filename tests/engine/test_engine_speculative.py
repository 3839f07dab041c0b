"""Speculative decoding (--speculate): n-gram drafts, greedy output token-for-token equal to plain
decoding (alone, batched, with stops landing inside accepted runs), the prefix cache never holding
rejected drafts, rejection sampling keeping the distribution, and rows that must not speculate."""

from __future__ import annotations

import asyncio

import pytest
import torch

from opentgi.config import Settings
from opentgi.engine.engine import Engine
from opentgi.engine.output.stop_checker import StopChecker
from opentgi.engine.request import (
    GenerationRequest,
    GrammarSpec,
    SamplingParams,
    StoppingParams,
)
from opentgi.engine.sampling.sampler import Sampler
from opentgi.engine.sampling.speculative import NgramProposer, can_speculate, verify
from opentgi.engine.scheduling.sequence import Sequence
from opentgi.metrics import Metrics
from opentgi.models.loader import load_model
from tests.helpers.engine import generate, running

torch.set_num_threads(1)

# prompts that repeat themselves, so the tiny model's output (and its own loops) give drafts that
# really get accepted
TEXTS = [
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n\ndef add(",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "Hello",
]
MAX_NEW = 40


@pytest.fixture(scope="module")
def prompts(llama):
    return [llama.tokenizer(t, add_special_tokens=False)["input_ids"] for t in TEXTS]


def greedy(ids, max_new=MAX_NEW, **stopping) -> GenerationRequest:
    return GenerationRequest(list(ids), SamplingParams(), StoppingParams(max_new_tokens=max_new, **stopping))


@pytest.fixture(scope="module")
def plain(llama, prompts):
    """Greedy outputs without speculation, the reference."""
    async def run():
        async with running(llama) as engine:
            return [await generate(engine, greedy(p)) for p in prompts]
    return asyncio.run(run())


def record_step_tokens(engine) -> list[int]:
    """Tokens the scheduler appended per sampled row, step after step."""
    counts: list[int] = []
    update = engine.scheduler.update_from_output

    def spy(out, new_token_ids):
        counts.extend(len(t) for t in new_token_ids if t)
        return update(out, new_token_ids)

    engine.scheduler.update_from_output = spy
    return counts


# --- the proposer ---------------------------------------------------------------------------------
def make_seq(prompt, sampling=None, max_new=16, seed=0, min_new=0, processors=()) -> Sequence:
    req = GenerationRequest(list(prompt), sampling or SamplingParams(),
                            StoppingParams(max_new_tokens=max_new, min_new_tokens=min_new))
    return Sequence(req, 0, seed=seed, detokenizer=None, stop_checker=StopChecker(req.stopping, [0], 1 << 20),
                    processors=list(processors))


def test_ngram_proposer_looks_up_the_longest_suffix():
    proposer = NgramProposer(3)
    seq = make_seq([5, 6, 7, 8, 9, 1, 6, 7, 2, 3, 5, 6, 7])
    assert proposer.propose(seq) == [8, 9, 1]  # "5 6 7" first seen at 0, followed by 8 9 1
    seq.token_ids += [4]
    assert proposer.propose(seq) == []  # "7 4" / "4" never seen before
    seq.token_ids += [6, 7]
    assert proposer.propose(seq) == [8, 9, 1]  # "6 7": its first occurrence
    short = make_seq([5, 6, 5, 6], max_new=3)
    short.token_ids += [5]  # one generated: one more token may follow the step's own
    assert proposer.propose(short) == [6]


def test_rows_that_cannot_speculate():
    assert can_speculate(make_seq([1, 2]))
    assert can_speculate(make_seq([1, 2], SamplingParams(do_sample=True, temperature=0.7, top_k=5,
                                                         logit_bias={3: 2.0})))
    assert not can_speculate(make_seq([1, 2], SamplingParams(repetition_penalty=1.2)))
    assert not can_speculate(make_seq([1, 2], SamplingParams(frequency_penalty=0.5)))
    assert not can_speculate(make_seq([1, 2], SamplingParams(presence_penalty=0.5)))
    assert not can_speculate(make_seq([1, 2], processors=[object()]))  # grammar, watermark
    assert not can_speculate(make_seq([1, 2], min_new=2))


# --- greedy: token for token ----------------------------------------------------------------------
async def test_greedy_equals_plain_alone_and_batched(llama, prompts, plain):
    metrics = Metrics()
    metrics.set_speculate(4)
    async with running(llama, observer=metrics.observer, speculate=4) as engine:
        steps = record_step_tokens(engine)
        alone = [await generate(engine, greedy(p)) for p in prompts]
        batched = await asyncio.gather(*[generate(engine, greedy(p)) for p in prompts])
        accepted, drafted = engine.scheduler.accepted_tokens_total, engine.scheduler.draft_tokens_total
    for ref, a, b in zip(plain, alone, batched):
        assert a.sequences[0].token_ids == ref.sequences[0].token_ids
        assert b.sequences[0].token_ids == ref.sequences[0].token_ids
        assert a.sequences[0].text == ref.sequences[0].text
        assert [e.token_id for e in a.sequences[0].tokens] == ref.sequences[0].token_ids
    assert 0 < accepted <= drafted
    assert max(steps) == 5  # some steps kept all 4 drafts and one more
    assert len(steps) < sum(len(r.sequences[0].token_ids) for r in plain) * 2 * 0.8
    body = metrics.render()[0].decode()
    assert f"opentgi_spec_accepted_tokens_total {accepted}" in body
    assert f"opentgi_spec_draft_tokens_total {drafted}" in body
    assert 'tgi_request_skipped_tokens_bucket{le="4"}' in body
    skipped = float(body.split("tgi_request_skipped_tokens_sum ")[1].split("\n")[0])
    assert skipped == accepted


class RuleRunner:
    """A model whose greedy next token is a rule of the last two tokens, learnt from TEXT (the
    first continuation of each pair; a pair never seen: TEXT's first token). Its prompts are cut
    from TEXT, so n-gram drafts are mostly right, and wrong where a shorter n-gram misleads:
    stops land anywhere inside accepted runs, without model numerics in the way."""

    kind = "paged"

    def __init__(self, tokenizer, vocab_size: int):
        self.text = tokenizer(STORY, add_special_tokens=False)["input_ids"]
        self.next: dict[tuple[int, int], int] = {}
        for a, b, c in zip(self.text, self.text[1:], self.text[2:]):
            self.next.setdefault((a, b), c)
        self.vocab_size = vocab_size

    def free(self, seq):
        pass

    def execute(self, seqs, num_new_tokens, sample_rows, logit_rows=(), score_rows=(), greedy_vocab=0):
        from opentgi.engine.execution.model_runner import StepOutput

        chosen = []
        for r in sample_rows:
            seq = seqs[r]
            fed = seq.token_ids + seq.draft_token_ids
            for j in range(len(seq.draft_token_ids) + 1):
                ctx = fed[:len(seq.token_ids) + j]
                chosen.append(self.next.get((ctx[-2], ctx[-1]), self.text[0]))
        logits = torch.zeros(len(chosen), self.vocab_size)
        logits[torch.arange(len(chosen)), torch.tensor(chosen)] = 10.0
        return StepOutput(sample_logits=logits)


STORY = ("the cat sat on the mat and the dog sat on the log and the cat saw the dog on the mat "
         "so the dog ran to the log and the cat sat on the dog and the mat was on the cat")


@pytest.mark.parametrize("case", ["max_new_tokens", "stop_token", "stop_string"])
async def test_stops_inside_accepted_runs(llama, case):
    """Every end position: the speculative result equals the plain one (tokens, text, events,
    finish reason), and some ends fell inside a run of accepted drafts (tokens were dropped) or at
    the end of a multi-token step."""
    tok = llama.tokenizer

    async def run(speculate: int, requests):
        engine = Engine(llama, Settings(max_batch_total_tokens=4096, speculate=speculate))
        engine.runner = engine.core.runner = RuleRunner(tok, engine.spec.vocab_size)
        await engine.start()
        try:
            results, last_step, dropped = [], [], 0
            for request in requests:
                steps = record_step_tokens(engine)
                result = (await generate(engine, request)).sequences[0]
                results.append(result)
                dropped += sum(steps) - len(result.token_ids)
                last_step.append(steps[-1])
                del engine.scheduler.update_from_output  # back to the class's method
            assert engine.block_manager.num_used_blocks == 0
            return results, last_step, dropped
        finally:
            await engine.stop()

    story = RuleRunner(tok, 1).text
    prompt = story[:24]
    full = (await run(0, [greedy(prompt, max_new=40)]))[0][0].token_ids
    if case == "max_new_tokens":
        requests = [greedy(prompt, max_new=end) for end in range(1, 30)]
    elif case == "stop_token":
        requests = [greedy(prompt, stop_token_ids=[t]) for t in sorted(set(full))]
    else:
        text = tok.decode(full)
        requests = [greedy(prompt, stop_sequences=[text[i:i + 6]]) for i in range(0, len(text) - 6, 3)]
    plain_results = (await run(0, requests))[0]
    spec_results, last_step, dropped = await run(4, requests)
    for p, s in zip(plain_results, spec_results):
        assert s.token_ids == p.token_ids
        assert s.text == p.text and s.finish_reason == p.finish_reason
        assert [(e.token_id, e.text_delta, e.finish_reason) for e in s.tokens] == \
            [(e.token_id, e.text_delta, e.finish_reason) for e in p.tokens]
    assert max(last_step) > 1  # the end came in a step that kept several tokens
    if case != "max_new_tokens":  # (drafts never run past max_new_tokens)
        assert dropped > 0


async def test_prefix_cache_never_holds_rejected_drafts(llama, prompts, plain):
    """After speculative runs (with rejections), every cached block holds the k/v of the tokens it
    is hashed under: a prompt that reuses them decodes as with the cache off."""
    async with running(llama, speculate=4) as engine:
        first = [await generate(engine, greedy(p)) for p in prompts]
        assert engine.scheduler.accepted_tokens_total < engine.scheduler.draft_tokens_total  # some rejected
        bm = engine.block_manager
        full = [list(p) + r.sequences[0].token_ids for p, r in zip(prompts, first)]
        for block in bm.blocks:
            if block.hash is not None:
                assert any(tuple(f[i:i + len(block.token_ids)]) == block.token_ids
                           for f in full for i in range(0, len(f), bm.block_size)), block.block_id
        warm = [await generate(engine, greedy(f, max_new=16)) for f in full]
        assert bm.prefix_hit_tokens > 0
    async with running(llama, enable_prefix_caching=False) as engine:
        cold = [await generate(engine, greedy(f, max_new=16)) for f in full]
    assert [r.sequences[0].token_ids for r in warm] == [r.sequences[0].token_ids for r in cold]


async def test_rows_that_do_not_speculate_stay_right(llama, prompts):
    """Repetition penalty, grammar and top-n/logprobs beside speculated rows: the same as without
    speculation."""
    def requests():
        penalty = GenerationRequest(list(prompts[1]), SamplingParams(repetition_penalty=1.3),
                                    StoppingParams(max_new_tokens=MAX_NEW))
        regex = greedy(prompts[2], max_new=20)
        regex.grammar = GrammarSpec("regex", "[0-9]{3}-[a-z]{2}")
        top = greedy(prompts[0])
        top.top_n_tokens = 3
        return [penalty, regex, top, greedy(prompts[3])]

    async def run(speculate):
        async with running(llama, speculate=speculate) as engine:
            out = await asyncio.gather(*[generate(engine, r) for r in requests()])
            return out, engine.scheduler.accepted_tokens_total

    (plain_out, _), (spec_out, accepted) = await run(0), await run(4)
    assert accepted > 0
    for p, s in zip(plain_out, spec_out):
        assert s.sequences[0].token_ids == p.sequences[0].token_ids
        for ep, es in zip(p.sequences[0].tokens, s.sequences[0].tokens):
            assert es.logprob == pytest.approx(ep.logprob, abs=1e-4)
            assert (es.top_tokens is None) == (ep.top_tokens is None)
            if es.top_tokens:
                assert [t.id for t in es.top_tokens] == [t.id for t in ep.top_tokens]


# --- sampling: the distribution is kept -----------------------------------------------------------
def test_rejection_sampling_keeps_the_distribution():
    """Draft x at the first position: the first token is still distributed as the row's processed
    distribution p (accepted with p(x), else drawn from p without x), and the token after an
    accepted draft as the next position's distribution."""
    torch.manual_seed(0)
    V, N = 12, 3000
    logits = torch.randn(2, V) * 1.5
    draft = int(logits[0].argsort()[-2])  # a likely, but not the likeliest, token
    for params in (SamplingParams(do_sample=True, temperature=0.8),
                   SamplingParams(do_sample=True, top_k=6),
                   SamplingParams(do_sample=True, top_p=0.9, temperature=1.2)):
        seqs = [make_seq([1, 2, 3], params, seed=s) for s in range(N)]
        sampler = Sampler(V, torch.device("cpu"))
        out = verify(sampler, seqs, [[draft]] * N, logits.repeat(N, 1))
        batch = sampler.batch_for(seqs[:1] * 2)
        s = logits / batch.temperature
        p = torch.softmax(sampler._warp(batch, s), dim=-1)
        first = torch.bincount(torch.tensor([t[0] for t in out.token_ids]), minlength=V).double() / N
        assert (first - p[0]).abs().max() < 4 * (0.25 / N) ** 0.5, params
        second = [t[1] for t in out.token_ids if t[0] == draft]
        assert len(second) == sum(1 for t in out.token_ids if len(t) == 2)
        freq = torch.bincount(torch.tensor(second), minlength=V).double() / len(second)
        assert (freq - p[1]).abs().max() < 4 * (0.25 / len(second)) ** 0.5, params
        # logprobs are the raw logits' log-softmax at the kept tokens
        lp = torch.log_softmax(logits, dim=-1)
        assert out.logprobs[0][0] == pytest.approx(float(lp[0, out.token_ids[0][0]]), abs=1e-5)


async def test_seeded_sampling_reproduces_with_speculation(llama, prompts):
    def sampled(seed):
        return GenerationRequest(list(prompts[0]), SamplingParams(do_sample=True, temperature=0.1, seed=seed),
                                 StoppingParams(max_new_tokens=MAX_NEW))

    async with running(llama, speculate=4) as engine:
        alone = await generate(engine, sampled(42))
        accepted = engine.scheduler.accepted_tokens_total
        batched = await asyncio.gather(generate(engine, sampled(42)), generate(engine, greedy(prompts[1])),
                                       generate(engine, sampled(7)))
    assert accepted > 0
    assert batched[0].sequences[0].token_ids == alone.sequences[0].token_ids


@pytest.mark.slow  # the ci tier: a long run
@pytest.mark.parametrize("four_bit", [False, True], ids=["dense", "4-bit GGUF"])
def test_verify_forward_is_bitwise_plain_decoding_in_bfloat16(tiny_llama, four_bit, tmp_path):
    """The logits of a verify row (last token + drafts in one forward) equal, bit for bit, those of
    decoding the same tokens one per step, in bfloat16 too: the torch backend attends such a row
    token by token (through the prefill chunk path, this 300-token context rounds differently).
    A GGUF's 4-bit weights multiply every row through the int4 kernel, whose rows do not depend on
    how many share the step (models/quantization/int4.py), so they keep this too."""
    from opentgi.engine.execution.model_runner import ModelRunner
    from opentgi.engine.scheduling.block_manager import BlockManager
    from opentgi.models.quantization.linear import QuantizedLinear
    from tests.helpers import tiny_models

    path = tiny_models.tiny_gguf_path() if four_bit else tiny_llama
    loaded = load_model(Settings(model_id=str(path), dtype="bfloat16", speculate=5, cache_dir=str(tmp_path)))
    assert any(isinstance(m, QuantizedLinear) for m in loaded.model.modules()) == four_bit
    runner = ModelRunner(loaded.model, 64, loaded.block_size)
    bm = BlockManager(64, loaded.block_size)
    prompt = list(range(100, 400))

    def prefilled() -> Sequence:
        seq = make_seq(prompt, max_new=32)
        bm.admit(seq, use_prefix_cache=False)
        bm.allocate_slots(seq, len(prompt))
        out = runner.execute([seq], [len(prompt)], [0])
        seq.num_computed_tokens = len(prompt)
        seq.token_ids.append(int(out.sample_logits.argmax(-1)))
        return seq

    plain, decoded = prefilled(), []
    for _ in range(6):
        bm.allocate_slots(plain, 1)
        logits = runner.execute([plain], [1], [0]).sample_logits[0]
        plain.num_computed_tokens += 1
        decoded.append(logits)
        plain.token_ids.append(int(logits.argmax()))
    spec = prefilled()
    spec.draft_token_ids = plain.token_ids[len(prompt) + 1:len(prompt) + 6]
    bm.allocate_slots(spec, 6)
    verified = runner.execute([spec], [6], [0]).sample_logits
    assert all(torch.equal(v, d) for v, d in zip(verified, decoded))
