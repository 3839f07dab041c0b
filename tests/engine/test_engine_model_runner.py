"""The paged model runner's step tensors (the attention interface's contract) and KV sizing."""

from __future__ import annotations

import pytest
import torch

from opentgi.config import Settings
from opentgi.engine.execution.kv_cache import bytes_per_block, kv_cache_dtype, num_kv_blocks
from opentgi.engine.execution.model_runner import ModelRunner
from opentgi.engine.output.stop_checker import StopChecker
from opentgi.engine.request import GenerationRequest, SamplingParams, StoppingParams
from opentgi.engine.scheduling.sequence import Sequence
from opentgi.models.base import ModelSpec

SPEC = ModelSpec(architecture="Fake", num_layers=2, num_kv_heads=2, head_dim=4, vocab_size=50,
                 max_position_embeddings=128, dtype=torch.float32, device=torch.device("cpu"))


class FakeModel:
    """Records what the runner passes; hidden state = the position (so logits rows are traceable)."""

    spec = SPEC

    def forward(self, input_ids, positions, attn, kv_caches):
        self.seen = (input_ids, positions, attn, kv_caches)
        return positions.float().unsqueeze(1).repeat(1, 3)

    def compute_logits(self, hidden):
        return hidden[:, :1].repeat(1, SPEC.vocab_size)


def make_seq(tokens, computed, table) -> Sequence:
    req = GenerationRequest(list(tokens), SamplingParams(), StoppingParams(max_new_tokens=4))
    seq = Sequence(req, 0, seed=None, detokenizer=None, stop_checker=StopChecker(req.stopping, [], 99),
                   processors=[])
    seq.num_computed_tokens = computed
    seq.block_table = list(table)
    return seq


def test_step_tensors():
    runner = ModelRunner(FakeModel(), num_blocks=8, block_size=4)
    assert len(runner.kv_caches) == 2 and runner.kv_caches[0][0].shape == (8, 4, 2, 4)
    decode = make_seq(range(10, 16), computed=5, table=[3, 6])  # one new token at position 5
    chunk = make_seq(range(20, 31), computed=4, table=[1, 2, 7])  # positions 4..9 of 11
    out = runner.execute([decode, chunk], [1, 6], sample_rows=[0], logit_rows=[1])
    input_ids, positions, attn, _ = runner.model.seen
    assert input_ids.tolist() == [15, 24, 25, 26, 27, 28, 29]
    assert positions.tolist() == [5, 4, 5, 6, 7, 8, 9]
    assert attn.slot_mapping.tolist() == [6 * 4 + 1, 2 * 4 + 0, 2 * 4 + 1, 2 * 4 + 2, 2 * 4 + 3, 7 * 4 + 0, 7 * 4 + 1]
    assert attn.cu_seqlens_q.tolist() == [0, 1, 7]
    assert attn.cu_seqlens_k.tolist() == [0, 6, 16]
    assert attn.context_lens.tolist() == [6, 10]
    assert attn.block_tables.tolist() == [[3, 6, -1], [1, 2, 7]]
    assert (attn.max_seqlen_q, attn.max_seqlen_k, attn.decode_only) == (6, 10, False)
    assert attn.block_tables.dtype == torch.int32 and attn.slot_mapping.dtype == torch.int64
    assert out.sample_logits[:, 0].tolist() == [5.0]  # the decode row's last (only) position
    assert out.position_logits[1][:, 0].tolist() == [4.0, 5.0, 6.0, 7.0, 8.0, 9.0]


def test_kv_pool_sizing():
    per_block = bytes_per_block(SPEC, 16)
    assert per_block == 2 * 2 * 16 * 2 * 4 * 4
    assert num_kv_blocks(Settings(max_batch_total_tokens=100), SPEC, 16) == 7  # rounded up
    assert num_kv_blocks(Settings(kv_cache_cpu_bytes=per_block * 10), SPEC, 16) == 10
    # a budget larger than any use is trimmed to every concurrent request at full context
    assert num_kv_blocks(Settings(kv_cache_cpu_bytes=per_block * 10_000), SPEC, 16, max_useful_tokens=320) == 20


