"""Which matmul path serves (`--kernels auto|native|torch`), and the native op itself.

`load(mode)` builds or finds the library (build.py) and loads it into torch once per process,
logging one line: what was built or loaded and how long it took, or why the torch path serves.
`gguf_mm(x, blocks, qtype, out_features)` multiplies float32 or bfloat16 rows by a weight held as
the GGUF's own blocks (uint8 [N, row bytes]; or dense rows of float32, float16 or bfloat16 values
viewed as bytes: DENSE_TYPES); it is the torch op `opentgi::gguf_mm`, with a fake
(meta) implementation registered so torch.compile and FX see it as one op. `moe_up` and `moe_down`
(`opentgi::gguf_moe_up`, `opentgi::gguf_moe_down`) run a mixture of experts' projections for every
token and every expert it was routed to in one call each; `moe_route` routes the tokens.
`paged_attention(...)` attends decode rows over the paged KV cache in place (csrc/attention.h), the
torch op `opentgi::paged_attention`, and `prompt_attention(...)` prompt rows in their own form; `rms_norm`, `add_rms_norm`, `silu_mul` and `gelu_tanh_mul` are
fused per-row layer ops (csrc/layer_ops.h); `opentgi::decode_stack_run` (csrc/stack.cpp) runs a decode
step's decoder layers in one call (models/families/native_stack.py).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from opentgi.kernels import build as build_mod

log = logging.getLogger(__name__)

MODES = ("auto", "native", "torch")
# ids the op takes (csrc/matmul.h Isa), slowest first: the loader takes the last this CPU runs
ISAS = {"scalar": 0, "avx2": 1, "avxvnni": 3, "avx512": 2}
# GGML type ids (gguf.GGMLQuantizationType) -> (name, values a block, bytes a block)
BLOCK_TYPES = {2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 8: ("Q8_0", 32, 34), 12: ("Q4_K", 256, 144),
               14: ("Q6_K", 256, 210),
               6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 13: ("Q5_K", 256, 176), 10: ("Q2_K", 256, 84),
               11: ("Q3_K", 256, 110), 20: ("IQ4_NL", 32, 18), 23: ("IQ4_XS", 256, 136)}
# dense weights the same ops multiply (csrc/dense.cpp): GGML type id -> (name, values a group, bytes a
# group), a row [K] of the dtype's values viewed as uint8 bytes; float32 activations, K % 16 == 0
DENSE_TYPES = {0: ("F32", 16, 64), 1: ("F16", 16, 32), 30: ("BF16", 32, 64)}
DENSE_TYPE_OF = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 30}
# Every block type repacked by sixteen rows (csrc/r16.h, `repack_by_16_rows`), each a type of its own,
# 1000 + the file's (not GGML types). Each takes its type's kernels (the same bits) on any ISA, at
# `passes=2` the form the file's layout takes (Q4_0, Q4_1 and Q8_0 16-bit activation blocks, or for
# Q4_0 and Q4_1 bfloat16 rows on CPUs with AVX-512 BF16; the others two 8-bit passes); Q6_K_R16 only
# the rows' own bfloat16 values against the blocks (csrc/blocks_bf16.cpp)
BY_16_ROWS = {t: 1000 + t for t in BLOCK_TYPES}  # GGML type -> its repacked type
(Q4_0_R16, Q4_1_R16, Q5_0_R16, Q5_1_R16, Q8_0_R16, Q2_K_R16, Q3_K_R16, Q4_K_R16, Q5_K_R16, Q6_K_R16, IQ4_NL_R16,
 IQ4_XS_R16) = (BY_16_ROWS[t] for t in (2, 3, 6, 7, 8, 10, 11, 12, 13, 14, 20, 23))


@dataclass(frozen=True)
class KernelPath:
    """The matmul path serving GGUF blocks: "native" (with its ISA) or "torch" (with the reason)."""
    name: str
    isa: str | None = None
    reason: str = ""
    library: Path | None = None

    def describe(self) -> str:
        return f"native ({self.isa})" if self.name == "native" else f"torch ({self.reason})"


_loaded: list[KernelPath] = []  # the native path once its library is loaded into this process


class KernelsUnavailable(RuntimeError):
    """--kernels native, and the library could not be built or loaded."""


def loaded() -> KernelPath | None:
    return _loaded[0] if _loaded else None


def supported_isas() -> list[str]:
    """The ISA variants the loaded library has and this CPU runs, slowest first."""
    ids = set(torch.ops.opentgi.isas().tolist())
    return [name for name, i in ISAS.items() if i in ids]


def takes_bf16_rows() -> bool:
    """Whether the loaded library's bfloat16-row kernels run here (csrc/blocks_bf16.cpp: Q4_0/Q4_1,
    repacked or not, and the Q6_K_R16 weights at `passes=2`): its AVX-512 variant on a CPU with AVX-512
    BF16's dot products."""
    path = loaded()
    return (path is not None and path.name == "native" and path.isa == "avx512"
            and build_mod.cpu_has(("avx512_bf16",)))


