"""The flash-attn backend, run on CPU against a plain-torch reference of flash-attn's functions.

`tests/helpers/flash_attn_reference.py` is installed as the `flash_attn` module, so the real
`opentgi.models.attention.flash_backend` runs unchanged: its calls, argument types and cache
layout are checked as flash-attn would check them, and its outputs against naive attention over
contiguous keys. The reference itself is checked against flash-attn's documented masks and
against the torch backend.
"""

from __future__ import annotations

import importlib
import math
import random
import sys
from types import SimpleNamespace

import pytest
import torch

from opentgi.engine.execution.model_runner import ModelRunner
from opentgi.models.attention.metadata import AttentionMetadata
from opentgi.models.attention.torch_backend import TorchAttentionBackend
from tests.helpers import flash_attn_reference as ref

BLOCK, NUM_BLOCKS, HEADS, KV_HEADS, DIM = 256, 12, 4, 2, 16
DTYPE = torch.bfloat16


@pytest.fixture
def flash_backend(monkeypatch):
    """The real flash_backend module, imported with the reference standing in for flash_attn."""
    monkeypatch.setitem(sys.modules, "flash_attn", ref)
    monkeypatch.delitem(sys.modules, "opentgi.models.attention.flash_backend", raising=False)
    module = importlib.import_module("opentgi.models.attention.flash_backend")
    yield module
    sys.modules.pop("opentgi.models.attention.flash_backend", None)


def naive(q, keys, values, window=None):
    """q [n, H, D] at the last n positions of keys/values [ctx, Hkv, D], float32."""
    n, ctx = q.shape[0], keys.shape[0]
    group = q.shape[1] // keys.shape[1]
    keys = keys.float().repeat_interleave(group, dim=1)
    values = values.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), keys) / math.sqrt(q.shape[2])
    q_pos = torch.arange(ctx - n, ctx)[:, None]
    k_pos = torch.arange(ctx)[None, :]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= k_pos > q_pos - window
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(~allowed, float("-inf")).softmax(-1), values)


class Paged:
    """Sequences in a paged cache of 256-token blocks (scattered), with their keys kept contiguously
    too; `pad` fills block tables as the model runner does on CUDA (0)."""

    def __init__(self, seed: int, dtype=DTYPE, pad: int = 0):
        self.rng = random.Random(seed)
        torch.manual_seed(seed)
        self.free = list(range(NUM_BLOCKS))
        self.rng.shuffle(self.free)
        self.dtype, self.pad = dtype, pad
        self.k_cache = torch.zeros(NUM_BLOCKS, BLOCK, KV_HEADS, DIM, dtype=dtype)
        self.v_cache = torch.zeros_like(self.k_cache)
        self.tables: list[list[int]] = []
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def add(self, shared_prefix_of: int | None = None, shared_blocks: int = 0) -> int:
        """A new sequence; with `shared_prefix_of`, its first `shared_blocks` blocks are another
        sequence's (a prefix-cache hit: those keys are already in the cache)."""
        if shared_prefix_of is None:
            self.tables.append([])
            self.keys.append(torch.zeros(0, KV_HEADS, DIM, dtype=self.dtype))
            self.values.append(torch.zeros(0, KV_HEADS, DIM, dtype=self.dtype))
        else:
            n = shared_blocks * BLOCK
            self.tables.append(self.tables[shared_prefix_of][:shared_blocks])
            self.keys.append(self.keys[shared_prefix_of][:n].clone())
            self.values.append(self.values[shared_prefix_of][:n].clone())
        return len(self.tables) - 1

    def step(self, new_lens: dict[int, int], window=None, skip_first: int = 0):
        """One step where sequence s gets new_lens[s] tokens: (q, k, v, meta, expected).
        `skip_first`: the first sequence's first new tokens get slot -1 (already cached)."""
        seqs = list(new_lens)
        qs, ks, vs, slots, expected = [], [], [], [], []
        for i, s in enumerate(seqs):
            n = new_lens[s]
            start = self.keys[s].shape[0]
            while len(self.tables[s]) * BLOCK < start + n:
                self.tables[s].append(self.free.pop())
            q = torch.randn(n, HEADS, DIM).to(self.dtype)
            k = torch.randn(n, KV_HEADS, DIM).to(self.dtype)
            v = torch.randn(n, KV_HEADS, DIM).to(self.dtype)
            self.keys[s] = torch.cat([self.keys[s], k])
            self.values[s] = torch.cat([self.values[s], v])
            qs.append(q), ks.append(k), vs.append(v)
            row = [self.tables[s][t // BLOCK] * BLOCK + t % BLOCK for t in range(start, start + n)]
            if i == 0 and skip_first:
                for t in range(skip_first):  # write them ourselves: the step must leave them alone
                    flat = row[t]
                    self.k_cache.view(-1, KV_HEADS, DIM)[flat] = k[t]
                    self.v_cache.view(-1, KV_HEADS, DIM)[flat] = v[t]
                    row[t] = -1
            slots += row
            expected.append(naive(q, self.keys[s], self.values[s], window))
        ctx = [self.keys[s].shape[0] for s in seqs]
        q_lens = [new_lens[s] for s in seqs]
        width = max(len(self.tables[s]) for s in seqs)
        tables = torch.full((len(seqs), width), self.pad, dtype=torch.int32)
        for i, s in enumerate(seqs):
            tables[i, :len(self.tables[s])] = torch.tensor(self.tables[s])
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            cu_seqlens_q=torch.tensor([0] + q_lens).cumsum(0).to(torch.int32),
            cu_seqlens_k=torch.tensor([0] + ctx).cumsum(0).to(torch.int32),
            max_seqlen_q=max(q_lens), max_seqlen_k=max(ctx),
            context_lens=torch.tensor(ctx, dtype=torch.int32), block_tables=tables,
            decode_only=all(n == 1 for n in q_lens))
        return torch.cat(qs), torch.cat(ks), torch.cat(vs), meta, torch.cat(expected)


def run(backend, paged: Paged, step, window=None):
    q, k, v, meta, expected = step
    out = backend.forward(q, k, v, paged.k_cache, paged.v_cache, meta, DIM ** -0.5, window)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)
    return out


