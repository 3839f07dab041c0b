"""Every mode serves a GGUF as it serves a folder: tensor parallelism (each rank reads its slices
of the file's blocks, checkpoints/gguf_slice.py; a 2-rank server against one shard), LoRA adapters
on its quantized layers, --speculate, and --quantize (an already quantized GGUF is requantized,
with one line saying so)."""

from __future__ import annotations

import asyncio
import json
import logging
import shutil

import pytest
import torch

from opentgi.config import Settings
from opentgi.engine.request import GenerationRequest, SamplingParams, StoppingParams
from opentgi.models.checkpoints.gguf_checkpoint import GGUFCheckpoint
from opentgi.models.loader import load_model
from opentgi.models.parallel import ShardPlan
from opentgi.models.quantization.linear import QuantizedLinear
from tests.helpers import tiny_models
from tests.helpers.engine import generate, running
from tests.helpers.paged import PagedRunner

torch.set_num_threads(1)

TEXTS = ["The quick brown fox jumps over the lazy dog. The quick brown fox",
         "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13", "Hello"]
MAX_NEW = 24
COSINE = torch.nn.functional.cosine_similarity


@pytest.fixture(scope="module")
def tiny_gguf():
    return tiny_models.tiny_gguf_path()


@pytest.fixture(scope="module")
def cache(tmp_path_factory, tiny_gguf_tokenizers):
    """An opentgi cache dir for this module's servers and loads, holding the tiny GGUF's tokenizer."""
    root = tmp_path_factory.mktemp("gguf-modes")
    shutil.copytree(tiny_gguf_tokenizers, root / "tokenizers")
    return root


@pytest.fixture(scope="module")
def plain(tiny_gguf, cache):
    """The tiny GGUF as it is served by default in the tests (torch's path)."""
    return load_model(Settings(model_id=str(tiny_gguf), dtype="float32", cache_dir=str(cache)))


def greedy(ids, adapter_id=None) -> GenerationRequest:
    return GenerationRequest(list(ids), SamplingParams(), StoppingParams(max_new_tokens=MAX_NEW),
                             adapter_id=adapter_id)


def last_logits(loaded, prompt, adapter=None) -> torch.Tensor:
    lora = getattr(loaded.model, "lora", None)
    if lora is not None:
        lora.begin_step([adapter], [len(prompt)])
    try:
        hidden = PagedRunner(loaded.model).step({0: prompt})
    finally:
        if lora is not None:
            lora.end_step()
    return loaded.model.compute_logits(hidden)[0]


# --- tensor parallelism ---------------------------------------------------------------------------
def test_each_rank_reads_exactly_its_slice_of_the_blocks(tiny_gguf):
    """For 2 ranks, every tensor's slice read from the file's blocks equals that slice of the whole
    dequantized tensor: q/k rows through llama.cpp's permutation, o (Q4_K: a half row of 128 is
    inside a 256-value block) and down (Q5_K: 256 | 256, whole blocks) by columns, the Q8_0
    embedding by vocabulary rows."""
    checkpoint = GGUFCheckpoint(tiny_gguf)
    whole = {name: value.tensor() for name, value in checkpoint.iter_tensors(set())}
    config = checkpoint.config()
    for rank in range(2):
        plan = ShardPlan.of(config, rank, 2)
        got = dict(checkpoint.iter_sliced(plan.slice))
        assert got.keys() == whole.keys()
        for name, part in got.items():
            assert torch.equal(part, plan.slice(name, tuple(whole[name].shape), whole[name].__getitem__)), name
        assert got["model.layers.0.self_attn.o_proj.weight"].shape == (256, 128)
        assert got["model.embed_tokens.weight"].shape == (49152 // 2, 256)
    checkpoint.close()




def _greedy_tokens(url: str, prompt: str, adapter: str | None = None) -> list[int]:
    import httpx

    parameters = {"max_new_tokens": MAX_NEW, "details": True, **({"adapter_id": adapter} if adapter else {})}
    response = httpx.post(f"{url}/generate", json={"inputs": prompt, "parameters": parameters}, timeout=120)
    assert response.status_code == 200, response.text
    return [t["id"] for t in response.json()["details"]["tokens"]]


@pytest.mark.slow  # a 2-rank server: processes that talk over gloo
def test_two_shards_of_a_gguf_answer_as_one(tiny_gguf, cache):
    """`opentgi serve --num-shard 2 --speculate 3 --lora-adapters a=...` on a GGUF (the ranks once
    read it as a JSON config): greedy tokens, with and without the adapter, equal one shard's with
    the same weights dense (--dequantize) and no speculation, as a folder's do."""
    from conformance.live import free_port, serve
    from tests.helpers.servers import SERVER_FLAGS, spawn_server, stop, wait_ready

    adapter = write_adapter(cache / "adapter", GGUFCheckpoint(tiny_gguf).config())
    port = free_port()
    # with speculative decoding: the drafts' logits come back from the shards too
    proc = spawn_server(tiny_gguf, port, "--num-shard", "2", "--speculate", "3", "--cache-dir", str(cache),
                        "--lora-adapters", f"a={adapter}", *SERVER_FLAGS)
    jobs = [(text, adapter_id) for text in TEXTS for adapter_id in (None, "a")]
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(proc, url)
        sharded = [_greedy_tokens(url, text, adapter_id) for text, adapter_id in jobs]
    finally:
        stop(proc)
    settings = Settings(model_id=str(tiny_gguf), hostname="127.0.0.1", port=free_port(), num_threads=1,
                        max_batch_total_tokens=4096, dtype="float32", dequantize=True, cache_dir=str(cache),
                        lora_adapters=f"a={adapter}")
    with serve(settings) as single:
        assert sharded == [_greedy_tokens(single, text, adapter_id) for text, adapter_id in jobs]
    assert sharded[0] != sharded[1]  # the adapter changes the answer


# --- LoRA -----------------------------------------------------------------------------------------
def write_adapter(folder, config, seed: int = 1, r: int = 4, alpha: float = 8.0,
                  targets=("q_proj", "v_proj", "o_proj", "down_proj")):
    """A PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors) of random A and B for
    the model of `config`: q (Q4_0, int4), v (Q6_K, dense), o (Q4_K, int4), down (Q5_K, dense)."""
    from safetensors.torch import save_file

    folder.mkdir()
    head_dim = config.hidden_size // config.num_attention_heads
    shapes = {"q_proj": (config.hidden_size, config.hidden_size),
              "v_proj": (config.num_key_value_heads * head_dim, config.hidden_size),
              "o_proj": (config.hidden_size, config.hidden_size),
              "down_proj": (config.hidden_size, config.intermediate_size)}
    parent = {"q_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn", "down_proj": "mlp"}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for target in targets:
            out, inp = shapes[target]
            prefix = f"base_model.model.model.layers.{layer}.{parent[target]}.{target}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(r, inp, generator=gen) * 0.1
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out, r, generator=gen) * 0.1
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": list(targets), "bias": "none",
        "lora_dropout": 0.0, "base_model_name_or_path": None, "task_type": "CAUSAL_LM"}))
    return folder


