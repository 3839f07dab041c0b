"""Attention with soft-capped logits (Gemma 2), which `scaled_dot_product_attention` cannot do,
in a form whose rows do not depend on the rows beside them nor on their masked key padding.

Two matmuls around the capped softmax: the logits (`capped_logits`) in float32, then the
probabilities times the values over keys met in fixed chunks (`SOFTCAP_BF16_KEY_CHUNK` in
bfloat16, `SOFTCAP_KEY_CHUNK` otherwise), the chunks' products summed in order
(tests/models/test_softcap_attention.py).
"""

from __future__ import annotations

import torch

from opentgi.models.layers.elementwise import elementwise_on_padded_copy

SOFTCAP_KEY_CHUNK = 128  # soft-capped attention in float32: keys per matmul of the probabilities and values
# soft-capped attention in bfloat16: keys per matmul of the probabilities and values (oneDNN's
# bfloat16 `bmm` reduces up to 1,024 keys alike whatever their zero padding: tests/models/test_softcap_attention.py)
SOFTCAP_BF16_KEY_CHUNK = 1024


def softcapped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                         scale: float, cap: float) -> torch.Tensor:
    """Attention whose logits are soft-capped, cap * tanh(s * scale / cap), before the mask and the
    softmax (Gemma 2). q [..., n, D], k and v [..., L, D] (the same leading dims, any strides);
    mask additive or bool, broadcast to [..., n, L].

    The capped logits go through a float32 softmax (as transformers'). In bfloat16 the
    probabilities, rounded to bfloat16 as sdpa rounds them, times the values go through oneDNN's
    bfloat16 `bmm` over at most `SOFTCAP_BF16_KEY_CHUNK` keys a matmul, whose reduction gives a row
    the same bits for every key count up to that chunk; the chunks' products are summed in float32
    in order. In other dtypes, the products in float32 over exactly `SOFTCAP_KEY_CHUNK` keys (zero
    padded), summed in order: float32's reduction is otherwise cut differently with the key count.
    Alternatives tried and not adopted (sdpa with the capped logits as its mask, one q.k matmul
    against all kv heads' keys) are in docs/benchmarks.md."""
    *lead, n, d = q.shape
    keys, batch = k.shape[-2], q.numel() // (n * d)
    p = torch.softmax(capped_logits(q, k, mask, scale, cap), dim=-1).reshape(batch, n, keys)
    if v.dtype == torch.bfloat16:
        return _bf16_probs_times_values(p, v.reshape(batch, keys, d)).view(*lead, n, d)
    chunk = SOFTCAP_KEY_CHUNK
    padded = -(-keys // chunk) * chunk
    # the values in float32 and the probabilities, zero padded to whole chunks: each written once
    # (a zero-filled buffer, or F.pad, would write the whole of it twice)
    vp = torch.empty(batch, padded, d, dtype=torch.float32, device=v.device)
    vp.view(*lead, padded, d)[..., :keys, :].copy_(v)  # any strides (a stride-0 expand too), to float32
    if padded != keys:
        vp[:, keys:].zero_()
        p_padded = torch.empty(batch, n, padded, dtype=p.dtype, device=p.device)
        p_padded[..., :keys].copy_(p)
        p = p_padded
        p[..., keys:].zero_()
    chunks = padded // chunk
    if chunks == 1:
        return torch.bmm(p, vp).view(*lead, n, d).to(q.dtype)
    # [batch * chunks, n, chunk] @ [batch * chunks, chunk, d], the chunks' products summed in order
    parts = torch.bmm(p.view(batch, n, chunks, chunk).transpose(1, 2).reshape(-1, n, chunk),
                      vp.view(-1, chunk, d)).view(batch, chunks, n, d)
    out = parts[:, 0].clone()
    for i in range(1, chunks):
        out += parts[:, i]
    return out.view(*lead, n, d).to(q.dtype)


def _bf16_probs_times_values(p: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """float32 probabilities [B, n, L] times bfloat16 values [B, L, D] -> bfloat16 [B, n, D], in
    bfloat16 matmuls over at most SOFTCAP_BF16_KEY_CHUNK keys, their products summed in float32 in
    order (`softcapped_attention`)."""
    p = p.to(torch.bfloat16)
    keys, chunk = p.shape[-1], SOFTCAP_BF16_KEY_CHUNK
    if keys <= chunk:
        return torch.bmm(p, v)
    out = torch.bmm(p[..., :chunk], v[:, :chunk]).float()
    for start in range(chunk, keys, chunk):
        out += torch.bmm(p[..., start:start + chunk], v[:, start:start + chunk])
    return out.to(torch.bfloat16)


def capped_logits(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, scale: float,
                  cap: float) -> torch.Tensor:
    """float32 [..., n, L]: the soft-capped logits plus the mask, up to a constant a row.
    cap * tanh(z) = 2 cap * sigmoid(2 z) - cap, and a softmax ignores a constant added to all its
    logits: 2 cap * sigmoid(2 s * scale / cap), in float32 (a bfloat16 sigmoid near 0.5 would lose
    the logits' precision; sigmoid is cheaper than tanh), the sigmoid over a padded copy
    (models/layers/elementwise.py: a run's scalar tail, the last row's last keys, gets other bits).
    s = q.k in q's dtype (in bfloat16 through oneDNN's `bmm`, cheaper than converting the keys)."""
    *lead, n, d = q.shape
    keys, batch = k.shape[-2], q.numel() // (n * d)
    s = torch.bmm(q.reshape(batch, n, d), k.reshape(batch, keys, d).transpose(1, 2)).view(*lead, n, keys)
    logits = elementwise_on_padded_copy(s, lambda run: run.mul_(2 * scale / cap).sigmoid_(), dtype=torch.float32)
    logits.mul_(2 * cap)
    if mask is not None and mask.dtype == torch.bool:
        return logits.masked_fill_(~mask, float("-inf"))
    if mask is not None:
        return logits.add_(mask)  # the mask broadcast to the logits' shape
    return logits
