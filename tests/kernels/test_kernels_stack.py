"""A decode step's layers in one native call (models/families/native_stack.py): the hidden states
and the KV cache it leaves are the module-by-module step's bit for bit, in float32 and bfloat16,
for one row and for several rows of several tokens, with q/k/v biases, with projections of one
block type and of several side by side, and for Qwen3's, Gemma 2/3's and Qwen3-MoE's and Mixtral's
layers (`--quantize int8`: q/k norms, sandwich norms, GeGLU, soft-capping, windows, two RoPE tables,
routed experts beside dense layers), and steps with prompt tokens in their own form (the prompt
attention kernel for them, the decode one beside them); steps it does not take (replaced
projections) go through the modules."""

from __future__ import annotations

import pytest
import torch

from opentgi.config import Settings
from opentgi.kernels import native
from opentgi.models.attention.metadata import AttentionMetadata
from opentgi.models.families.native_stack import NativeDecodeStack
from opentgi.models.loader import load_model
from opentgi.models.quantization.linear import ConcatLinear
from tests.helpers import tiny_models
from tests.helpers.paged import PagedRunner

torch.set_num_threads(1)

# one type per fused projection (q/k/v and gate/up stack into one weight), four families in all
UNIFORM = {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q4_K", "attn_output": "Q4_0",
           "ffn_gate": "Q4_1", "ffn_up": "Q4_1", "ffn_down": "Q6_K"}


@pytest.fixture(scope="module")
def uniform_gguf():
    return tiny_models.tiny_gguf_path(layer_types=UNIFORM)


def load(path, dtype: str, tmp_path_factory, quantize: str | None = None):
    return load_model(Settings(model_id=str(path), dtype=dtype, kernels="native", quantize=quantize,
                               cache_dir=str(tmp_path_factory.mktemp("cache")))).model


@pytest.fixture(scope="module")
def float32_model(kernels, uniform_gguf, tmp_path_factory):
    return load(uniform_gguf, "float32", tmp_path_factory)


@pytest.fixture(scope="module")
def mixed_bf16_model(kernels, tmp_path_factory):
    """q, k, v in three block types, gate and up in two (parts side by side), in bfloat16."""
    return load(tiny_models.tiny_gguf_path(), "bfloat16", tmp_path_factory)


class Toggled:
    """The model's forward with its native stack on or off."""

    def __init__(self, model, on: bool):
        self.model, self.on, self.spec = model, on, model.spec

    def __call__(self, *args):
        stack = self.model.native_stack
        if not self.on:
            self.model.native_stack = None
        try:
            return self.model(*args)
        finally:
            self.model.native_stack = stack


class CountingStack:
    def __init__(self, stack):
        self.stack, self.taken, self.embedding = stack, [], stack.embedding

    def __call__(self, *args):
        out = self.stack(*args)
        self.taken.append(out is not None)
        return out


def run_both(model, steps: list[dict[int, list[int]]], kv_dtype: torch.dtype | None = None,
             prompts: list[dict[int, int] | None] | None = None):
    fused, modules = PagedRunner(Toggled(model, True), kv_dtype), PagedRunner(Toggled(model, False), kv_dtype)
    for new_tokens, prompt in zip(steps, prompts or [None] * len(steps), strict=True):
        a, b = fused.step(new_tokens, prompt), modules.step(new_tokens, prompt)
        assert torch.equal(a, b)
    for (ka, va), (kb, vb) in zip(fused.kv_caches, modules.kv_caches, strict=True):
        assert torch.equal(ka, kb) and torch.equal(va, vb)


@pytest.mark.parametrize("file, dtype", [("uniform", "float32"), ("mixed", "bfloat16"), ("qwen3", "bfloat16"),
                                         ("gemma2", "float32"), ("gemma3", "bfloat16"), ("gemma3", "float32"),
                                         ("qwen3_moe", "bfloat16"), ("mixtral", "float32"),
                                         ("uniform", "float32/float16"), ("gemma3", "bfloat16/float16"),
                                         ("gemma2", "float32/float16")])
