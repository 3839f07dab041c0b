"""LoRA adapters on mixture-of-experts blocks (models/layers/expert_lora.py): the tiny Qwen3-MoE and
Mixtral with PEFT adapters on every expert's projections, the router and attention, against
transformers + PEFT (prefill, decodes, a lone token's step; two adapters and base rows in one
batch; greedy tokens through the Engine); the block's rows keep their bits whatever else the step
holds; adapters that do not fit the experts are refused by name (2 ranks against 1:
tests/engine/test_lora_sharded.py)."""

from __future__ import annotations

import asyncio
import functools
import shutil

import pytest
import torch
from peft import PeftModel
from transformers import AutoConfig, AutoModelForCausalLM

from opentgi.config import Settings
from opentgi.engine.request import GenerationRequest, SamplingParams, StoppingParams
from opentgi.models.attention.torch_backend import TorchAttentionBackend
from opentgi.models.layers.adapter_lora import AdapterLora
from opentgi.models.layers.expert_lora import ExpertLora
from opentgi.models.layers.moe import SparseMoE
from opentgi.models.loader import ModelLoadError, load_model
from opentgi.models.lora import LoraAdapterError, LoraState, attach_lora, load_adapters
from opentgi.models.registry import build_paged_model
from tests.helpers import tiny_models
from tests.helpers.cpu_kernels import serve_linears
from tests.helpers.engine import running
from tests.helpers.paged import PROMPT, PagedRunner, load_paged

torch.set_num_threads(1)

