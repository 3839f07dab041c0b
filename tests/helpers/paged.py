"""A paged model without the engine: a minimal runner over block tables, and the prompt the model tests share."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from opentgi.models.attention.metadata import AttentionMetadata
from opentgi.models.attention.torch_backend import TorchAttentionBackend
from opentgi.models.registry import build_paged_model

BLOCK_SIZE, NUM_BLOCKS = 16, 48


class PagedRunner:
    """A minimal model runner: contiguous-free block tables (reversed order), metadata per step;
    the caches in `kv_dtype` (default: the model's)."""

    def __init__(self, model, kv_dtype: torch.dtype | None = None):
        self.model = model
        spec = model.spec
        shape = (NUM_BLOCKS, BLOCK_SIZE, spec.num_kv_heads, spec.head_dim)
        dtype = kv_dtype or spec.dtype
        self.kv_caches = [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
                          for _ in range(spec.num_layers)]
        self.free = list(reversed(range(NUM_BLOCKS)))
        self.tables: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}

    def step(self, new_tokens: dict[int, list[int]], prompt: dict[int, int] | None = None) -> torch.Tensor:
        """Feed each sequence its new tokens; return the hidden state of each one's last token.
        `prompt`: how many of a sequence's new tokens are prompt tokens (the metadata's
        prompt_new_tokens; none told without it)."""
        ids, positions, slots, q_lens, ctx = [], [], [], [], []
        for seq, tokens in new_tokens.items():
            table = self.tables.setdefault(seq, [])
            start = self.lengths.get(seq, 0)
            end = start + len(tokens)
            while len(table) * BLOCK_SIZE < end:
                table.append(self.free.pop())
            ids += tokens
            positions += range(start, end)
            slots += [table[t // BLOCK_SIZE] * BLOCK_SIZE + t % BLOCK_SIZE for t in range(start, end)]
            q_lens.append(len(tokens))
            ctx.append(end)
            self.lengths[seq] = end
        width = max(len(self.tables[s]) for s in new_tokens)
        tables = torch.full((len(new_tokens), width), -1, dtype=torch.int32)
        for i, seq in enumerate(new_tokens):
            tables[i, :len(self.tables[seq])] = torch.tensor(self.tables[seq])
        cu_q = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots), cu_seqlens_q=cu_q,
            cu_seqlens_k=torch.tensor([0] + ctx).cumsum(0).to(torch.int32),
            max_seqlen_q=max(q_lens), max_seqlen_k=max(ctx),
            context_lens=torch.tensor(ctx, dtype=torch.int32), block_tables=tables,
            decode_only=all(n == 1 for n in q_lens),
            prompt_new_tokens=None if prompt is None else [prompt.get(seq, 0) for seq in new_tokens])
        hidden = self.model(torch.tensor(ids), torch.tensor(positions), meta, self.kv_caches)
        return hidden[(cu_q[1:] - 1).long()]


def load_paged(path):
    config = AutoConfig.from_pretrained(path)
    return build_paged_model(path, config, TorchAttentionBackend(), torch.float32, torch.device("cpu"))


def hf_logits(path, prompt):
    hf = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([prompt])).logits[0].float()


PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411,
          407, 19712, 8182, 2, 198, 1, 4093, 198, 6004, 2, 198, 1, 520, 9531, 198, 504, 3000, 42, 17]