def test_decode_steps_equal_the_modules_bit_for_bit(request, float32_model, uniform_gguf, tmp_path_factory, file,
                                                     dtype):
    """dtype: the model's, or the model's/the KV cache's (--kv-cache-dtype: the stack stores keys and
    values rounded as the modules' `.to(cache dtype)` does)."""
    dtype, _, kv = dtype.partition("/")
    kv_dtype = getattr(torch, kv) if kv else None
    if file == "mixed":  # q, k, v in three block types, gate and up in two: parts side by side
        model = request.getfixturevalue("mixed_bf16_model")
        assert type(model.model.layers[0].self_attn.qkv_proj).__name__ == "ConcatLinear"
    elif file != "uniform":  # the family's tiny model, its projections Q8_0 blocks
        model = load(tiny_models.tiny_family_path(file), dtype, tmp_path_factory, quantize="int8")
        layout = model.layout
        assert layout.structure.qk_norm == (file not in ("gemma2", "mixtral"))
        assert layout.moe == {"qwen3_moe": (True, False), "mixtral": (True, True)}.get(file, (False, False))
        if layout.moe[0] and native.loaded().isa == "avx512":  # experts repacked by 16 rows, grouped again
            moe = model.model.layers[0].feed_forward
            assert moe.grouped.gate_up_format.qtype == moe.grouped.down_format.qtype == native.Q8_0_R16
            assert moe.grouped.gate_up[0] is moe.experts[0].gate_up_proj.weight_format.blocks
        if file.startswith("gemma"):  # windows shorter than the prompts; Gemma 2 soft-caps, Gemma 3 has 2 tables
            assert layout.structure.sandwich_norms and layout.act == "gelu_pytorch_tanh" and layout.windows[0] == 8
            assert (layout.attn_softcap, len(model.rotary)) == ((2.0, 1) if file == "gemma2" else (None, 2))
    else:
        model = float32_model
    stack = model.native_stack
    assert stack is not None
    counting = model.native_stack = CountingStack(stack)
    prompts = {0: list(range(5, 40)), 1: list(range(100, 117)), 2: [7, 8, 9]}
    steps = [prompts, {0: [11]}, {0: [12], 1: [13], 2: [14]}, {1: [15, 16, 17], 2: [18, 19]}, {0: [20], 2: [21]}]
    try:
        run_both(model, steps, kv_dtype)
    finally:
        model.native_stack = stack
    # PagedRunner tells no prompt tokens: every token in the decode row's form, every step the stack's
    assert counting.taken == [True] * len(steps)


@pytest.mark.parametrize("file, dtype", [("uniform", "float32"), ("mixed", "bfloat16"), ("gemma3", "bfloat16"),
                                         ("qwen3_moe", "bfloat16")])
def test_steps_with_prompt_tokens_in_their_own_form_equal_the_modules_bit_for_bit(request, float32_model,
                                                                                   tmp_path_factory, file, dtype):
    """With the prompt form (batch invariance's, where the start-up probe passes it), a step's
    prompt tokens take the prompt attention kernel and its generated tokens the decode one: the
    stack takes such steps (a prompt alone, prompts beside decode rows, a prompt's chunk after its
    cached part, one-token prompts), each form's rows gathered, with the modules' bits."""
    if file == "mixed":
        model = request.getfixturevalue("mixed_bf16_model")
    elif file != "uniform":
        model = load(tiny_models.tiny_family_path(file), dtype, tmp_path_factory, quantize="int8")
    else:
        model = float32_model
    stack = model.native_stack
    backend = stack.backend
    assert backend.batch_invariant
    counting = model.native_stack = CountingStack(stack)
    steps = [{0: list(range(5, 40))}, {0: [11], 1: list(range(100, 117)), 2: [7]},
             {0: [12], 1: [13], 2: [8, 9, 10], 3: list(range(60, 90))}, {1: [15], 2: [18], 3: list(range(90, 99))},
             {0: [20], 3: [21], 4: [5]}]
    prompts = [{0: 35}, {1: 17, 2: 1}, {2: 3, 3: 30}, {3: 9}, {4: 1}]
    form, backend.prompt_form = backend.prompt_form, True
    try:
        run_both(model, steps, prompts=prompts)
    finally:
        backend.prompt_form = form
        model.native_stack = stack
    assert counting.taken == [True] * len(steps)