TOL = {"atol": 1e-4, "rtol": 1e-4}
# adapter a: attention, every expert's projections and the router; b (another rank, rsLoRA): the
# projections of experts 0 and 2 only (a regex, as PEFT takes one)
TARGETS = {
    "qwen3_moe": (["q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "gate"],
                  r".*\.experts\.[02]\.(gate_proj|up_proj|down_proj)"),
    "mixtral": (["q_proj", "k_proj", "w1", "w2", "w3", "gate"], r".*\.experts\.[02]\.w[123]"),
}


@functools.cache
def adapters(family: str):
    path = tiny_models.tiny_family_path(family)
    a_targets, b_targets = TARGETS[family]
    return (path, tiny_models.tiny_lora_path(path, seed=5, r=4, alpha=8, targets=a_targets),
            tiny_models.tiny_lora_path(path, seed=6, r=8, alpha=4, use_rslora=True, targets=b_targets))


@functools.cache
def peft_model(family: str):
    path, a, b = adapters(family)
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    model = PeftModel.from_pretrained(base, str(a), adapter_name="a").eval()
    model.load_adapter(str(b), adapter_name="b")
    return model


def peft_logits(family: str, adapter: str | None, tokens: list[int]) -> torch.Tensor:
    model = peft_model(family)
    with torch.no_grad():
        if adapter is None:
            with model.disable_adapter():
                return model(torch.tensor([tokens])).logits[0]
        model.set_adapter(adapter)
        return model(torch.tensor([tokens])).logits[0]


@pytest.mark.parametrize("family", list(TARGETS))
def test_adapters_are_read_with_their_experts_and_router(family):
    path, a, b = adapters(family)
    model = load_paged(path)
    loaded = load_adapters(f"a={a},b={b}", model.config, str(path))
    names = ("gate_proj", "up_proj", "down_proj") if family == "qwen3_moe" else ("w1", "w3", "w2")
    dense = ["q_proj", "v_proj", "o_proj", *names] if family == "qwen3_moe" else ["q_proj", "k_proj"]
    assert loaded[0].target_modules == [*dense, "gate", *(f"experts.{n}" for n in names)]
    assert {m for _, m in loaded[1].weights} == {f"experts.{e}.{n}" for e in (0, 2) for n in names}
    attach_lora(model, loaded)
    blocks = [layer.feed_forward for layer in model.model.layers if hasattr(layer.feed_forward, "experts")]
    assert blocks and all(isinstance(block.lora, ExpertLora) for block in blocks)
    for block in blocks:  # a: the router and every expert; b: experts 0 and 2 only
        assert block.lora.router[0] is not None and block.lora.router[1] is None
        assert [[m is not None for m in per_expert] for per_expert in block.lora.gate_up] == [
            [True, True], [True, False], [True, True], [True, False]]


@pytest.mark.parametrize("family, batch_invariant", [("qwen3_moe", True), ("mixtral", True), ("qwen3_moe", False)])
def test_two_adapters_and_base_rows_in_one_batch_match_peft(family, batch_invariant):
    """Rows of a, b and the base model share a prefill step and two decode steps, then b's row
    decodes alone (the lone token's path): each row's logits are PEFT's with its own adapter (also
    with --nondeterministic's plain matmuls)."""
    path, a, b = adapters(family)
    model = build_paged_model(path, AutoConfig.from_pretrained(path), TorchAttentionBackend(), torch.float32,
                              torch.device("cpu"), batch_invariant=batch_invariant)
    assert model.batch_invariant == batch_invariant
    attach_lora(model, load_adapters(f"a={a},b={b}", model.config, str(path)))
    # seq -> (adapter, its tokens, how many of them the prefill step takes); the rest are decoded
    rows = {0: ("a", PROMPT[:23], 20), 1: ("b", PROMPT[4:30] + PROMPT[:3], 26), 2: (None, PROMPT[9:29], 17)}
    refs = {seq: peft_logits(family, adapter, tokens) for seq, (adapter, tokens, _) in rows.items()}
    for seq in (0, 1):
        assert not torch.allclose(refs[seq], peft_logits(family, None, rows[seq][1]), atol=1e-2)
    runner = PagedRunner(model)
    done = {seq: 0 for seq in rows}
    got: dict[int, list[torch.Tensor]] = {seq: [] for seq in rows}

    def step(new: dict[int, int]) -> None:
        seqs = list(new)
        model.lora.begin_step([rows[s][0] for s in seqs], [new[s] for s in seqs])
        hidden = runner.step({s: rows[s][1][done[s]:done[s] + new[s]] for s in seqs})
        model.lora.end_step()
        for s, logits in zip(seqs, model.compute_logits(hidden), strict=True):
            done[s] += new[s]
            got[s].append(logits)

    step({seq: prefill for seq, (_, _, prefill) in rows.items()})
    step(dict.fromkeys(rows, 1))
    step(dict.fromkeys(rows, 1))
    step({1: 1})
    for seq, (_, _, prefill) in rows.items():
        positions = list(range(prefill - 1, done[seq]))
        torch.testing.assert_close(torch.stack(got[seq]), refs[seq][positions], **TOL)


# --- the block alone: batch invariance and no work without adapter rows ------------------------------

HIDDEN, INTERMEDIATE, EXPERTS, RANK = 64, 96, 4, 4


def _block_with_lora(dtype: torch.dtype, top_k: int) -> tuple[SparseMoE, LoraState]:
    """A block in its row-invariant forms with two adapters' LoRA on the router and on experts 0, 1
    and 3 (expert 2 has none)."""
    torch.manual_seed(0)
    block = SparseMoE(HIDDEN, INTERMEDIATE, EXPERTS, top_k, True, "silu",
                      ("gate_proj", "up_proj", "down_proj")).to(dtype).eval()
    with torch.no_grad():
        block.gate.weight.mul_(20)
    block.fuse_projections()
    serve_linears(block, dtype)
    state = LoraState(["x", "y"], RANK, dtype, torch.device("cpu"))
    gen = torch.Generator().manual_seed(1)

    def adapter(parts: int, fan_in: int, out: int, rank: int) -> AdapterLora:
        a = (torch.randn(parts, rank, fan_in, generator=gen) * fan_in ** -0.5).to(dtype)
        return AdapterLora(a, [(torch.randn(rank, out, generator=gen) * 0.5).to(dtype) for _ in range(parts)])

    ranks = (RANK, 2 * RANK)  # x, y
    lora = ExpertLora(state, [adapter(1, HIDDEN, EXPERTS, r) for r in ranks],
                      [[None if e == 2 else adapter(2, HIDDEN, INTERMEDIATE, r) for r in ranks] for e in range(EXPERTS)],
                      [[None if e == 2 else adapter(1, INTERMEDIATE, HIDDEN, r) for r in ranks] for e in range(EXPERTS)])
    lora.make_row_invariant()
    block.lora = lora
    return block, state


def _run(block: SparseMoE, state: LoraState, x: torch.Tensor, adapters: list[str | None]) -> torch.Tensor:
    state.begin_step(adapters, [1] * len(adapters))
    try:
        return block(x)
    finally:
        state.end_step()


@pytest.mark.parametrize("top_k", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_bits_do_not_depend_on_the_other_rows_of_its_step(dtype, top_k):
    """Each token with its adapter (x, y or none) gets the same bits alone (the lone token's path),
    in any slice of the step, and in a step of one adapter; a base row gets the bits a step without
    adapter rows gives it."""
    block, state = _block_with_lora(dtype, top_k)
    x = torch.randn(40, HIDDEN, generator=torch.Generator().manual_seed(3)).to(dtype)
    adapters = [("x", "y", None, "y", "x")[t % 5] for t in range(40)]
    with torch.inference_mode():
        full = _run(block, state, x, adapters)
        plain = _run(block, state, x, [None] * 40)
        for t in range(40):
            assert torch.equal(_run(block, state, x[t:t + 1], adapters[t:t + 1]), full[t:t + 1])
        for start in range(0, 40, 7):
            assert torch.equal(_run(block, state, x[start:start + 7], adapters[start:start + 7]),
                               full[start:start + 7])
        for only in ("x", "y"):
            alone = _run(block, state, x, [a if a == only else None for a in adapters])
            rows = [t for t, a in enumerate(adapters) if a == only]
            assert torch.equal(alone[rows], full[rows])
        base_rows = [t for t, a in enumerate(adapters) if a is None]
        assert torch.equal(full[base_rows], plain[base_rows])
        assert not torch.allclose(full.float(), plain.float(), atol=1e-3)  # the adapters do change rows


def test_a_step_without_adapter_rows_does_no_lora_work_and_keeps_its_bits():
    block, state = _block_with_lora(torch.bfloat16, 2)
    calls = []
    for module in block.lora.modules():
        if isinstance(module, AdapterLora):
            module.register_forward_hook(lambda *_: calls.append(1))
    x = torch.randn(9, HIDDEN, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    with torch.inference_mode():
        with_lora = [_run(block, state, x, [None] * 9), _run(block, state, x[:1], [None])]
        assert not calls
        block.lora = None
        assert torch.equal(with_lora[0], block(x)) and torch.equal(with_lora[1], block(x[:1]))


def test_only_experts_that_take_adapter_rows_do_lora_work():
    """An expert runs the adapters of its rows only: one whose rows in the step are all base rows
    adds no LoRA (it would add zeros), and only y's matrices run where only y's rows are."""
    block, state = _block_with_lora(torch.float32, 2)
    x = torch.randn(9, HIDDEN, generator=torch.Generator().manual_seed(5))
    called = []
    add = block.lora.add_delta

    def spy(projection, e, slot, *args):
        if projection == "gate_up_proj":
            called.append((e, slot))
        return add(projection, e, slot, *args)

    block.lora.add_delta = spy
    adapters = ["y"] + [None] * 8
    with torch.inference_mode():
        state.begin_step(adapters, [1] * 9)
        _, experts = block.route(x, lora=True)  # token 0 routes as its adapter says
        _run(block, state, x, adapters)
    assert sorted(called) == sorted((e, 1) for e in experts[0].tolist())  # slot 1: y
    assert set(experts.flatten().tolist()) > {e for e, _ in called}  # the step used other experts, without LoRA


# --- through the Engine -------------------------------------------------------------------------------

MAX_NEW = 8


async def test_engine_greedy_tokens_match_peft_with_adapters_mixed():
    path, a, b = adapters("qwen3_moe")
    loaded = load_model(Settings(model_id=str(path), dtype="float32", lora_adapters=f"a={a},b={b}"))
    prompts = [PROMPT[:14], PROMPT[6:25]]
    model = peft_model("qwen3_moe")

    def want(adapter, ids):
        with torch.no_grad():
            kwargs = dict(max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None, pad_token_id=2,
                          attention_mask=torch.ones(1, len(ids), dtype=torch.long))
            if adapter is None:
                with model.disable_adapter():
                    return model.generate(input_ids=torch.tensor([ids]), **kwargs)[0, len(ids):].tolist()
            model.set_adapter(adapter)
            return model.generate(input_ids=torch.tensor([ids]), **kwargs)[0, len(ids):].tolist()

    jobs = [(adapter, i) for i in range(len(prompts)) for adapter in (None, "a", "b")]
    refs = {job: want(job[0], prompts[job[1]]) for job in jobs}
    assert refs[("a", 0)] != refs[(None, 0)] and refs[("b", 1)] != refs[(None, 1)]
    async with running(loaded, enable_prefix_caching=False) as engine:
        steps: list[set] = []
        begin = engine.runner.lora.begin_step
        engine.runner.lora.begin_step = lambda ids, counts: (steps.append(set(ids)), begin(ids, counts))

        async def tokens(adapter, ids):
            request = GenerationRequest(list(ids), SamplingParams(),
                                        StoppingParams(max_new_tokens=MAX_NEW, ignore_eos=True), adapter_id=adapter)
            return (await (await engine.submit(request)).result()).sequences[0].token_ids

        got = await asyncio.gather(*(tokens(adapter, prompts[i]) for adapter, i in jobs))
    assert dict(zip(jobs, got)) == refs
    assert {None, "a", "b"} in steps  # some step ran the three together


# --- refusals -------------------------------------------------------------------------------------------


def _edited(adapter, tmp_path, edit):
    from safetensors.torch import load_file, save_file

    out = tmp_path / "bad"
    shutil.copytree(adapter, out)
    weights = load_file(str(out / "adapter_model.safetensors"))
    save_file(edit(weights), str(out / "adapter_model.safetensors"))
    return out


def _rename(old: str, new: str):
    return lambda weights: {k.replace(old, new): v for k, v in weights.items()}


@pytest.mark.parametrize("family, edit, message", [
    ("qwen3_moe", _rename("layers.0.mlp.experts.", "layers.1.mlp.experts."),
     "adapter targets experts.down_proj/experts.gate_proj/experts.up_proj of layer 1, which "
     "Qwen3MoeForCausalLM does not have (its feed-forward block there has no experts)"),
    ("qwen3_moe", _rename("mlp.experts.3.", "mlp.experts.7."),
     "it adapts expert 7 of layer 0, the model has 4 experts"),
    ("mixtral", _rename(".w1.", ".gate_proj."),
     "adapter targets experts.gate_proj of layer 0, which MixtralForCausalLM does not have (its experts' "
     "projections are w1/w3/w2)"),
    ("mixtral", _rename("block_sparse_moe.experts.0.w1", "block_sparse_moe.w1"),
     "is not a LoRA A/B matrix of one of"),
])
def test_adapters_that_do_not_fit_the_experts_are_refused_by_name(family, edit, message, tmp_path):
    path, a, _ = adapters(family)
    bad = _edited(a, tmp_path, edit)
    with pytest.raises(ModelLoadError) as caught:
        load_model(Settings(model_id=str(path), dtype="float32", lora_adapters=f"bad={bad}"))
    assert message in str(caught.value)


def test_adapter_on_parameters_is_refused(tmp_path):
    """PEFT's `target_parameters` (LoRA on a weight tensor itself, for fused expert weights) is not
    applied here: refused by name rather than read as a module's LoRA."""
    import json

    path, a, _ = adapters("qwen3_moe")
    bad = tmp_path / "bad"
    shutil.copytree(a, bad)
    config = json.loads((bad / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**config, "target_parameters": ["experts.0.gate_proj.weight"]}))
    with pytest.raises(ModelLoadError, match=r"adapter 'bad' adapts parameters directly \(target_parameters="):
        load_model(Settings(model_id=str(path), dtype="float32", lora_adapters=f"bad={bad}"))


def test_expert_adapter_on_a_model_without_experts_is_refused():
    llama = tiny_models.tiny_llama_path()
    _, a, _ = adapters("qwen3_moe")
    model = load_paged(llama)
    with pytest.raises(LoraAdapterError, match="it adapts expert 0 of layer 0, the model has 0 experts"):
        attach_lora(model, load_adapters(f"a={a}", model.config, str(llama)))


def test_bench_adapters_on_a_mixture_of_experts_load(tmp_path):
    """The benchmark's random adapters (opentgi.bench.lora, --lora) adapt every expert and the
    router of a routed layer, the dense projections elsewhere, and load."""
    from transformers import AutoConfig

    from opentgi.bench.lora import write_random_adapters

    path = tiny_models.tiny_family_path("qwen3_moe")
    config = AutoConfig.from_pretrained(path)
    (folder,) = write_random_adapters(config, tmp_path, 1, 4)
    model = load_paged(path)
    (adapter,) = load_adapters(str(folder), model.config, str(path))
    assert (0, "experts.3.down_proj") in adapter.weights and (0, "gate") in adapter.weights
    assert (1, "gate_proj") in adapter.weights and (0, "gate_proj") not in adapter.weights
    attach_lora(model, [adapter])
    assert model.model.layers[0].mlp.lora is not None
