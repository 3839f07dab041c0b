"""`python -m opentgi.bench write-gguf`: the shapes and type mixes it writes (the writer itself is
exercised by the tiny GGUF fixtures, tests/helpers/tiny_models.py)."""

from opentgi.bench import gguf_fixture


def test_write_gguf_takes_a_shape_and_the_q4_k_m_mix(monkeypatch, tmp_path):
    calls = []

    def writer(out, shape, layer_types, embedding_type, seed, progress):
        calls.append((shape, layer_types, embedding_type))
        path = tmp_path / "written.gguf"
        path.write_bytes(b"")
        return path

    monkeypatch.setattr(gguf_fixture, "write_random_llama_gguf", writer)
    out = tmp_path / "moe.gguf"
    gguf_fixture.main([str(out), "--shape", "qwen3-moe", "--layer-type", "Q4_K", "--down-type", "Q6_K"])
    gguf_fixture.main([str(out)])
    (moe, moe_types, _), (llama, llama_types, embedding) = calls
    assert (moe.arch, moe.experts, moe.experts_used, moe.intermediate) == ("qwen3moe", 64, 8, 768)
    assert moe_types == {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q4_K",
                         "ffn_gate": "Q4_K", "ffn_up": "Q4_K", "ffn_down": "Q6_K"}
    assert llama == gguf_fixture.LLAMA_1B and set(llama_types.values()) == {"Q4_1"} and embedding == "Q8_0"