def calls(monkeypatch, module) -> list[str]:
    """Record which flash-attn function each forward reaches."""
    seen: list[str] = []
    for name in ("flash_attn_varlen_func", "flash_attn_with_kvcache"):
        real = getattr(module, name)

        def spy(*args, _name=name, _real=real, **kwargs):
            seen.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(module, name, spy)
    return seen


# --- the reference against flash-attn's documentation -------------------------------------------

def _visible(lq: int, lk: int, causal=True, window=(-1, -1)) -> list[list[int]]:
    """Which keys each query sees, read back from the reference's output with one-hot values."""
    q = torch.zeros(lq, 1, 8, dtype=DTYPE)
    keys = torch.zeros(lk, 1, 8, dtype=DTYPE)  # equal scores: output = mean of the visible values
    values = torch.zeros(lk, 1, 8, dtype=DTYPE)
    cu_q, cu_k = torch.tensor([0, lq], dtype=torch.int32), torch.tensor([0, lk], dtype=torch.int32)
    rows = []
    for j in range(lk):
        values.zero_()
        values[j, 0, 0] = 1
        out = ref.flash_attn_varlen_func(q, keys, values, cu_q, cu_k, lq, lk, causal=causal,
                                         window_size=window)
        rows.append([int(out[i, 0, 0] > 0) for i in range(lq)])
    return [list(r) for r in zip(*rows)]


def test_reference_masks_are_flash_attns_documented_bottom_right_causal_masks():
    assert _visible(2, 5) == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    assert _visible(5, 2) == [[0, 0], [0, 0], [0, 0], [1, 0], [1, 1]]  # all-masked rows are zeros
    # window: query i sees [i + lk - lq - left, i + lk - lq + right]
    assert _visible(2, 5, causal=False, window=(1, 0)) == [[0, 0, 1, 1, 0], [0, 0, 0, 1, 1]]
    assert _visible(1, 4, causal=False, window=(0, -1)) == [[0, 0, 0, 1]]


def test_reference_refuses_what_flash_attn_refuses():
    q = torch.randn(4, HEADS, DIM, dtype=DTYPE)
    cache = torch.zeros(2, BLOCK, KV_HEADS, DIM, dtype=DTYPE)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    table = torch.tensor([[0]], dtype=torch.int32)
    ok = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=4, max_seqlen_k=4, causal=True, block_table=table)
    ref.flash_attn_varlen_func(q, cache, cache, **ok)
    bad = [
        ((q.float(), cache.float(), cache.float()), {}, "fp16 and bf16"),
        ((q, cache.half(), cache.half()), {}, "same dtype"),
        ((q, cache, cache), {"block_table": table.long()}, "int32"),
        ((q, cache, cache), {"cu_seqlens_k": cu.long()}, "int32"),
        ((q, cache[:, :16], cache[:, :16]), {}, "divisible by 256"),
        ((q, cache, cache), {"max_seqlen_q": 3}, "max_seqlen_q"),
        ((q, cache, cache), {"block_table": torch.tensor([[5]], dtype=torch.int32)}, "outside the cache"),
        ((torch.randn(4, 3, DIM, dtype=DTYPE), cache, cache), {}, "divide"),
    ]
    for args, change, message in bad:
        with pytest.raises(ref.FlashAttnCallError, match=message):
            ref.flash_attn_varlen_func(*args, **{**ok, **change})
    with pytest.raises(ref.FlashAttnCallError, match="int32"):
        ref.flash_attn_with_kvcache(q[:1].unsqueeze(1), cache, cache, cache_seqlens=torch.tensor([3]),
                                    block_table=table, causal=True)
    with pytest.raises(NotImplementedError):
        ref.flash_attn_with_kvcache(q[:1].unsqueeze(1), cache, cache, k=q[:1, :2].unsqueeze(1))


