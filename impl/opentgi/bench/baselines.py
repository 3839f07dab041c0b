"""In-process baselines on the served model: serial transformers `generate`, and a bare loop of the
paged model's own forward with its KV cache (no scheduler, no sampler, no HTTP)."""

from __future__ import annotations

import time
from pathlib import Path


def hf_serial_generate(folder: Path, tokenizer, prompts: list[str], new_tokens: int) -> tuple[float, int]:
    """(tokens/s, tokens) of transformers `generate`, one request after the other, greedy."""
    import torch

    from opentgi.models.loader import load_transformers_model

    model = load_transformers_model(folder, torch.float32)
    eos = model.generation_config.eos_token_id
    tokens = 0
    started = time.perf_counter()
    with torch.inference_mode():
        for prompt in prompts:
            ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                 do_sample=False, eos_token_id=eos, pad_token_id=tokenizer.eos_token_id)
            tokens += out.shape[1] - ids.shape[1]
    return tokens / (time.perf_counter() - started), tokens


def bare_forward_loop(loaded, tokenizer, prompt: str, new_tokens: int) -> float:
    """Decode tokens/s of the paged model's forward + greedy argmax in a plain loop."""
    import torch

    from opentgi.engine.execution.kv_cache import allocate_kv_caches
    from opentgi.engine.scheduling.block_manager import BlockManager
    from opentgi.models.attention.metadata import AttentionMetadata

    model, spec = loaded.model, loaded.spec
    block_size = loaded.block_size
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    total = len(ids) + new_tokens
    num_blocks = BlockManager(1, block_size).blocks_for(total)
    kv = allocate_kv_caches(spec, num_blocks, block_size)
    device = torch.device(spec.device)
    table = torch.arange(num_blocks, dtype=torch.int32, device=device).unsqueeze(0)

    def meta(start: int, n: int) -> AttentionMetadata:
        i32 = {"dtype": torch.int32, "device": device}
        return AttentionMetadata(
            slot_mapping=torch.arange(start, start + n, dtype=torch.int64, device=device),
            cu_seqlens_q=torch.tensor([0, n], **i32), cu_seqlens_k=torch.tensor([0, start + n], **i32),
            max_seqlen_q=n, max_seqlen_k=start + n, context_lens=torch.tensor([start + n], **i32),
            block_tables=table, decode_only=n == 1)

    with torch.inference_mode():
        hidden = model.forward(torch.tensor(ids, device=device), torch.arange(len(ids), device=device),
                               meta(0, len(ids)), kv)
        token = model.compute_logits(hidden[-1:]).argmax(-1)
        started = time.perf_counter()
        for pos in range(len(ids), total - 1):
            hidden = model.forward(token, torch.tensor([pos], device=device), meta(pos, 1), kv)
            token = model.compute_logits(hidden).argmax(-1)
            int(token)  # the engine needs the token on the host each step too
        elapsed = time.perf_counter() - started
    return (new_tokens - 1) / elapsed
