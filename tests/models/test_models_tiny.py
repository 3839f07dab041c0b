"""The test models themselves: real SmolLM2 tokenizer, deterministic cached builds."""

from __future__ import annotations

import json

from tests.helpers import tiny_models


def test_smollm2_tokenizer_matches_the_original(smollm2_tokenizer):
    tok = smollm2_tokenizer
    assert len(tok) == 49152
    assert (tok.bos_token, tok.eos_token, tok.pad_token, tok.unk_token) == (
        "<|im_start|>", "<|im_end|>", "<|im_end|>", "<|endoftext|>")
    assert tok("Hello world").input_ids == [19556, 905]  # no bos prepended
    text = "Hello  world ▁x é 漢字\n\tdone"
    assert tok.decode(tok(text).input_ids) == text
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                     tokenize=False)
    assert prompt.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert prompt.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert tok.convert_tokens_to_ids("<fim_prefix>") == tok.unk_token_id  # no FIM tokens


def test_models_are_cached_and_deterministic(tiny_llama):
    assert tiny_models.tiny_llama_path() == tiny_llama
    other_seed = tiny_models.tiny_llama_path(seed=1)
    assert other_seed != tiny_llama
    assert (tiny_llama / "model.safetensors").read_bytes() != (other_seed / "model.safetensors").read_bytes()
    generation = json.loads((tiny_llama / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [2, 0]
    config = json.loads((tiny_llama / "config.json").read_text())
    assert config["vocab_size"] == 49152 and config["tie_word_embeddings"] is True


def test_fim_model_has_fim_tokens(tiny_fim_llama):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_fim_llama)
    ids = tok.convert_tokens_to_ids(tiny_models.FIM_TOKENS)
    assert ids == [49152, 49153, 49154, 49155]
    assert tok("<fim_prefix>def f():<fim_suffix>\n<fim_middle>").input_ids[0] == 49152
    assert json.loads((tiny_fim_llama / "config.json").read_text())["vocab_size"] == 49156