class Logits:
    """A PagedRunner's model: every row's logits, of the stack's one call or of forward and head."""

    def __init__(self, model, fused: bool):
        self.model, self.fused, self.spec = model, fused, model.spec

    def __call__(self, *args):
        if self.fused:
            out = self.model.decode_logits(*args)
            assert out is not None
            return out
        return self.model.compute_logits(Toggled(self.model, False)(*args))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_logits_of_the_stacks_call_equal_the_heads_of_the_modules(request, dtype):
    model = request.getfixturevalue("float32_model" if dtype == "float32" else "mixed_bf16_model")
    assert model.native_stack.head is not None  # the tied Q8_0 head
    fused, modules = PagedRunner(Logits(model, True)), PagedRunner(Logits(model, False))
    for new_tokens in [{0: list(range(5, 30)), 1: [3, 4]}, {0: [9], 1: [10]}, {1: [12]}]:
        a, b = fused.step(new_tokens), modules.step(new_tokens)
        assert a.dtype == torch.float32 and a.shape[-1] == model.config.vocab_size
        assert torch.equal(a, b)


class GreedyAndLogits:
    """The stack's call for the greedy tokens, checked against numpy's argmax of the same step's
    logits (the step run twice: the second writes the cache slots the first wrote, alike)."""

    def __init__(self, model, vocab: int):
        self.model, self.vocab, self.spec = model, vocab, model.spec

    def __call__(self, *args):
        tokens = self.model.decode_logits(*args, greedy=self.vocab)
        logits = self.model.decode_logits(*args)
        assert tokens.dtype == torch.int64
        assert tokens.tolist() == logits[:, :self.vocab].numpy().argmax(axis=-1).tolist()
        return logits


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_tokens_of_the_stacks_call_are_the_argmax_of_its_logits(request, dtype):
    model = request.getfixturevalue("float32_model" if dtype == "float32" else "mixed_bf16_model")
    for vocab in (model.config.vocab_size, model.config.vocab_size - 7):  # the sampler's, below the head's
        runner = PagedRunner(GreedyAndLogits(model, vocab))
        for new_tokens in [{0: [5], 1: [3]}, {0: [9], 1: [10]}, {1: [12]}]:
            runner.step(new_tokens)


def test_biases_are_added_as_the_modules_add_them(float32_model):
    model = float32_model
    gen = torch.Generator().manual_seed(0)
    # a GGUF's q, k and v stay the file's blocks side by side (ConcatLinear): a bias on each part
    linears = [part for layer in model.model.layers for linear in (layer.self_attn.qkv_proj, layer.mlp.down_proj)
               for part in getattr(linear, "parts", [linear])]
    for linear in linears:
        linear.bias = torch.randn(linear.out_features, generator=gen)
    try:
        model.native_stack = NativeDecodeStack.build(model)
        assert model.native_stack is not None
        run_both(model, [{0: list(range(5, 30)), 1: [3, 4]}, {0: [9], 1: [10]}, {0: [11], 1: [12]}])
    finally:
        for linear in linears:
            linear.bias = None
        model.native_stack = NativeDecodeStack.build(model)


