"""A linear layer whose weight is a quantized format (int4 groups, int8 per channel, fp8), fusing
such layers, and the one-line account of what a model holds resident.

A weight is its format: `QuantizedLinear` multiplies rows through its format's kernel, whose rows
never depend on how many rows share the step (tests/models/test_quantization_formats.py). A CPU int4
layer may also hold a dense copy for prompt rows (models/quantization/prompt_copy.py): then a
row's kernel follows its kind (models/layers/row_kinds.py), never the step's size. Only with
`--nondeterministic` (`dense_above_rows` set) does a step of more rows than that go through the
dense copy whatever its rows' kinds: the int4 kernel is the faster one for a few rows only.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import nn

from opentgi.models.base import ForwardWithoutHooks
from opentgi.models.layers.row_kinds import GENERATED, PROMPT, current_row_kinds


class QuantizedLinear(ForwardWithoutHooks, nn.Module):
    """`y = x @ W.T + b` with W held in a quantized format (`Int4Weight`, `Int8Weight`, `Fp8Weight`),
    set by the loader (models/checkpoints/loading.py)."""

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight_format = None
        self.bias = None if bias is None else bias.detach().clone()
        self.prompt_linear: nn.Module | None = None  # the dense copy for prompt rows, if any
        # --nondeterministic: a step of more rows than this takes the dense copy for every row
        self.dense_above_rows: int | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kinds = current_row_kinds() if self.prompt_linear is not None else None
        rows = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        if self.dense_above_rows is not None and rows.shape[0] > self.dense_above_rows:
            out = self.prompt_linear(rows).view(*x.shape[:-1], self.out_features)
        elif kinds is None or kinds.kind == GENERATED or kinds.num_rows != rows.shape[0]:
            out = self.weight_format.matmul(x)  # every row a generated one (also without kinds)
        elif kinds.kind == PROMPT:
            out = self.prompt_linear(rows).view(*x.shape[:-1], self.out_features)
        else:  # a mixed step: each kind through its own kernel
            out = rows.new_empty(rows.shape[0], self.out_features)
            out.index_copy_(0, kinds.prompt_index, self.prompt_linear(rows.index_select(0, kinds.prompt_index)))
            out.index_copy_(0, kinds.generated_index,
                            self.weight_format.matmul(rows.index_select(0, kinds.generated_index)))
            out = out.view(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out.add_(self.bias)

    def extra_repr(self) -> str:
        kind = self.weight_format.description if self.weight_format is not None else "unpacked"
        copy = ", dense copy for prompt rows" if self.prompt_linear is not None else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, {kind}{copy}"


class ConcatLinear(ForwardWithoutHooks, nn.Module):
    """Projections that cannot be stacked into one weight (different formats), run one after the
    other and concatenated along the output, as one fused projection would."""

    def __init__(self, parts: list[nn.Module]):
        super().__init__()
        self.parts = nn.ModuleList(parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)


def fuse_linears(parts: list[nn.Module], copy_file_blocks: bool = False) -> nn.Module:
    """One module computing the concatenated outputs of `parts` (nn.Linear or QuantizedLinear).
    Weights that are views of a memory-mapped file stay parts (ConcatLinear, one native call for all
    in the decode stack), so the file's pages remain the weights and nothing is held twice, unless
    `copy_file_blocks` (a caller whose kernel needs one weight: the grouped MoE experts)."""
    first = parts[0]
    has_bias = getattr(first, "bias", None) is not None
    if all(isinstance(p, nn.Linear) for p in parts):
        fused = nn.Linear(first.in_features, sum(p.out_features for p in parts), bias=has_bias,
                          device=first.weight.device, dtype=first.weight.dtype)
        with torch.no_grad():
            fused.weight.copy_(torch.cat([p.weight for p in parts]))
            if has_bias:
                fused.bias.copy_(torch.cat([p.bias for p in parts]))
        return fused
    formats = [p.weight_format for p in parts if isinstance(p, QuantizedLinear)]
    mapped = any(getattr(f, "mapped", False) for f in formats)
    if (len(formats) == len(parts) and len({type(f) for f in formats}) == 1
            and (copy_file_blocks or not mapped) and formats[0].can_cat(formats[1:])):
        bias = torch.cat([p.bias for p in parts]) if has_bias else None
        fused = QuantizedLinear(first.in_features, sum(p.out_features for p in parts), bias)
        fused.weight_format = type(formats[0]).cat(formats)
        return fused
    return ConcatLinear(parts)


def _tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _storage_key(tensor: torch.Tensor) -> int:
    try:
        return tensor.untyped_storage().data_ptr() or id(tensor)
    except (RuntimeError, NotImplementedError):  # tensors without a plain storage (oneDNN's packed)
        return id(tensor)


def resident_summary(model: nn.Module) -> str:
    """One line: each weight format held, how many linears and bytes, and the total."""
    by_kind: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    seen: set[int] = set()

    def add(kind: str, nbytes: int, linear: bool) -> None:
        entry = by_kind[kind]
        entry[0] += int(linear)
        entry[1] += nbytes

    for sub in model.modules():
        blocks = getattr(sub, "gguf_blocks", None)  # an embedding on the GGUF's blocks (gguf_blocks.py)
        if isinstance(blocks, torch.Tensor) and _storage_key(blocks) not in seen:
            seen.add(_storage_key(blocks))
            add(f"{sub.qtype.name} blocks (embedding)", _tensor_bytes(blocks), False)
        if isinstance(sub, QuantizedLinear):
            held = getattr(sub.weight_format, "blocks", None)  # a tied head shares the embedding's blocks
            if isinstance(held, torch.Tensor):
                if _storage_key(held) in seen:
                    continue
                seen.add(_storage_key(held))
            add(sub.weight_format.description, sub.weight_format.nbytes(), True)
            copy = sub.prompt_linear
            if copy is not None:  # counted here, under its own name, and not again as a linear
                parts = [copy.packed] if copy.packed is not None else list(copy.k_slices)
                seen.update(id(p) for p in parts)
                add(f"{str(parts[0].dtype).replace('torch.', '')} prompt copies (oneDNN)",
                    sum(_tensor_bytes(p) for p in parts), False)
            if sub.bias is not None:
                add(str(sub.bias.dtype).replace("torch.", ""), _tensor_bytes(sub.bias), False)
            continue
        packed = getattr(sub, "packed", None)  # OneDNNLinear (models/layers/linear.py)
        if isinstance(packed, torch.Tensor) and id(packed) not in seen:
            seen.add(id(packed))
            add(f"{str(packed.dtype).replace('torch.', '')} (oneDNN)", _tensor_bytes(packed), True)
        for tensor in list(sub.parameters(recurse=False)) + list(sub.buffers(recurse=False)):
            key = _storage_key(tensor)  # a view of another module's weight (a tied head) counts once
            if key in seen:
                continue
            seen.add(key)
            linear = isinstance(sub, nn.Linear) and tensor is sub.weight
            add(str(tensor.dtype).replace("torch.", ""), _tensor_bytes(tensor), linear)
        bias = getattr(sub, "bias", None)
        if packed is not None and isinstance(bias, torch.Tensor) and id(bias) not in seen:
            seen.add(id(bias))
            add(str(bias.dtype).replace("torch.", ""), _tensor_bytes(bias), False)
    total = sum(nbytes for _, nbytes in by_kind.values())
    parts = [f"{kind} {nbytes / 2**20:,.0f} MiB" + (f" ({count} linears)" if count else "")
             for kind, (count, nbytes) in sorted(by_kind.items(), key=lambda kv: -kv[1][1])]
    return f"resident weights: {', '.join(parts)}; total {total / 2**20:,.0f} MiB"
