"""Quality of the served weights: perplexity of the default model (SmolLM2-135M-Instruct) on a fixed
text of ~660 tokens, from the engine's own prompt logprobs (TGI's decoder_input_details). The text is
long enough that bfloat16 rounding alone (which moves a 160-token text's perplexity by up to ~0.6%
between two attention forms) stays well inside the 1% being tested."""

from __future__ import annotations

import math

import pytest

from opentgi.engine.request import GenerationRequest, SamplingParams, StoppingParams
from opentgi.models.loader import cpu_has_bf16
from tests.helpers.engine import generate, running

TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg, a "
    "goldsmith from Mainz, combined movable metal type, oil-based ink and a wooden press adapted "
    "from those used to make wine. Before his invention, books were copied by hand, which made them "
    "rare and expensive. Within a few decades, printing shops had opened in more than two hundred "
    "cities across Europe, and millions of books had been produced. The spread of printed material "
    "changed how people learned, argued and worshipped. Scholars could compare identical copies of "
    "a text, scientists could share their observations quickly, and ordinary people gained access "
    "to pamphlets, calendars and news. Historians often describe the printing press as one of the "
    "most important inventions of the second millennium, because it made knowledge cheaper, more "
    "reliable and far easier to spread than ever before."
    " The steam engine followed a different path. Early machines built by Thomas Newcomen pumped water "
    "out of coal mines, but they wasted most of their fuel heating and cooling the same cylinder. James"
    " Watt, an instrument maker in Glasgow, added a separate condenser, so the cylinder could stay hot "
    "while the steam was cooled elsewhere. His engines used far less coal, and within a generation they"
    " drove mills, ironworks and breweries across Britain. Factories no longer had to stand beside fast"
    " rivers, and towns grew around them instead."
    " Railways carried the change further. A locomotive could pull heavy loads of coal, grain and "
    "people at a steady speed in any weather, and the journey from one city to another shrank from days"
    " to hours. Merchants could sell fresh food in distant markets, newspapers reached readers on the "
    "morning they were printed, and clocks across a country were set to one standard time so that "
    "timetables made sense. Engineers learned to build bridges, tunnels and cuttings on a scale that "
    "had never been attempted before."
    " Electricity arrived later in the nineteenth century. Michael Faraday showed that a moving magnet "
    "could produce a current in a coil of wire, and that discovery made the generator and the electric "
    "motor possible. Thomas Edison and his rivals built power stations that lit streets and homes, "
    "while the telegraph and then the telephone let people speak across oceans. Each of these "
    "inventions depended on the ones before it: the printing press spread the science, the steam engine"
    " supplied the power, and the railway moved the materials."
    " Historians who study these changes often warn against telling the story as a list of heroic "
    "inventors. Most improvements came from many small steps taken by workers, mechanics and engineers "
    "whose names were never recorded. A better valve, a stronger alloy or a cheaper way to make glass "
    "could matter as much as a famous patent. Ideas also travelled in both directions between "
    "countries, and a device that failed in one place sometimes succeeded in another where fuel was "
    "cheaper or labour more expensive."
    " The same pattern can be seen in the history of computing. Mechanical calculators, punched cards "
    "and telephone switches came long before the first electronic computers, and those early machines "
    "filled entire rooms. The transistor made them smaller and more reliable, the integrated circuit "
    "made them cheaper, and the personal computer put one on millions of desks. Today a phone in a "
    "pocket holds more computing power than all the machines that guided the first missions to the "
    "moon, and it connects its owner to libraries, maps and conversations around the world."
)


async def served_perplexity(loaded, **settings) -> float:
    ids = loaded.tokenizer(TEXT)["input_ids"]
    request = GenerationRequest(ids, SamplingParams(), StoppingParams(max_new_tokens=1), prompt_logprobs=True)
    async with running(loaded, **settings) as engine:
        result = await generate(engine, request)
    logprobs = [token.logprob for token in result.prefill[1:]]
    assert len(logprobs) == len(ids) - 1 > 600
    return math.exp(-sum(logprobs) / len(logprobs))


@pytest.mark.slow
async def test_quantized_and_native_perplexity_stay_close_to_the_dense_weights(default_model):
    """In float32, where only the weights and the kernels' roundings differ: the native kernels (the
    file's Q4_1 blocks, and `--quantize int8` as Q8_0) against torch's path and the same weights
    dense. The native kernels round each activation row to 8-bit blocks, q/k/v and down
    projections' to 16-bit blocks (models/quantization/gguf_blocks.py): on an AVX2 EPYC this text's
    perplexity moved by +0.3% (Q4_1, against torch's path; +0.9% with 8-bit activations everywhere)
    and +0.97% (int8, against dense: the layers rounded a second time, and the tied head on the
    file's Q8_0 blocks as without --quantize); the bounds guard that cost from growing
    (docs/benchmarks.md). A float16 KV cache (the default under float32) against float32's: -0.3%
    (24.08 against 24.15), bounded at 0.5%.

    Where the host serves bfloat16 (tested by the next test), its own rounding moves this text's
    perplexity by about as much as the kernels do (dense: 23.974 in bfloat16 against 24.081 in
    float32 on an AVX-512 EPYC), so the kernels' 0.5% is checked here, in float32, on every host."""
    dtype = "float32"
    dense = await served_perplexity(default_model(dtype=dtype, dequantize=True))
    torch_path = await served_perplexity(default_model(dtype=dtype))  # tests pin GGUFs to torch's path
    native = await served_perplexity(default_model(dtype=dtype, kernels="native"))
    int8 = await served_perplexity(default_model(dtype=dtype, quantize="int8", kernels="native"))
    # --kv-cache-dtype auto is float16 under float32 (every figure above); float32's cache beside it
    kv32 = await served_perplexity(default_model(dtype=dtype, kernels="native"), kv_cache_dtype="float32")
    print(f"perplexity ({dtype}): dense {dense:.3f}, torch path {torch_path:.3f}, native {native:.3f}, "
          f"int8 {int8:.3f}, native with a float32 KV cache {kv32:.3f}")
    assert abs(native / kv32 - 1) < 0.005
    assert abs(torch_path / dense - 1) < 0.01  # Q4_1's values, rows unrounded
    assert abs(native / torch_path - 1) < 0.005
    assert abs(int8 / dense - 1) < 0.01
    assert 1 < dense < 30  # an instruct model on plain English prose


@pytest.mark.slow
async def test_the_dtype_this_host_serves_stays_close_to_float32(default_model):
    """The default flags' dtype (bfloat16 on CPUs with avx512_bf16 or AMX, else float32) on the
    native kernels, against the dense float32 weights: within 1%. On an AVX-512 EPYC (Zen 5):
    bfloat16 native 24.226 (+0.6%), bfloat16 torch's path 24.034 (-0.2%), bfloat16 dense 23.974
    (-0.4%), float32 dense 24.081: in bfloat16 the forms of attention alone move it by ~0.5% (native
    against torch's attention on the same native matmuls: 24.226 against 24.096)."""
    dtype = "bfloat16" if cpu_has_bf16() else "float32"
    dense32 = await served_perplexity(default_model(dtype="float32", dequantize=True))
    served = await served_perplexity(default_model(dtype=dtype, kernels="native"))
    print(f"perplexity: dense float32 {dense32:.3f}, native {dtype} {served:.3f}")
    assert abs(served / dense32 - 1) < 0.01