def repack_by_16_rows(blocks: torch.Tensor, qtype: int, in_features: int, back: bool = False) -> torch.Tensor:
    """Rows [N, bytes a row] (N a multiple of 16) of a type `BY_16_ROWS` names as their groups of sixteen
    rows, or (`back`) those groups as rows: the same bytes, moved."""
    return torch.ops.opentgi.repack_by_16_rows(blocks, int(qtype), blocks.shape[0], in_features, back)


def load(mode: str = "auto", directory: Path | None = None) -> KernelPath:
    """The path `mode` gives on this machine, the library built and loaded where it is native."""
    if mode not in MODES:
        raise ValueError(f"--kernels {mode!r}: use one of {', '.join(MODES)}")
    if mode == "torch":
        return KernelPath("torch", reason="--kernels torch")
    if _loaded:
        return _loaded[0]
    start = time.perf_counter()
    try:
        built = build_mod.build(directory)
        torch.ops.load_library(str(built.path))
        _register_fake()
        path = KernelPath("native", supported_isas()[-1], library=built.path)
    except (build_mod.BuildError, OSError, RuntimeError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if mode == "native":
            raise KernelsUnavailable(f"--kernels native: {reason}") from None
        log.warning("kernels: torch path serves GGUF layers (%s)", reason)
        return KernelPath("torch", reason=reason)
    _loaded.append(path)
    log.info("kernels: %s %s (%s) in %.2f s", "loaded" if built.cached else "built", built.path.name,
             ", ".join(built.isas), time.perf_counter() - start)
    return path


def _register_fake() -> None:
    @torch.library.register_fake("opentgi::repack_by_16_rows")
    def _(w, qtype, N, K, back=False):
        return torch.empty_like(w)

    @torch.library.register_fake("opentgi::gguf_mm")
    def _(x, w, qtype, out_features, isa, passes=1):
        return x.new_empty(x.shape[0], out_features)

    @torch.library.register_fake("opentgi::gguf_moe_up")
    def _(x, w, qtype, ids, out_features, isa, passes=1, act=-1):
        if act >= 0:
            return x.new_empty(x.shape[0] * ids.shape[1], out_features // 2)
        return x.new_empty(x.shape[0], ids.shape[1], out_features)

    @torch.library.register_fake("opentgi::gguf_moe_down")
    def _(h, w, qtype, ids, weights, out_features, isa, passes=1):
        return h.new_empty(ids.shape[0], out_features)

    @torch.library.register_fake("opentgi::paged_attention")
    def _(q, k_cache, v_cache, block_tables, seq, ctx, scale, window, softcap, isa):
        return torch.empty_like(q)

    @torch.library.register_fake("opentgi::prompt_attention")
    def _(q, k_cache, v_cache, block_tables, seq, ctx, scale, window, softcap, isa):
        return torch.empty_like(q)

    @torch.library.register_fake("opentgi::rope")
    def _(x, cos, sin, isa):
        return torch.empty_like(x)

    @torch.library.register_fake("opentgi::rms_norm")
    def _(x, weight, eps, isa):
        return torch.empty_like(x)

    @torch.library.register_fake("opentgi::add_rms_norm")
    def _(x, residual, weight, eps, isa):
        return torch.empty_like(x), torch.empty_like(x)

    @torch.library.register_fake("opentgi::silu_mul")
    def _(gate_up, isa):
        return gate_up.new_empty(*gate_up.shape[:-1], gate_up.shape[-1] // 2)

    @torch.library.register_fake("opentgi::gelu_tanh_mul")
    def _(gate_up, isa):
        return gate_up.new_empty(*gate_up.shape[:-1], gate_up.shape[-1] // 2)

    @torch.library.register_fake("opentgi::argmax_rows")
    def _(x, n, bf16, isa):
        return x.new_empty(x.shape[0], dtype=torch.long)

    @torch.library.register_fake("opentgi::moe_route")
    def _(x, w, k, renormalize, isa):
        return x.new_empty(x.shape[0], k), x.new_empty(x.shape[0], k, dtype=torch.long)


def gguf_mm(x: torch.Tensor, blocks: torch.Tensor, qtype: int, out_features: int, isa: str | None = None,
            passes: int = 1) -> torch.Tensor:
    """`x @ W.T`, W the GGUF blocks of `qtype` (rows of x [..., K] quantized to 8-bit blocks; with
    `passes=2` ~16-bit activations: 16-bit blocks where the type has a wide kernel, Q4_0, Q4_1, Q8_0,
    Q4_K and Q6_K, else what the 8-bit rounding left quantized too and its product added)."""
    if x.dim() == 2:  # rows already (a step's activations): no reshape ops
        return torch.ops.opentgi.gguf_mm(x, blocks, qtype, out_features, _isa(isa), passes)
    rows = x.reshape(-1, x.shape[-1])
    out = torch.ops.opentgi.gguf_mm(rows, blocks, qtype, out_features, _isa(isa), passes)
    return out.view(*x.shape[:-1], out_features)


def moe_up(x: torch.Tensor, blocks: list[torch.Tensor], qtype: int, experts: torch.Tensor, out_features: int,
           passes: int = 1, isa: str | None = None, gelu_tanh: bool | None = None) -> torch.Tensor:
    """Grouped experts: x [T, K] by expert experts[t, j]'s weight (`blocks[e]`, GGUF blocks of
    `qtype`, [N, row bytes]) for every (token t, slot j) in one call -> [T, k, N] in x's dtype; each
    token's row quantized once for its k experts. A pair's bits are gguf_mm's for that row. With
    `gelu_tanh` given (False: SiLU), act(gate) * up of each pair's row instead -> [T * k, N / 2]: the
    bits of `silu_mul` / `gelu_tanh_mul` on the [T, k, N] result."""
    act = -1 if gelu_tanh is None else int(gelu_tanh)
    return torch.ops.opentgi.gguf_moe_up(x, blocks, qtype, experts, out_features, _isa(isa), passes, act)


def moe_down(h: torch.Tensor, blocks: list[torch.Tensor], qtype: int, experts: torch.Tensor, weights: torch.Tensor,
             out_features: int, passes: int = 1, isa: str | None = None) -> torch.Tensor:
    """Grouped experts: row t * k + j of h [T * k, K] by expert experts[t, j]'s weight, each token's k
    products times weights[t, j] (h's dtype) added in increasing expert order -> [T, N] in h's
    dtype: each product rounded to h's dtype, the sum in float32 from zero, rounded once."""
    return torch.ops.opentgi.gguf_moe_down(h, blocks, qtype, experts, weights, out_features, _isa(isa), passes)


def moe_route(x: torch.Tensor, weight: torch.Tensor, k: int, renormalize: bool,
              isa: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A router's top k: x [T, hidden] (float32 or bfloat16) by weight (float32 [experts, hidden]) ->
    (weights [T, k] in x's dtype, experts int64 [T, k]), as models/layers/moe.py's SparseMoE.route:
    the logits rounded to x's dtype (each a sum in one fixed order, the same bits on every ISA), the
    k largest, their weights the float32 softmax of those k (`renormalize`) or of every logit. A
    token's bits are its own."""
    return torch.ops.opentgi.moe_route(x, weight, int(k), bool(renormalize), _isa(isa))


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq: torch.Tensor, ctx: torch.Tensor, scale: float, window: int | None = None,
                    softcap: float | None = None, isa: str | None = None) -> torch.Tensor:
    """Decode rows' attention over the paged KV cache, read in place (csrc/attention.h).

    q [rows, heads, D] float32 or bfloat16 (one query token a row); k_cache/v_cache [blocks,
    block_size, kv_heads, D] float32, bfloat16 or float16; block_tables int32 [seqs, width]; seq and
    ctx int32 [rows]: row r attends the first ctx[r] positions of block table seq[r] (with `window`
    W the last W of them), its logits q.k * scale, soft-capped to softcap * tanh(logit / softcap)
    with `softcap`. Returns [rows, heads, D] in q's dtype; a row's bits depend on nothing but its
    own query, keys and values (and the ISA)."""
    path = loaded()
    if path is None:
        raise KernelsUnavailable("the native kernels are not loaded (kernels.native.load)")
    return torch.ops.opentgi.paged_attention(q, k_cache, v_cache, block_tables, seq, ctx, float(scale),
                                             int(window or 0), float(softcap or 0.0), ISAS[isa or path.isa])


def prompt_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq: torch.Tensor, ctx: torch.Tensor, scale: float, window: int | None = None,
                     softcap: float | None = None, isa: str | None = None) -> torch.Tensor:
    """Prompt rows' attention over the paged KV cache: `paged_attention`'s arguments and result, in
    the prompt tokens' own form (csrc/attention.h): runs of one sequence's rows at consecutive
    contexts share each unit of keys. A row's bits depend on nothing but its own query, keys and
    values (and the ISA), so a prompt token gets the same numbers however its prompt is split."""
    return torch.ops.opentgi.prompt_attention(q, k_cache, v_cache, block_tables, seq, ctx, float(scale),
                                              int(window or 0), float(softcap or 0.0), _isa(isa))


def _isa(isa: str | None) -> int:
    path = loaded()
    if path is None:
        raise KernelsUnavailable("the native kernels are not loaded (kernels.native.load)")
    return ISAS[isa or path.isa]


def rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, isa: str | None = None) -> torch.Tensor:
    """x [rows, heads, D] (float32 or bfloat16) rotated by halves with its rows' cos and signed sin
    ([rows, D], x's dtype), as models/layers/rotary.py's apply_rotary rounds it: the decode stack's
    RoPE (csrc/layer_ops.h rope_row)."""
    return torch.ops.opentgi.rope(x, cos, signed_sin, _isa(isa))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, isa: str | None = None) -> torch.Tensor:
    """RMSNorm of x's rows (float32 or bfloat16) times `weight`, as models/layers/norm.py's RMSNorm
    computes it, each row's sum of squares in one fixed order (csrc/layer_ops.h). `weight` [n], or
    [R, n] with row r taking weight r % R (per-head q/k norms); in x's dtype (applied after rounding
    to it), or float32 (applied in float32 and rounded once: Gemma's 1 + w)."""
    return torch.ops.opentgi.rms_norm(x, weight, float(eps), _isa(isa))


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 isa: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) in one pass over the rows; the sum in x's dtype."""
    return torch.ops.opentgi.add_rms_norm(x, residual, weight, float(eps), _isa(isa))


def silu_mul(gate_up: torch.Tensor, isa: str | None = None) -> torch.Tensor:
    """silu(gate) * up, gate and up the two halves of gate_up's last dim (float32 or bfloat16)."""
    return torch.ops.opentgi.silu_mul(gate_up, _isa(isa))


def gelu_tanh_mul(gate_up: torch.Tensor, isa: str | None = None) -> torch.Tensor:
    """gelu(gate, approximate="tanh") * up, gate and up the two halves of gate_up's last dim (GeGLU)."""
    return torch.ops.opentgi.gelu_tanh_mul(gate_up, _isa(isa))


def argmax_rows(x: torch.Tensor, n: int, bf16: bool, isa: str | None = None) -> torch.Tensor:
    """int64 [rows]: each row of float32 x's argmax over its first n values as rounded to bfloat16
    (bf16) or as they are, numpy's (the first of equal largest; the first NaN where there is one):
    the greedy tokens the decode stack gives instead of its logits."""
    return torch.ops.opentgi.argmax_rows(x, int(n), bool(bf16), _isa(isa))