@pytest.mark.parametrize(("window", "softcap"), [(None, None), (48, None), (48, 1.5)])
def test_reference_matches_the_torch_backend(window, softcap):
    """Same paged inputs (float32 for the torch backend, bf16 for the reference): prefill chunks,
    a prefix-cache hit and decodes of different lengths agree, with soft-capped logits too (Gemma 2)."""
    paged = Paged(seed=1, dtype=torch.float32, pad=-1)
    a = paged.add()
    backend = TorchAttentionBackend()
    steps = [{a: 300}, {a: 90}]
    for new_lens in steps:
        q, k, v, meta, _ = paged.step(new_lens, window)
        expected = backend.forward(q, k, v, paged.k_cache, paged.v_cache, meta, 0.3, window, softcap)
        w = (window - 1, 0) if window else (-1, -1)
        got = ref.flash_attn_varlen_func(
            q.to(DTYPE), paged.k_cache.to(DTYPE), paged.v_cache.to(DTYPE), meta.cu_seqlens_q,
            meta.cu_seqlens_k, meta.max_seqlen_q, meta.max_seqlen_k, softmax_scale=0.3, causal=True,
            window_size=w, softcap=softcap or 0.0, block_table=meta.block_tables.clamp(min=0))
        torch.testing.assert_close(got.float(), expected, atol=2e-2, rtol=2e-2)
    b = paged.add(shared_prefix_of=a, shared_blocks=1)
    c = paged.add()
    for new_lens in ({b: 40, c: 20}, {a: 1, b: 1, c: 1}):
        q, k, v, meta, _ = paged.step(new_lens, window)
        expected = backend.forward(q, k, v, paged.k_cache, paged.v_cache, meta, 0.3, window, softcap)
        w = (window - 1, 0) if window else (-1, -1)
        if meta.decode_only:
            got = ref.flash_attn_with_kvcache(
                q.to(DTYPE).unsqueeze(1), paged.k_cache.to(DTYPE), paged.v_cache.to(DTYPE),
                cache_seqlens=meta.context_lens, block_table=meta.block_tables.clamp(min=0),
                softmax_scale=0.3, causal=True, window_size=w, softcap=softcap or 0.0).squeeze(1)
        else:
            got = ref.flash_attn_varlen_func(
                q.to(DTYPE), paged.k_cache.to(DTYPE), paged.v_cache.to(DTYPE), meta.cu_seqlens_q,
                meta.cu_seqlens_k, meta.max_seqlen_q, meta.max_seqlen_k, softmax_scale=0.3,
                causal=True, window_size=w, softcap=softcap or 0.0, block_table=meta.block_tables.clamp(min=0))
        torch.testing.assert_close(got.float(), expected, atol=2e-2, rtol=2e-2)


def test_soft_capping_changes_attention():
    """The cap is applied (a test of the test above: with a small cap the output moves)."""
    paged = Paged(seed=1, dtype=torch.float32, pad=-1)
    a = paged.add()
    q, k, v, meta, _ = paged.step({a: 40})
    backend = TorchAttentionBackend()
    plain = backend.forward(q, k, v, paged.k_cache, paged.v_cache, meta, 0.3)
    capped = backend.forward(q, k, v, paged.k_cache, paged.v_cache, _fresh(meta), 0.3, None, 0.5)
    assert (plain - capped).abs().max() > 1e-2


def test_flash_backend_passes_softcap_and_window(flash_backend):
    """The flash backend hands soft-capping and the window to both flash-attn calls: its output
    equals the torch backend's on the same steps (a chunk, then decodes)."""
    backend, torch_backend = flash_backend.FlashAttentionBackend(), TorchAttentionBackend()
    paged = Paged(seed=4)
    a = paged.add()
    for new_lens in ({a: 300}, {a: 1}, {a: 1}):
        q, k, v, meta, _ = paged.step(new_lens, 64)
        got = backend.forward(q, k, v, paged.k_cache, paged.v_cache, meta, 0.3, 64, 2.0)
        want = torch_backend.forward(q.float(), k.float(), v.float(), paged.k_cache.float(),
                                     paged.v_cache.float(), _fresh(meta), 0.3, 64, 2.0)
        torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


def _fresh(meta):
    """The same step's metadata without the other backend's scratch."""
    return AttentionMetadata(**{f: getattr(meta, f) for f in (
        "slot_mapping", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "context_lens",
        "block_tables", "decode_only")})