def test_a_replaced_projection_takes_the_modules_and_a_prompt_step_the_stack(float32_model):
    model = float32_model
    stack = model.native_stack
    runner = PagedRunner(model)
    runner.step({0: list(range(5, 20))})
    h = torch.zeros(1, model.config.hidden_size)
    positions = torch.tensor([15])
    def meta(prompt: list[int] | None):
        return AttentionMetadata(
            slot_mapping=torch.tensor([runner.tables[0][0] * 16 + 15]), cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32),
            cu_seqlens_k=torch.tensor([0, 16], dtype=torch.int32), max_seqlen_q=1, max_seqlen_k=16,
            context_lens=torch.tensor([16], dtype=torch.int32),
            block_tables=torch.tensor([runner.tables[0]], dtype=torch.int32), decode_only=True,
            prompt_new_tokens=prompt)

    assert stack(h, positions, meta(None), runner.kv_caches) is not None
    form, stack.backend.prompt_form = stack.backend.prompt_form, True  # prompt tokens in their own form
    try:  # the stack takes them (its rows in both forms), but not with the LM head: their logits are few
        assert stack(h, positions, meta([1]), runner.kv_caches) is not None
        assert stack(h, positions, meta([1]), runner.kv_caches, logits=True) is None
    finally:
        stack.backend.prompt_form = form
    assert stack.embedding is not None  # the file's Q8_0 embedding: token ids are looked up in the call
    with pytest.raises(RuntimeError, match="out of the embedding"):
        stack(torch.tensor([model.config.vocab_size]), positions, meta(None), runner.kv_caches)
    layer = model.model.layers[1]
    original = layer.mlp.down_proj
    layer.mlp.down_proj = torch.nn.Identity()  # as an adapter's wrapper replaces it
    try:
        assert stack(h, positions, meta(None), runner.kv_caches) is None
    finally:
        layer.mlp.down_proj = original
    assert stack(h, positions, meta(None), runner.kv_caches) is not None
    head = model.logits_proj  # the head the call ends with, replaced: the stack steps aside too
    model.logits_proj = torch.nn.Identity()
    try:
        assert stack(h, positions, meta(None), runner.kv_caches) is None
    finally:
        model.logits_proj = head


def test_a_projection_of_another_format_gets_no_stack(float32_model):
    layer = float32_model.model.layers[0]
    original = layer.mlp.down_proj
    layer.mlp.down_proj = torch.nn.Linear(original.in_features, original.out_features, bias=False)  # dense
    try:
        assert NativeDecodeStack.build(float32_model) is None
    finally:
        layer.mlp.down_proj = original
    assert NativeDecodeStack.build(float32_model) is not None


def test_projections_side_by_side_stay_the_files_pages(float32_model):
    """q/k/v and gate/up of a GGUF are not copied into one weight: gate, up and v stay views of the
    file (q and k are the file's rows reordered for RoPE by halves: their own copies), or where the
    AVX-512 variant runs, their own groups of 16 rows (gguf_blocks.repack_by_16_rows)."""
    def held(fmt) -> bool:
        return fmt.mapped or (fmt.qtype in native.BY_16_ROWS.values() and native.loaded().isa == "avx512")

    for layer in float32_model.model.layers:
        qkv, gate_up = layer.self_attn.qkv_proj, layer.mlp.gate_up_proj
        assert type(qkv) is ConcatLinear and type(gate_up) is ConcatLinear
        assert held(qkv.parts[-1].weight_format) and all(held(p.weight_format) for p in gate_up.parts)


def test_without_batch_invariance_steps_of_several_prompts_run(float32_model):
    """`--nondeterministic` (the attention backend without batch invariance, as the model sets it)
    attends several fresh prompts of a step with one float mask in the hidden states' dtype: the
    call, given token ids (its embedding looked up inside), plans in the model's dtype, not the
    ids', and the steps equal the modules'."""
    backend = float32_model.native_stack.backend
    assert float32_model.native_stack.embedding is not None and backend.batch_invariant
    backend.batch_invariant = False
    try:
        run_both(float32_model, [{0: list(range(5, 15)), 1: list(range(30, 38))}, {0: [3], 1: [4]}])
    finally:
        backend.batch_invariant = True