def test_kv_cache_dtype_auto_and_chosen():
    """auto: float16 where the model computes in float32 on CPU, else the model's dtype; another
    dtype than the model's only on CPU; the pool is allocated and sized in it."""
    bf16 = ModelSpec(**{**SPEC.__dict__, "dtype": torch.bfloat16})
    cuda = ModelSpec(**{**SPEC.__dict__, "dtype": torch.bfloat16, "device": torch.device("cuda")})
    assert kv_cache_dtype(Settings(), SPEC) == torch.float16
    assert kv_cache_dtype(Settings(), bf16) == torch.bfloat16 and kv_cache_dtype(Settings(), cuda) == torch.bfloat16
    assert kv_cache_dtype(Settings(kv_cache_dtype="float32"), SPEC) == torch.float32
    assert kv_cache_dtype(Settings(kv_cache_dtype="float16"), bf16) == torch.float16
    with pytest.raises(ValueError, match="on cuda the KV cache is in the model's dtype"):
        kv_cache_dtype(Settings(kv_cache_dtype="float16"), cuda)
    with pytest.raises(ValueError, match="got 'int8'"):
        kv_cache_dtype(Settings(kv_cache_dtype="int8"), SPEC)

    class HalfCacheModel(FakeModel):
        spec = ModelSpec(**{**SPEC.__dict__, "kv_cache_dtype": torch.float16})

    runner = ModelRunner(HalfCacheModel(), num_blocks=8, block_size=4)
    assert {c.dtype for pair in runner.kv_caches for c in pair} == {torch.float16}
    assert bytes_per_block(HalfCacheModel.spec, 16) * 2 == bytes_per_block(SPEC, 16)  # twice the tokens a budget
    assert num_kv_blocks(Settings(kv_cache_cpu_bytes=bytes_per_block(SPEC, 16) * 10), HalfCacheModel.spec, 16) == 20


def _resident_fraction(t: torch.Tensor) -> float:
    """The share of the tensor's memory pages that are in RAM now (mincore)."""
    import ctypes
    import mmap

    page = mmap.PAGESIZE
    start = t.data_ptr() // page * page
    pages = -(-(t.data_ptr() + t.numel() * t.element_size() - start) // page)
    vec = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(pages * page), vec) == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec) / pages


def test_cpu_kv_pool_is_zero_and_resident_only_where_written():
    from opentgi.engine.execution.kv_cache import allocate_kv_caches

    spec = ModelSpec(architecture="LlamaForCausalLM", num_layers=4, num_kv_heads=2, head_dim=64, vocab_size=32,
                     max_position_embeddings=128, dtype=torch.bfloat16, device=torch.device("cpu"))
    caches = allocate_kv_caches(spec, num_blocks=1024, block_size=16)  # 4 x 2 x 4 MiB = 32 MiB
    assert len(caches) == 4 and caches[0][0].shape == (1024, 16, 2, 64) and caches[3][1].dtype == torch.bfloat16
    # no page is resident before a block is written: the pool costs memory only for blocks in use
    assert all(_resident_fraction(c) == 0.0 for pair in caches for c in pair)
    k, v = caches[2]
    k[:64] = 1.0  # 64 of 1024 blocks
    assert 0.05 < _resident_fraction(k) < 0.1 and _resident_fraction(v) == 0.0
    assert k.data_ptr() != v.data_ptr() and not bool(k[64:].any()) and not bool(v.any())
    assert bool(k[5].all()) and not bool(caches[1][0][5].any())


def test_cached_prefixes_may_grow_the_resident_cpu_pool_by_a_budget_only():
    from opentgi.config import Settings
    from opentgi.engine.execution.kv_cache import bytes_per_block, cache_growth_limit

    spec = ModelSpec(architecture="LlamaForCausalLM", num_layers=16, num_kv_heads=8, head_dim=64, vocab_size=32,
                     max_position_embeddings=128, dtype=torch.bfloat16, device=torch.device("cpu"))
    assert bytes_per_block(spec, 16) == 512 << 10  # a 1B Llama: 32 KiB a token
    assert cache_growth_limit(Settings(), spec, 16, num_blocks=4096) == 256  # 128 MiB: 4,096 tokens
    assert cache_growth_limit(Settings(kv_cache_cpu_prefix_bytes=1 << 20), spec, 16, 4096) == 2
    assert cache_growth_limit(Settings(), spec, 16, num_blocks=100) == 100
    on_gpu = ModelSpec(**{**spec.__dict__, "device": torch.device("cuda")})  # resident from the start
    assert cache_growth_limit(Settings(), on_gpu, 16, num_blocks=4096) == 4096
