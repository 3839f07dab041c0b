"""End to end through the Engine on tiny models: greedy output token-for-token equal to transformers
`generate` (alone, batched with staggered arrivals, chunked prefill sizes, prefix cache cold and
warm, preemption in a tiny KV pool, n > 1, the generic path), seeds, cancellation, limits."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import torch
from transformers import AutoModelForCausalLM

from opentgi.config import Settings
from opentgi.engine.engine import Engine
from opentgi.engine.errors import InputTooLongError, OverloadedError, ValidationError
from opentgi.engine.observer import EngineObserver
from opentgi.engine.request import FinishReason, GenerationRequest, SamplingParams, StoppingParams
from opentgi.models.loader import load_model
from tests.helpers.engine import generate, running

torch.set_num_threads(1)

EOS = [2, 0]
PROMPT_TEXTS = [
    "Hello",
    "The quick brown fox jumps over the lazy dog.",
    ("In a hole in the ground there lived a hobbit. Not a nasty, dirty, wet hole, filled with the ends "
    "of worms and an oozy smell, nor yet a dry, bare, sandy hole with nothing in it to sit down on"),
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13",
    "Once upon a time",
]
MAX_NEW = 24


@pytest.fixture(scope="module")
def hf_llama(tiny_llama):
    return AutoModelForCausalLM.from_pretrained(tiny_llama).eval()


@pytest.fixture(scope="module")
def prompts(llama):
    return [llama.tokenizer(t, add_special_tokens=False)["input_ids"] for t in PROMPT_TEXTS]


def hf_greedy(model, ids: list[int], max_new: int = MAX_NEW) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=max_new, do_sample=False, eos_token_id=EOS, pad_token_id=EOS[0])
    return out[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def references(hf_llama, prompts):
    return [hf_greedy(hf_llama, p) for p in prompts]


def greedy(ids, max_new=MAX_NEW, **stopping) -> GenerationRequest:
    return GenerationRequest(list(ids), SamplingParams(), StoppingParams(max_new_tokens=max_new, **stopping))


async def test_greedy_each_prompt_alone(llama, prompts, references):
    async with running(llama, enable_prefix_caching=False) as engine:
        for ids, ref in zip(prompts, references):
            result = await generate(engine, greedy(ids))
            seq = result.sequences[0]
            assert seq.token_ids == ref
            expected = FinishReason.EOS_TOKEN if ref[-1] in EOS and len(ref) < MAX_NEW else FinishReason.LENGTH
            assert seq.finish_reason is expected
            assert seq.text == llama.tokenizer.decode(ref, skip_special_tokens=True)
        assert engine.stats().prefix_hit_tokens == 0


@pytest.mark.parametrize("chunk", [1, 16, None])
async def test_greedy_batch_staggered_arrivals(llama, prompts, references, chunk):
    async with running(llama, chunked_prefill_tokens=chunk, enable_prefix_caching=False,
                       max_waiting_tokens=2) as engine:
        handles = []
        for i, ids in enumerate(prompts):
            handles.append(await engine.submit(greedy(ids)))
            if i % 2 == 0:  # let the earlier ones start decoding before the next arrives
                events = aiter(handles[0])
                with contextlib.suppress(StopAsyncIteration):
                    await anext(events)
        results = [await h.result() for h in handles]
        for result, ref in zip(results, references):
            assert result.sequences[0].token_ids == ref
        stats = engine.stats()
        assert stats.used_blocks == 0 and stats.running == 0 and stats.waiting == 0


async def test_events_stream_matches_result(llama, prompts):
    async with running(llama) as engine:
        handle = await engine.submit(greedy(prompts[2]))
        events = [e async for e in handle]
        result = await handle.result()
    seq = result.sequences[0]
    assert [e.token_id for e in events] == seq.token_ids
    assert "".join(e.text_delta for e in events) == seq.text
    assert [e.generated_tokens for e in events] == list(range(1, len(events) + 1))
    assert events[-1].finish_reason is seq.finish_reason
    assert all(e.finish_reason is None for e in events[:-1])
    assert result.timings.first_token_at >= result.timings.scheduled_at >= result.timings.queued_at


async def test_awaited_results_get_one_delivery_streams_one_a_step(llama, prompts, references):
    # a request only awaited to its end costs the event loop nothing while it decodes; a stream
    # beside it still gets its events step by step
    async with running(llama) as engine:
        seen: list[list[str]] = []
        deliver = engine._deliver

        def counting(deliveries):
            seen.append([d.state.request_id for d in deliveries])
            deliver(deliveries)

        engine._deliver = counting
        awaited = await engine.submit(greedy(prompts[0]))
        streamed = await engine.submit(greedy(prompts[1]))
        result_task = asyncio.ensure_future(awaited.result())
        events = [e async for e in streamed]
        result = await result_task
    assert result.sequences[0].token_ids == references[0]
    assert [e.token_id for e in events] == references[1]
    # the awaited request is handed its steps only until result() begins (when that is depends on
    # how soon the event loop runs, not on the engine), then nothing until its end; the stream its
    # steps throughout
    handed = [awaited.request_id in ids for ids in seen]
    end = len(handed) - 1 - handed[::-1].index(True)
    before_end = handed[:end]
    assert False in before_end, "the awaited request was handed every step"
    assert True not in before_end[before_end.index(False):], "steps handed after result() began"
    assert sum(streamed.request_id in ids for ids in seen) >= len(references[1]) - 1


async def test_prefix_cache_warm_equals_cold(llama, prompts, references):
    long_prompt, ref = prompts[2], references[2]
    async with running(llama, chunked_prefill_tokens=16) as engine:
        cold = await generate(engine, greedy(long_prompt))
        hits_before = engine.stats().prefix_hit_tokens
        warm = await generate(engine, greedy(long_prompt))
        stats = engine.stats()
        assert stats.prefix_hit_tokens - hits_before >= (len(long_prompt) - 1) // 16 * 16
        assert cold.sequences[0].token_ids == ref
        assert warm.sequences[0].token_ids == ref
        # a request that ended on a stop string leaves a cache that still gives the right output
        stop_text = llama.tokenizer.decode(ref[3:5])
        stopped = await generate(engine, greedy(long_prompt, stop_sequences=[stop_text]))
        assert stopped.sequences[0].finish_reason is FinishReason.STOP_SEQUENCE
        assert len(stopped.sequences[0].token_ids) < len(ref)
        extended = long_prompt + stopped.sequences[0].token_ids
        after = await generate(engine, greedy(extended, max_new=8))
        assert after.sequences[0].token_ids == ref[len(stopped.sequences[0].token_ids):][:8]
        assert (await generate(engine, greedy(long_prompt))).sequences[0].token_ids == ref


class RecordingObserver(EngineObserver):
    def __init__(self):
        self.calls: dict[str, list[dict]] = {}

    def _record(self, name, **kw):
        self.calls.setdefault(name, []).append(kw)

    def on_batch(self, **kw):
        self._record("batch", **kw)

    def on_request_finished(self, **kw):
        self._record("finished", **kw)

    def on_preemption(self, num_sequences):
        self._record("preemption", n=num_sequences)

    def on_prefix_cache(self, **kw):
        self._record("prefix", **kw)


async def test_preemption_in_tiny_pool(llama, prompts, references):
    observer = RecordingObserver()
    # 12 blocks of 16 tokens: all five prompts cannot hold their KV at once
    async with running(llama, observer=observer, max_batch_total_tokens=192, chunked_prefill_tokens=32,
                       max_waiting_tokens=0) as engine:
        assert engine.info.max_batch_total_tokens == 192
        handles = [await engine.submit(greedy(p)) for p in prompts]
        results = [await h.result() for h in handles]
        for result, ref in zip(results, references):
            assert result.sequences[0].token_ids == ref
        stats = engine.stats()
        assert stats.preemptions_total > 0
        assert stats.used_blocks == 0
    calls = observer.calls
    assert sum(c["n"] for c in calls["preemption"]) == stats.preemptions_total
    assert len(calls["finished"]) == len(prompts) and all(c["ok"] for c in calls["finished"])
    assert sum(c["generated_tokens"] for c in calls["finished"]) == sum(map(len, references))
    assert {c["method"] for c in calls["batch"]} == {"prefill", "decode"}
    assert calls["prefix"][-1]["query_tokens"] == stats.prefix_query_tokens  # running totals


async def test_n_samples_share_prompt_blocks(llama, prompts, references):
    async with running(llama, chunked_prefill_tokens=16, enable_prefix_caching=False) as engine:
        request = greedy(prompts[2])
        request.n = 3
        result = await generate(engine, request)
        assert [s.index for s in result.sequences] == [0, 1, 2]
        for seq in result.sequences:
            assert seq.token_ids == references[2]
        assert engine.stats().prefix_hit_tokens >= 2 * ((len(prompts[2]) - 1) // 16 * 16)


async def test_cancel_frees_blocks(llama, prompts):
    async with running(llama) as engine:
        handle = await engine.submit(greedy(prompts[2], max_new=500, ignore_eos=True))
        other = await engine.submit(greedy(prompts[1], max_new=200, ignore_eos=True))
        seen = 0
        async for _ in handle:
            seen += 1
            if seen == 3:
                break
        assert engine.stats().used_blocks > 0
        handle.cancel()
        other.cancel()
        for _ in range(200):
            await asyncio.sleep(0.01)
            stats = engine.stats()
            if stats.running == 0 and stats.waiting == 0:
                break
        assert stats.used_blocks == 0 and stats.running == 0
        assert engine.stats().requests_in_flight == 0
        # the engine keeps serving
        assert (await generate(engine, greedy(prompts[0], max_new=3))).sequences[0].generated_tokens == 3


async def test_seeded_sampling_reproduces_in_any_batch(llama, prompts):
    def sampled(seed, n=1):
        return GenerationRequest(list(prompts[1]), SamplingParams(do_sample=True, temperature=1.0, seed=seed),
                                 StoppingParams(max_new_tokens=16, ignore_eos=True), n=n)

    async with running(llama) as engine:
        alone = await generate(engine, sampled(42))
        noise = [await engine.submit(GenerationRequest(list(p), SamplingParams(do_sample=True),
                                                       StoppingParams(max_new_tokens=20))) for p in prompts]
        crowded = await generate(engine, sampled(42))
        for h in noise:
            await h.result()
        pair = await generate(engine, sampled(41, n=2))
        unseeded = await generate(engine, sampled(None))
    assert alone.sequences[0].seed == 42
    assert crowded.sequences[0].token_ids == alone.sequences[0].token_ids
    assert pair.sequences[1].seed == 42
    assert pair.sequences[1].token_ids == alone.sequences[0].token_ids  # sequence i uses seed + i
    assert pair.sequences[0].token_ids != alone.sequences[0].token_ids
    assert isinstance(unseeded.sequences[0].seed, int)


async def test_logprobs_and_top_tokens_match_model(llama, hf_llama, prompts, references):
    ids = prompts[1]
    request = greedy(ids, max_new=4)
    request.top_n_tokens = 3
    request.prompt_logprobs = True
    # a float32 cache, as transformers' float32 forward keeps its keys (float16's moves logprobs ~1e-4)
    async with running(llama, chunked_prefill_tokens=4, kv_cache_dtype="float32") as engine:
        result = await generate(engine, request)
    full = torch.tensor([ids + references[1][:4]])
    with torch.inference_mode():
        logprobs = torch.log_softmax(hf_llama(full).logits[0].float(), -1)
    seq = result.sequences[0]
    for i, event in enumerate(seq.tokens):
        pos = len(ids) - 1 + i
        assert event.logprob == pytest.approx(logprobs[pos, event.token_id].item(), abs=1e-4)
        best = torch.topk(logprobs[pos], 3)
        assert [t.id for t in event.top_tokens][:3] == best.indices.tolist()
    prefill = result.prefill
    assert [p.id for p in prefill] == ids and prefill[0].logprob is None
    for j in range(1, len(ids)):
        assert prefill[j].logprob == pytest.approx(logprobs[j - 1, ids[j]].item(), abs=1e-4)


async def test_stop_string_excluded_end_to_end(llama, prompts, references):
    ref_text = llama.tokenizer.decode(references[3])
    stop = ref_text[len(ref_text) // 2: len(ref_text) // 2 + 3]
    assert stop.strip()
    async with running(llama) as engine:
        handle = await engine.submit(greedy(prompts[3], stop_sequences=[stop], include_stop_str_in_output=False))
        deltas = [e.text_delta async for e in handle]
        result = await handle.result()
    seq = result.sequences[0]
    assert seq.finish_reason is FinishReason.STOP_SEQUENCE
    assert seq.text == ref_text[:ref_text.index(stop)]
    assert "".join(deltas) == seq.text


async def test_context_limit_and_limits(llama, prompts):
    async with running(llama, max_total_tokens=64, max_concurrent_requests=1) as engine:
        ids = prompts[2]  # 40-ish tokens
        result_handle = await engine.submit(greedy(ids, max_new=100, ignore_eos=True))
        with pytest.raises(OverloadedError, match="Model is overloaded"):
            await engine.submit(greedy(prompts[0]))
        result = await result_handle.result()
        assert result.sequences[0].finish_reason is FinishReason.CONTEXT
        assert len(ids) + result.sequences[0].generated_tokens == 64
        with pytest.raises(InputTooLongError):
            await engine.submit(greedy(list(range(100, 170))))
        with pytest.raises(ValidationError, match="outside the vocabulary"):
            await engine.submit(greedy([5, llama.spec.vocab_size]))
        with pytest.raises(ValidationError, match="at least one token"):
            await engine.submit(greedy([]))
    async with running(llama, max_batch_total_tokens=64) as engine:
        with pytest.raises(InputTooLongError, match="more than the whole pool"):
            await engine.submit(greedy(prompts[2], max_new=60))


async def test_probe_and_health(llama):
    async with running(llama) as engine:
        assert engine.healthy()
        assert await engine.probe()
        assert engine.stats().steps_total >= 1
    assert not engine.healthy()


async def test_reward_model_score(tiny_reward):
    from transformers import AutoModelForSequenceClassification

    loaded = load_model(Settings(model_id=str(tiny_reward)))
    hf = AutoModelForSequenceClassification.from_pretrained(tiny_reward).eval()
    ids = loaded.tokenizer("This answer is helpful and correct.", add_special_tokens=False)["input_ids"]
    async with running(loaded, chunked_prefill_tokens=4) as engine:
        assert engine.info.is_reward_model
        request = GenerationRequest(ids, SamplingParams(), StoppingParams(max_new_tokens=1), score=True)
        result = await generate(engine, request)
    with torch.inference_mode():
        expected = hf(torch.tensor([ids])).logits[0, 0].item()
    assert result.score == pytest.approx(expected, abs=1e-4)
    assert result.sequences[0].token_ids == []


@pytest.mark.parametrize("pool", [1024, 80])
async def test_generic_path_equals_generate(tiny_gpt2, pool):
    loaded = load_model(Settings(model_id=str(tiny_gpt2)))
    assert loaded.kind == "generic"
    hf = AutoModelForCausalLM.from_pretrained(tiny_gpt2).eval()
    ids_list = [loaded.tokenizer(t, add_special_tokens=False)["input_ids"] for t in PROMPT_TEXTS[:4]]
    refs = [hf_greedy(hf, ids, 16) for ids in ids_list]
    async with running(loaded, chunked_prefill_tokens=16, max_batch_total_tokens=pool,
                       waiting_served_ratio=0.0) as engine:
        assert engine.info.runner_kind == "generic"
        handles = [await engine.submit(greedy(ids, max_new=16)) for ids in ids_list]
        results = [await h.result() for h in handles]
        assert engine.stats().used_blocks == 0
        assert engine.runner.batched_decode_steps > 0  # decodes of different lengths ran as one batch
        assert (engine.stats().preemptions_total > 0) == (pool < 100)
    for result, ref in zip(results, refs):
        assert result.sequences[0].token_ids == ref


async def test_grammar_constrains_output(llama):
    import json
    import re

    from opentgi.engine.errors import GrammarError
    from opentgi.engine.request import GrammarSpec

    ids = llama.tokenizer("Give me a code:", add_special_tokens=False)["input_ids"]
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 5},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    async with running(llama) as engine:
        regex = greedy(ids, max_new=40)
        regex.grammar = GrammarSpec("regex", "[0-9]{3}-[a-z]{2}")
        sampled = GenerationRequest(list(ids), SamplingParams(do_sample=True, seed=7),
                                    StoppingParams(max_new_tokens=60), grammar=GrammarSpec("json", json.dumps(schema)))
        r1, r2 = await asyncio.gather(generate(engine, regex), generate(engine, sampled))
        with pytest.raises(GrammarError):
            bad = greedy(ids)
            bad.grammar = GrammarSpec("regex", "([a-z")
            await engine.submit(bad)
    seq = r1.sequences[0]
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", seq.text), seq.text
    assert seq.finish_reason in (FinishReason.GRAMMAR, FinishReason.EOS_TOKEN)
    assert r2.sequences[0].finish_reason is FinishReason.GRAMMAR
    value = json.loads(r2.sequences[0].text)
    assert set(value) == {"name", "age"} and isinstance(value["age"], int)


async def test_watermark_biases_green_tokens(llama, prompts):
    from opentgi.engine.sampling.watermark import detect_watermark

    def request(watermark: bool) -> GenerationRequest:
        return GenerationRequest(list(prompts[1]), SamplingParams(do_sample=True, seed=11, watermark=watermark),
                                 StoppingParams(max_new_tokens=48, ignore_eos=True))

    async with running(llama, watermark_gamma=0.5, watermark_delta=8.0) as engine:
        marked = await generate(engine, request(True))
        plain = await generate(engine, request(False))
    vocab = llama.spec.vocab_size
    last = prompts[1][-1]
    assert detect_watermark(marked.sequences[0].token_ids, vocab, 0.5, last_prompt_token=last).is_watermarked
    assert not detect_watermark(plain.sequences[0].token_ids, vocab, 0.5, last_prompt_token=last).is_watermarked


async def test_model_failure_fails_only_that_step(llama, prompts, monkeypatch):
    from opentgi.engine.errors import GenerationError

    async with running(llama) as engine:
        real = engine.runner.execute
        calls = {"n": 0}

        def flaky(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] == 1:
                raise RuntimeError("boom")
            return real(*args, **kwargs)

        monkeypatch.setattr(engine.runner, "execute", flaky)
        handle = await engine.submit(greedy(prompts[0], max_new=4))
        with pytest.raises(GenerationError, match="boom"):
            await handle.result()
        assert engine.healthy()
        assert engine.stats().used_blocks == 0 and engine.stats().requests_in_flight == 0
        result = await generate(engine, greedy(prompts[0], max_new=4))
        assert result.sequences[0].generated_tokens == 4


async def test_stop_fails_requests_in_flight(llama, prompts):
    from opentgi.engine.errors import UnhealthyError

    engine = Engine(llama, Settings(max_batch_total_tokens=4096))
    await engine.start()
    handle = await engine.submit(greedy(prompts[2], max_new=2000, ignore_eos=True))
    await anext(aiter(handle))
    await engine.stop()
    with pytest.raises(UnhealthyError):
        await handle.result()
    with pytest.raises(UnhealthyError):
        await engine.submit(greedy(prompts[0]))


@pytest.mark.slow
async def test_default_model_greedy_equals_generate(default_model):
    """The real default model (SmolLM2-135M-Instruct): chat prompt, chunked prefill, warm prefix."""
    loaded = default_model(dtype="float32")
    hf = default_model.transformers()
    tok = loaded.tokenizer
    ids = tok.apply_chat_template([{"role": "user", "content": "Name three colours of the rainbow."}],
                                  add_generation_prompt=True, tokenize=True)
    with torch.inference_mode():
        ref = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          max_new_tokens=32, do_sample=False, eos_token_id=loaded.eos_token_ids,
                          pad_token_id=loaded.eos_token_ids[0])[0, len(ids):].tolist()
    async with running(loaded, chunked_prefill_tokens=16) as engine:
        cold = await generate(engine, greedy(ids, max_new=32))
        warm = await generate(engine, greedy(ids, max_new=32))
    assert cold.sequences[0].token_ids == ref
    assert warm.sequences[0].token_ids == ref
    assert "red" in cold.sequences[0].text.lower() or "blue" in cold.sequences[0].text.lower()


async def test_stop_token_ids_min_new_tokens_and_sensitive_words(llama, prompts, references):
    ref = references[3]
    tok = llama.tokenizer
    stop_id = ref[2]
    async with running(llama) as engine:
        stopped = await generate(engine, greedy(prompts[3], stop_token_ids=[stop_id]))
        held = await generate(engine, greedy(prompts[3], stop_token_ids=[stop_id], min_new_tokens=6))
        word = tok.decode(ref[4:6]).strip()
        sensitive = await generate(engine, greedy(prompts[3], sensitive_words=[word]))
    assert stopped.sequences[0].token_ids == ref[:3]
    assert stopped.sequences[0].finish_reason is FinishReason.EOS_TOKEN
    assert stop_id not in held.sequences[0].token_ids[:6]  # masked until min_new_tokens
    seq = sensitive.sequences[0]
    assert seq.finish_reason is FinishReason.SENSITIVE
    assert word not in seq.text
    full_text = tok.decode(ref)
    assert seq.text == full_text[:full_text.index(word)]


async def test_the_engine_bounds_how_far_cached_prefixes_grow_the_cpu_pool(llama, prompts):
    async with running(llama, kv_cache_cpu_prefix_bytes=0) as engine:
        bm = engine.block_manager
        assert bm.cache_growth_limit == 0 < bm.num_blocks
        for p in prompts[:3]:  # one at a time: each reuses the blocks the one before wrote
            await generate(engine, greedy(p, max_new=4))
        longest = max(bm.blocks_for(len(p) + 4) for p in prompts[:3])
        assert bm.num_touched_blocks <= longest + 1
    async with running(llama) as engine:
        assert engine.block_manager.cache_growth_limit == engine.block_manager.num_blocks  # tiny blocks