# --- the real flash backend on the reference ------------------------------------------------------

@pytest.mark.parametrize("window", [None, 100])
def test_prefill_chunks_then_decodes_cross_block_boundaries(flash_backend, monkeypatch, window):
    backend = flash_backend.FlashAttentionBackend()
    seen = calls(monkeypatch, flash_backend)
    paged = Paged(seed=2)
    a = paged.add()
    run(backend, paged, paged.step({a: 200}, window), window)  # first chunk
    run(backend, paged, paged.step({a: 150}, window), window)  # second chunk crosses block 0 -> 1
    assert seen == ["flash_attn_varlen_func"] * 2
    for _ in range(3):
        run(backend, paged, paged.step({a: 1}, window), window)
    assert seen[2:] == ["flash_attn_with_kvcache"] * 3


def test_prefix_cache_hit_reads_the_shared_blocks(flash_backend):
    backend = flash_backend.FlashAttentionBackend()
    paged = Paged(seed=3)
    a = paged.add()
    run(backend, paged, paged.step({a: 2 * BLOCK + 10}))
    b = paged.add(shared_prefix_of=a, shared_blocks=2)  # 512 tokens cached, its own tail to compute
    run(backend, paged, paged.step({b: 30}))
    run(backend, paged, paged.step({a: 1, b: 1}))  # decode both: shared blocks, different tails


@pytest.mark.parametrize("window", [None, 64])
def test_mixed_batch_of_decodes_and_prefill_chunks(flash_backend, monkeypatch, window):
    backend = flash_backend.FlashAttentionBackend()
    seen = calls(monkeypatch, flash_backend)
    paged = Paged(seed=4)
    a, b = paged.add(), paged.add()
    run(backend, paged, paged.step({a: 270, b: 5}, window), window)
    c = paged.add()
    run(backend, paged, paged.step({a: 1, c: 300, b: 1}, window), window)  # decodes beside a chunk
    run(backend, paged, paged.step({c: 1, a: 1, b: 1}, window), window)  # lengths 301, 272, 7
    assert seen == ["flash_attn_varlen_func", "flash_attn_varlen_func", "flash_attn_with_kvcache"]


def test_slots_marked_minus_one_are_not_written(flash_backend):
    backend = flash_backend.FlashAttentionBackend()
    paged = Paged(seed=5)
    a = paged.add()
    run(backend, paged, paged.step({a: 40}, skip_first=10))
    run(backend, paged, paged.step({a: 1}))


def test_paged_model_on_flash_backend_matches_the_torch_backend(flash_backend):
    """The whole paged model through the engine's ModelRunner (its tensors, dtypes and padding),
    bfloat16: flash backend (block size 256) against the torch backend (block size 16), on a
    Mistral whose sliding window (128) the prompt outgrows."""
    from transformers import AutoConfig

    from opentgi.models.registry import build_paged_model
    from tests.helpers.tiny_models import tiny_mistral_path

    tiny_mistral = tiny_mistral_path(sliding_window=128)
    config = AutoConfig.from_pretrained(tiny_mistral)
    runners = []
    for backend, block_size in ((flash_backend.FlashAttentionBackend(), 256), (TorchAttentionBackend(), 16)):
        model = build_paged_model(tiny_mistral, config, backend, torch.bfloat16, torch.device("cpu"))
        runners.append(ModelRunner(model, num_blocks=4096 // block_size, block_size=block_size))
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 4000) for _ in range(n)] for n in (300, 20)]
    seqs = [[SimpleNamespace(token_ids=list(p), num_computed_tokens=0, num_prompt_tokens=len(p),
                             block_table=[], draft_token_ids=[]) for p in prompts]
            for _ in runners]
    plan = [[200, 20], [100, 1], [1, 1], [1, 1]]  # chunked prefill, then a mixed step, then decodes
    for step in plan:
        logits = []
        for runner, rows in zip(runners, seqs):
            for seq, n in zip(rows, step):
                need = seq.num_computed_tokens + n
                while len(seq.block_table) * runner.block_size < need:
                    seq.block_table.append(len(seq.block_table) * 2 + (seq is rows[1]))  # interleaved
            out = runner.execute(rows, step, sample_rows=[0, 1])
            logits.append(out.sample_logits.float())
            for seq, n in zip(rows, step):
                seq.num_computed_tokens += n
        torch.testing.assert_close(logits[0], logits[1], atol=0.1, rtol=0.05)
        next_tokens = logits[0].argmax(-1).tolist()
        for rows in seqs:
            for seq, n, tok in zip(rows, step, next_tokens):
                if seq.num_computed_tokens == len(seq.token_ids):
                    seq.token_ids.append(tok)