@pytest.mark.parametrize("kernels", ["torch", "native"])
def test_lora_adapters_on_a_gguf(tiny_gguf, cache, tmp_path, kernels):
    """An adapter on the GGUF's quantized layers (torch's int4 kernel, or the native kernels on the
    file's blocks) changes the logits as it does on the same weights dense (--dequantize; the dense
    path is checked against PEFT in test_lora.py); base rows of the adapted model are the plain
    model's."""
    adapter = write_adapter(tmp_path / "adapter", GGUFCheckpoint(tiny_gguf).config())
    kept = load_model(Settings(model_id=str(tiny_gguf), dtype="float32", cache_dir=str(cache),
                               lora_adapters=f"a={adapter}", kernels=kernels))
    dense = load_model(Settings(model_id=str(tiny_gguf), dtype="float32", cache_dir=str(cache),
                                lora_adapters=f"a={adapter}", dequantize=True))
    assert kept.adapters == ["a"] and ("int4" if kernels == "torch" else "blocks (native") in kept.model.resident
    # the plain model on the same kernels (`plain`, --kernels auto, has the native attention backend)
    alone = load_model(Settings(model_id=str(tiny_gguf), dtype="float32", cache_dir=str(cache), kernels=kernels))
    prompt = kept.tokenizer(TEXTS[0])["input_ids"]
    base = last_logits(kept, prompt)
    assert torch.equal(base, last_logits(alone, prompt))
    delta = last_logits(kept, prompt, "a") - base
    want = last_logits(dense, prompt, "a") - last_logits(dense, prompt)
    assert delta.norm() > 0.1 * base.norm()  # the adapter does change the answer
    # the quantized layers round their rows (int4: to bfloat16, int4.kernel_dtype; native: to
    # 8-bit blocks), the dense ones do not
    assert COSINE(delta, want, dim=0) > 0.99


# --- speculative decoding -------------------------------------------------------------------------
def test_speculate_on_a_gguf_keeps_greedy_output(tiny_gguf, cache):
    """--speculate on a GGUF: drafts are accepted, and greedy output is token for token plain decoding's."""
    loaded = load_model(Settings(model_id=str(tiny_gguf), dtype="float32", cache_dir=str(cache), speculate=3))
    prompts = [loaded.tokenizer(t, add_special_tokens=False)["input_ids"] for t in TEXTS]

    async def run(speculate: int):
        async with running(loaded, speculate=speculate) as engine:
            out = [(await generate(engine, greedy(p))).sequences[0].token_ids for p in prompts]
            return out, engine.scheduler.accepted_tokens_total

    reference, _ = asyncio.run(run(0))
    speculated, accepted = asyncio.run(run(3))
    assert speculated == reference
    assert accepted > 0


# --- --quantize -----------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantize_requantizes_a_quantized_gguf_with_one_line(tiny_gguf, cache, plain, caplog, method):
    """--quantize on a GGUF whose layers are already blocks (llama.cpp's `--allow-requantize`):
    every layer projection in the asked format, one warning naming the file's types, the answer
    close to the file's own blocks."""
    with caplog.at_level(logging.WARNING, logger="opentgi.models.loader"):
        loaded = load_model(Settings(model_id=str(tiny_gguf), dtype="float32", cache_dir=str(cache),
                                     quantize=method))
    lines = [r.getMessage() for r in caplog.records if "requantized" in r.getMessage()]
    assert len(lines) == 1 and f"--quantize {method}" in lines[0]
    assert "14 layer projections are already quantized (Q4_0, Q4_1, Q4_K, Q5_K, Q6_K)" in lines[0]
    layer = loaded.model.model.layers[0]
    projections = [m for m in layer.modules() if isinstance(m, QuantizedLinear)]
    assert projections and {m.weight_format.kind for m in projections} == {method}
    assert isinstance(layer.mlp.down_proj, QuantizedLinear)  # Q5_K: dense before, now requantized
    prompt = plain.tokenizer(TEXTS[0])["input_ids"]
    assert COSINE(last_logits(loaded, prompt), last_logits(plain, prompt), dim=0) > 0.95
