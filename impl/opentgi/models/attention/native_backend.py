"""The native CPU attention backend: decode rows through one native kernel call per layer
(`opentgi::paged_attention`, kernels/csrc/attention.h), everything else as the torch backend.

Every token the torch backend attends in the decode row's form (decode rows; with batch invariance
also the generated tokens of rows of several tokens, and prompt tokens where the prompt form is
off; speculative verify tokens) goes to the kernel instead (`make_plan(native=True)`), all of them
in one call: queries [rows, heads, D] against keys and values read in place from the paged cache
through the block table (no gathers), each kv head's keys read once for its query heads, a float32
online softmax over the row's cache blocks in position order, sliding windows and soft-capping in
the kernel. A row's result depends on nothing but its own keys, so it is batch-invariant by
construction: not on the other rows, their padding, or the thread count; the call runs on all of
torch's intra-op threads.

Prompt tokens (where the backend is told them: batch invariance with the prompt form) go to
`opentgi::prompt_attention` in one call per layer: a sequence's consecutive prompt tokens in tiles
that share each unit of 64 keys, read in place and transposed once for all the tile's query heads;
a token's bits depend only on its own query, keys and values, so they are the same however the
prompt was split (chunks, a prefix-cache tail), and its form still follows its kind
(docs/determinism.md). Other prompt tokens keep the torch backend's forms.
"""

from __future__ import annotations

import torch

from opentgi.kernels import native
from opentgi.models.attention.backend import write_kv_cache
from opentgi.models.attention.metadata import AttentionMetadata
from opentgi.models.attention.torch_backend import TorchAttentionBackend, one_thread
from opentgi.models.attention.torch_plan import make_plan


class NativeAttentionBackend(TorchAttentionBackend):
    name = "native"

    def __init__(self, isa: str | None = None):
        self.isa = isa  # None: the best the loaded library has on this CPU

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                sliding_window: int | None = None, softcap: float | None = None) -> torch.Tensor:
        if q.dtype not in (torch.float32, torch.bfloat16):  # the kernel's query dtypes; float16: torch's
            return super().forward(q, k, v, k_cache, v_cache, meta, scale, sliding_window, softcap)
        group = q.shape[1] // k.shape[1]
        plan_key = ("native", sliding_window, q.dtype, group)
        plan = meta.scratch.get(plan_key)
        if plan is None:
            plan = meta.scratch[plan_key] = make_plan(meta, k_cache.shape[1], sliding_window, q.dtype, group,
                                                       self.batch_invariant, self.prompt_form, native=True)
        write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping, plan.has_skips)
        if plan.tails is not None:  # the torch forms attend whole blocks, masked (torch_backend.py)
            k_cache.view(-1, *k_cache.shape[2:]).index_fill_(0, plan.tails, 0)
            v_cache.view(-1, *v_cache.shape[2:]).index_fill_(0, plan.tails, 0)
        out = None
        for rows, attend in ((plan.native_prompt, native.prompt_attention), (plan.native, native.paged_attention)):
            if rows is None:
                continue
            q_rows = q if rows.in_order else q.index_select(0, rows.tokens)
            o = attend(q_rows, k_cache, v_cache, rows.block_tables, rows.seq, rows.ctx, scale, sliding_window,
                       softcap, self.isa)
            if rows.in_order:
                return o
            out = torch.empty_like(q) if out is None else out
            out.index_copy_(0, rows.tokens, o)
        with one_thread(self.batch_invariant and q.dtype == torch.float32):
            return self._attend_plan(q, k, v, k_cache, v_cache, plan, scale, group, softcap, out)
