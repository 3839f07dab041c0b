"""Weight formats (models/quantization/): each multiplies like its dequantized weight, a row's
result does not depend on how many rows share the step (bit for bit), like formats fuse into one
weight, and `--quantize` names map to them or are refused by name."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from opentgi.models.quantization import fp8, rtn
from opentgi.models.quantization.int4 import Int4Groups, pack_for_cuda
from opentgi.models.quantization.linear import ConcatLinear, QuantizedLinear, fuse_linears, resident_summary
from opentgi.models.quantization.methods import Quantize, QuantizeError, parse_quantize
from tests.helpers.cpu_kernels import int4_weights_stack

torch.set_num_threads(1)
CPU = torch.device("cpu")


def weight(n=128, k=256, seed=0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05


def rows(m, k=256, seed=1, dtype=torch.bfloat16) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(dtype)


def formats(dtype):
    w = weight()
    return {
        "int4": rtn.int4_groups(w, 32).to_format(dtype, CPU),
        "int4-g128": rtn.int4_groups(w, 128).to_format(dtype, CPU),
        "int8": rtn.int8_rows(w).to_format(dtype, CPU),
    }


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name", ["int4", "int4-g128", "int8"])
def test_a_row_is_the_same_whatever_the_row_count(name, dtype):
    fmt = formats(dtype)[name]
    x = rows(70, dtype=dtype)
    alone = torch.cat([fmt.matmul(x[i:i + 1]) for i in range(70)])
    for m in (2, 3, 4, 5, 8, 16, 17, 33, 64, 70):
        assert torch.equal(fmt.matmul(x[:m]), alone[:m]), f"{name}: rows differ with {m} rows"


def test_the_cpu_int4_kernel_adds_float32_products_in_sequence():
    """What a bfloat16 row gets from torch's CPU int4 kernel: per output, one float32 multiply-add
    after another over the inputs in order (the weight dequantized in float32), rounded to bfloat16
    once. Any kernel that is to give a row the same bits must do that (docs/determinism.md, "The
    int4 kernel at many rows"); float32 GEMMs that split or block the sum do not."""
    gen = torch.Generator().manual_seed(3)
    m, n, k = 16, 2048, 1024  # enough outputs that another order shows in the bfloat16 bits
    groups = Int4Groups.from_values(torch.randint(0, 16, (n, k), generator=gen),
                                    (torch.rand(n, k // 32, generator=gen) * 0.02).bfloat16().float(),
                                    (torch.randn(n, k // 32, generator=gen) * 0.01).bfloat16().float(), 32)
    x = torch.randn(m, k, generator=gen).bfloat16().double()
    w = groups.dequantize().double()  # exact: (q - 8) * scale has few bits, + zero rounds once

    def in_order(order):  # a bfloat16 times a float32 is exact in float64; one rounding to float32
        acc = torch.zeros(m, n)
        for j in order:
            acc = (x[:, j:j + 1] * w[:, j] + acc.double()).float()
        return acc.bfloat16()

    kernel = groups.to_format(torch.bfloat16, CPU).matmul(x.bfloat16())
    assert torch.equal(kernel, in_order(range(k)))
    assert not torch.equal(kernel, in_order(reversed(range(k))))  # the check tells orders apart


@pytest.mark.parametrize("group", [32, 64, 128])
def test_rtn_int4_is_nearest_on_its_grid_and_the_kernel_multiplies_by_it(group):
    w = weight()
    groups = rtn.int4_groups(w, group)
    deq = groups.dequantize()
    step = (groups.scale.repeat_interleave(group, dim=1))
    assert ((deq - w).abs() <= step / 2 + 1e-6).all()  # round to nearest: within half a step
    x = rows(5, dtype=torch.float32)
    got = groups.to_format(torch.float32, CPU).matmul(x)  # through the kernel in bfloat16 (int4.kernel_dtype)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, x @ deq.T, atol=2e-2, rtol=2e-2)


def test_rtn_int8_is_nearest_per_channel_and_the_kernel_multiplies_by_it():
    w = weight()
    q = rtn.int8_rows(w)
    assert q.q.dtype == torch.int8 and q.scale.shape == (128,)
    assert ((q.dequantize() - w).abs() <= q.scale[:, None] / 2 + 1e-7).all()
    # the scales are the ones the kernel gets in bfloat16: the served weight is the rounded one
    assert torch.equal(q.scale.to(torch.bfloat16).float(), q.scale)
    assert torch.equal(q.to_format(torch.bfloat16, CPU).dequantize(), q.dequantize())
    x = rows(5)
    got = q.to_format(torch.bfloat16, CPU).matmul(x).float()
    want = x.float() @ q.dequantize().T
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


def test_like_formats_fuse_into_one_weight_and_unlike_ones_run_side_by_side():
    def qlinear(fmt):
        linear = QuantizedLinear(fmt.in_features, fmt.out_features)
        linear.weight_format = fmt
        return linear

    parts = [qlinear(rtn.int4_groups(weight(n, seed=n), 32).to_format(torch.bfloat16, CPU)) for n in (128, 64, 64)]
    x = rows(3)
    want = torch.cat([p(x) for p in parts], dim=-1)
    fused = fuse_linears(parts)
    if int4_weights_stack():  # torch's 64-row block layout (AVX-512): one weight
        assert isinstance(fused, QuantizedLinear) and fused.out_features == 256
    else:  # torch's AVX2 layout is not stacked: side by side, each through the int4 kernel
        assert isinstance(fused, ConcatLinear) and all(isinstance(p, QuantizedLinear) for p in fused.parts)
    assert torch.equal(fused(x), want)  # the same kernel over the same packed bytes
    dense = torch.nn.Linear(256, 32, bias=False).to(torch.bfloat16)
    mixed = fuse_linears([parts[0], dense])
    assert isinstance(mixed, ConcatLinear)
    assert torch.equal(mixed(x), torch.cat([parts[0](x), dense(x)], dim=-1))
    # a CPU int4 weight of rows that are not whole 64-row tiles is not stacked
    odd = qlinear(rtn.int4_groups(weight(96), 32).to_format(torch.bfloat16, CPU))
    assert isinstance(fuse_linears([parts[0], odd]), ConcatLinear)


def test_resident_summary_names_each_format_and_its_bytes():
    model = torch.nn.Module()
    model.q = QuantizedLinear(256, 128)
    model.q.weight_format = formats(torch.bfloat16)["int4"]
    model.norm = torch.nn.Linear(256, 4, bias=False).to(torch.bfloat16)
    line = resident_summary(model)
    assert line.startswith("resident weights: ") and "int4 (groups of 32)" in line and "bfloat16" in line
    assert "(1 linears)" in line and "total" in line


def test_cuda_tinygemm_order_holds_the_even_input_in_the_high_nibble():
    """What `torch._convert_weight_to_int4pack` takes (torchao's order), checked on CPU."""
    k = torch.randint(0, 16, (8, 64), generator=torch.Generator().manual_seed(0))
    packed = pack_for_cuda(Int4Groups.from_values(k, torch.ones(8, 2), torch.zeros(8, 2), 32))
    assert packed.shape == (8, 32) and packed.dtype == torch.uint8
    assert torch.equal((packed >> 4).long(), k[:, 0::2]) and torch.equal((packed & 0xF).long(), k[:, 1::2])


def test_fp8_reference_is_close_to_the_float_product_and_row_invariant():
    """The CPU reference of the FP8 path (`torch._scaled_mm` on GPUs): per-channel weight scales,
    per-row activation scales."""
    w = weight()
    fmt = fp8.Fp8Weight(w, CPU)
    x = rows(9, dtype=torch.float32)
    got = fp8.reference_matmul(x, fmt)
    want = x @ w.T
    assert (got - want).abs().max() < 0.06 * want.abs().max()
    values, scales = fp8.quantize_rows(x)
    one_values, one_scale = fp8.quantize_rows(x[:1])  # a row's FP8 form is its own
    assert torch.equal(one_values.float(), values[:1].float()) and torch.equal(one_scale, scales[:1])
    assert torch.equal(fmt.matmul(x), got)
    assert not fp8.fp8_available(CPU)


def test_quantize_names():
    assert parse_quantize(None) is None
    assert parse_quantize("int8") == parse_quantize("eetq") == Quantize("int8")
    assert parse_quantize("int4") == Quantize("int4", 32)
    assert parse_quantize("int4-g128") == Quantize("int4", 128)
    assert parse_quantize("AWQ") == Quantize("awq") and not Quantize("awq").at_load
    for name in ("bitsandbytes", "bitsandbytes-nf4", "exl2", "marlin"):
        with pytest.raises(QuantizeError, match=f"--quantize {name} is not supported"):
            parse_quantize(name)
    with pytest.raises(QuantizeError, match="unknown"):
        parse_quantize("int3")


def test_int8_falls_back_to_a_plain_matmul_without_the_kernel(monkeypatch):
    fmt = formats(torch.float32)["int8"]
    x = rows(4, dtype=torch.float32)
    with_kernel = fmt.matmul(x)
    fmt.use_kernel = False
    torch.testing.assert_close(fmt.matmul(x), with_kernel, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(F.linear(x, fmt.dequantize()), with_kernel, atol=1e-5, rtol=1e-5)
