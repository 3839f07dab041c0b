"""LoRA adapters (models/lora/) through the Engine on the tiny Llama, against transformers + PEFT:
greedy output token for token per adapter, alone and with base, A and B mixed in one batch; prefix
cache never shared across adapters; bad adapters refused at load with a clear message."""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from opentgi.config import Settings
from opentgi.engine.errors import UnknownAdapterError
from opentgi.engine.request import GenerationRequest, SamplingParams, StoppingParams
from opentgi.models import lora
from opentgi.models.loader import ModelLoadError, load_model
from tests.helpers import tiny_models
from tests.helpers.engine import running

torch.set_num_threads(1)

EOS = [2, 0]
MAX_NEW = 16
PROMPTS = ["The quick brown fox jumps over the lazy dog.",
           ("In a hole in the ground there lived a hobbit. Not a nasty, dirty, wet hole, filled with the "
            "ends of worms and an oozy smell, nor yet a dry, bare, sandy hole"),
           "Once upon a time"]


@pytest.fixture(scope="module")
def adapter_a(tiny_llama):
    return tiny_models.tiny_lora_path(tiny_llama, seed=1, r=4, alpha=8, targets=["q_proj", "v_proj", "down_proj"])


@pytest.fixture(scope="module")
def adapter_b(tiny_llama):
    return tiny_models.tiny_lora_path(tiny_llama, seed=2, r=8, alpha=4, use_rslora=True,
                                      targets=list(lora.TARGET_MODULES))


@pytest.fixture(scope="module")
def loaded(tiny_llama, adapter_a, adapter_b):
    return load_model(Settings(model_id=str(tiny_llama), lora_adapters=f"a={adapter_a}, b={adapter_b}"))


@pytest.fixture(scope="module")
def prompts(loaded):
    return [loaded.tokenizer(t, add_special_tokens=False)["input_ids"] for t in PROMPTS]


def hf_greedy(model, ids: list[int]) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=EOS, pad_token_id=EOS[0])
    return out[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def references(tiny_llama, adapter_a, adapter_b, prompts):
    """adapter (None = base) -> greedy tokens of each prompt, by transformers + PEFT."""
    base = AutoModelForCausalLM.from_pretrained(tiny_llama, torch_dtype=torch.float32).eval()
    refs = {None: [hf_greedy(base, p) for p in prompts]}
    peft_model = PeftModel.from_pretrained(base, str(adapter_a), adapter_name="a").eval()
    peft_model.load_adapter(str(adapter_b), adapter_name="b")
    for name in ("a", "b"):
        peft_model.set_adapter(name)
        refs[name] = [hf_greedy(peft_model, p) for p in prompts]
    assert refs["a"] != refs[None] and refs["b"] != refs[None] and refs["a"] != refs["b"]
    return refs


# compared with PEFT's float32 forward: a float32 KV cache as it keeps (a random tiny model's greedy
# tokens meet near ties that float16 keys can tip)
FLOAT32_KV = "float32"


def greedy(ids, adapter_id=None) -> GenerationRequest:
    return GenerationRequest(list(ids), SamplingParams(), StoppingParams(max_new_tokens=MAX_NEW),
                             adapter_id=adapter_id)


async def tokens(engine, request) -> list[int]:
    handle = await engine.submit(request)
    return (await handle.result()).sequences[0].token_ids


async def test_each_adapter_alone_matches_peft(loaded, prompts, references):
    assert loaded.adapters == ["a", "b"]
    async with running(loaded, enable_prefix_caching=False, kv_cache_dtype=FLOAT32_KV) as engine:
        assert engine.info.adapters == ["a", "b"]
        for adapter in (None, "a", "b"):
            for ids, ref in zip(prompts, references[adapter]):
                assert await tokens(engine, greedy(ids, adapter)) == ref, adapter
        # the base model's own id selects the base model
        assert await tokens(engine, greedy(prompts[0], engine.info.model_id)) == references[None][0]


@pytest.mark.parametrize("chunk", [8, None])
async def test_base_a_b_mixed_in_one_batch_match_peft(loaded, prompts, references, chunk):
    async with running(loaded, chunked_prefill_tokens=chunk, kv_cache_dtype=FLOAT32_KV) as engine:
        steps: list[set] = []
        begin = engine.runner.lora.begin_step

        def spy(adapter_ids, num_new_tokens):
            steps.append(set(adapter_ids))
            begin(adapter_ids, num_new_tokens)

        engine.runner.lora.begin_step = spy
        jobs = [(adapter, i) for i in range(len(prompts)) for adapter in (None, "a", "b")]
        results = await asyncio.gather(*(tokens(engine, greedy(prompts[i], adapter)) for adapter, i in jobs))
        for (adapter, i), got in zip(jobs, results):
            assert got == references[adapter][i], (adapter, i)
        assert {None, "a", "b"} in steps  # some step ran the three together
        # same prompts again: the prefix cache serves each adapter only its own blocks
        again = await asyncio.gather(*(tokens(engine, greedy(prompts[i], adapter)) for adapter, i in jobs))
        assert again == results
        assert engine.stats().prefix_hit_tokens > 0


async def test_nondeterministic_stacked_form_matches_peft(tiny_llama, adapter_a, adapter_b, prompts, references):
    """--nondeterministic keeps the stacked form (every adapter in two matmuls over the whole step):
    base, A and B mixed in one batch still give PEFT's tokens."""
    fast = load_model(Settings(model_id=str(tiny_llama), lora_adapters=f"a={adapter_a}, b={adapter_b}",
                               nondeterministic=True))
    layers = [m for m in fast.model.modules() if isinstance(m, lora.LoraLinear)]
    assert layers and all(m.adapters is None for m in layers)  # the stacked form
    async with running(fast, enable_prefix_caching=False, kv_cache_dtype=FLOAT32_KV) as engine:
        jobs = [(adapter, i) for i in range(len(prompts)) for adapter in (None, "a", "b")]
        results = await asyncio.gather(*(tokens(engine, greedy(prompts[i], adapter)) for adapter, i in jobs))
    assert results == [references[adapter][i] for adapter, i in jobs]


async def test_unknown_adapter_is_refused_naming_the_loaded_ones(loaded, prompts):
    async with running(loaded) as engine:
        with pytest.raises(UnknownAdapterError) as caught:
            await engine.submit(greedy(prompts[0], "c"))
    assert caught.value.message == "adapter 'c' is not loaded; loaded adapters: 'a', 'b'"


def test_prefix_blocks_are_keyed_by_adapter():
    from opentgi.engine.output.detokenizer import IncrementalDetokenizer
    from opentgi.engine.output.stop_checker import StopChecker
    from opentgi.engine.scheduling.block_manager import BlockManager
    from opentgi.engine.scheduling.sequence import Sequence

    def seq(adapter):
        request = greedy(list(range(40)), adapter)
        return Sequence(request, 0, seed=None, detokenizer=IncrementalDetokenizer(None, []),
                        stop_checker=StopChecker(request.stopping, [], 100), processors=[])

    bm = BlockManager(16, 8)
    first = seq("a")
    assert bm.admit(first) == 0
    assert bm.allocate_slots(first, 40)
    first.num_computed_tokens = 40
    bm.commit(first)
    bm.free(first)
    assert bm.admit(seq("b")) == 0 and bm.admit(seq(None)) == 0
    assert bm.admit(seq("a")) == 32


def test_delta_equals_per_row_gather():
    """The stacked matmuls compute what punica's per-row gather (bgmv_delta) computes for each fused
    part, with every slot in the step or only some of them, and nothing for a step without adapters."""
    gen = torch.Generator().manual_seed(0)
    num_slots, rank, fan_in, outs = 3, 4, 16, [24, 8]
    a = torch.randn(num_slots, len(outs), rank, fan_in, generator=gen)
    b = [torch.randn(num_slots, rank, out, generator=gen) for out in outs]
    state = lora.LoraState(["x", "y", "z"], rank, torch.float32, torch.device("cpu"))
    zero = torch.nn.Linear(fan_in, sum(outs), bias=False)
    torch.nn.init.zeros_(zero.weight)
    layer = lora.LoraLinear(zero, state, a, b)
    x = torch.randn(7, fan_in, generator=gen)
    for ids, counts in [(["y", None, "x"], [3, 1, 3]), (["x", "y"], [5, 2]), (["z", "z"], [4, 3]),
                        ([None, "x", "y", "z"], [1, 2, 2, 2]), (["y", None, "x"], [3, 1, 3])]:
        state.begin_step(ids, counts)
        slots = torch.tensor([-1 if i is None else state.slot_of[i] for i, n in zip(ids, counts) for _ in range(n)])
        expected = torch.cat([lora.bgmv_delta(x, a[:, p], b[p], slots) for p in range(len(outs))], dim=1)
        with torch.no_grad():
            torch.testing.assert_close(layer(x), expected)
    state.begin_step([None, None], [3, 4])
    assert state.step is None
    with torch.no_grad():
        assert torch.equal(layer(x), torch.zeros(7, sum(outs)))


def _copy(adapter, tmp_path, config=None, tensors=None):
    from safetensors.torch import load_file, save_file

    out = tmp_path / "bad"
    shutil.copytree(adapter, out)
    if config is not None:
        cfg = json.loads((out / "adapter_config.json").read_text())
        cfg.update(config)
        (out / "adapter_config.json").write_text(json.dumps(cfg))
    if tensors is not None:
        save_file(tensors(load_file(str(out / "adapter_model.safetensors"))), str(out / "adapter_model.safetensors"))
    return out


def _rename_layer(weights, layer):
    return {k.replace("layers.1.", f"layers.{layer}."): v for k, v in weights.items()}


def _widen_first_a(weights):
    key = next(k for k in sorted(weights) if "lora_A" in k)
    return {**weights, key: torch.zeros(weights[key].shape[0], 65)}


@pytest.mark.parametrize("change, message", [
    ({"config": {"use_dora": True}}, "adapter 'bad' uses DoRA (use_dora): not supported"),
    ({"config": {"modules_to_save": ["lm_head"]}}, "trains whole modules too"),
    ({"config": {"target_modules": ["q_proj", "embed_tokens"]}}, "targets ['embed_tokens']"),
    ({"config": {"r": 16}}, "has rank 4, adapter_config.json says r=16"),
    ({"tensors": lambda w: _rename_layer(w, 7)}, "it adapts layer 7, the model has 2 layers"),
    ({"tensors": _widen_first_a}, "layer 0 down_proj maps 65 -> 64 features, the model's maps 128 -> 64"),
    ({"tensors": lambda w: {k: v for k, v in w.items() if "layers.0.mlp.down_proj.lora_B" not in k}},
     "layer 0 down_proj has lora_A without its other half"),
])
def test_bad_adapter_stops_loading_with_a_clear_message(tiny_llama, adapter_a, tmp_path, change, message):
    bad = _copy(adapter_a, tmp_path, **change)
    with pytest.raises(ModelLoadError) as caught:
        load_model(Settings(model_id=str(tiny_llama), lora_adapters=f"bad={bad}"))
    assert message in str(caught.value)


def test_adapter_sources(tiny_llama, adapter_a, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ModelLoadError, match="'org/my-lora' is not a local folder and not in the local "
                                             "Hugging Face cache"):
        load_model(Settings(model_id=str(tiny_llama), lora_adapters="org/my-lora"))
    with pytest.raises(ModelLoadError, match="has no adapter_config.json"):
        load_model(Settings(model_id=str(tiny_llama), lora_adapters=f"x={tmp_path}"))
    assert lora.parse_adapter_list(f" {adapter_a} ,b=/x,, c = /y ") == [
        (str(adapter_a), str(adapter_a)), ("b", "/x"), ("c", "/y")]
    with pytest.raises(lora.LoraAdapterError, match="names adapter 'b' twice"):
        lora.parse_adapter_list("b=/x,b=/y")
    # a bare folder is named by the path as given, as TGI names adapters by their id
    assert load_model(Settings(model_id=str(tiny_llama), lora_adapters=str(adapter_a))).adapters == [str(adapter_a)]


def test_cli_flag_env_and_start_up_refusal(tiny_llama, tiny_gpt2):
    from opentgi import cli

    args = cli.build_parser().parse_args(["serve"])
    assert cli.settings_from(args, {"LORA_ADAPTERS": "a=/x,b=/y"}).lora_adapters == "a=/x,b=/y"
    args = cli.build_parser().parse_args(["serve", "--lora-adapters", "c=/z"])
    assert cli.settings_from(args, {"LORA_ADAPTERS": "a=/x"}).lora_adapters == "c=/z"
    # a bad adapter stops `serve` with the reason and no traceback
    with pytest.raises(SystemExit, match=r"^opentgi: adapter 'x': '/nonexistent/x' is not a local folder"):
        cli.serve(Settings(model_id=str(tiny_llama), lora_adapters="x=/nonexistent/x"))
    with pytest.raises(ModelLoadError, match="LoRA adapters are served on the paged path only"):
        load_model(Settings(model_id=str(tiny_gpt2), lora_adapters="x=/nonexistent/x"))


def test_bench_adapters_load(loaded, tiny_llama, tmp_path):
    """The benchmark's random adapters (opentgi.bench.lora, written without peft) are PEFT folders the
    loader takes; its op timing runs both ways."""
    from opentgi.bench.lora import lora_op_timings, write_random_adapters

    paths = write_random_adapters(loaded.hf_config, tmp_path, 2, 4)
    bench_loaded = load_model(Settings(model_id=str(tiny_llama), lora_adapters=",".join(map(str, paths))))
    assert bench_loaded.adapters == [str(p) for p in paths]
    assert bench_loaded.model.lora.rank == 4
    invariant, stacked, gather = lora_op_timings(loaded.hf_config, 2, 4, 3, repeats=1)
    assert invariant > 0 and stacked > 0 and gather > 0


def test_without_adapters_the_model_is_untouched(tiny_llama, loaded):
    plain = load_model(Settings(model_id=str(tiny_llama)))
    assert plain.adapters == [] and not hasattr(plain.model, "lora")
    assert not any(isinstance(m, lora.LoraLinear) for m in plain.model.modules())
    # with adapters, only the projections some adapter adapts are wrapped (a: q/v/down, b: all seven)
    wrapped = [n.rsplit(".", 1)[-1] for n, m in loaded.model.named_modules() if isinstance(m, lora.LoraLinear)]
    assert sorted(set(wrapped)) == ["down_proj", "gate_up_proj", "o_proj", "qkv_proj"]
    # batch-invariant (the default): one float32 AdapterLora per adapter, None where it adapts nothing
    qkv = loaded.model.model.layers[0].self_attn.qkv_proj
    assert [m is not None for m in qkv.adapters] == [True, True]
    assert loaded.model.model.layers[0].self_attn.o_proj.adapters[0] is None  # a: q/v/down only
    assert len(wrapped) == 4 * loaded.spec.num_layers
