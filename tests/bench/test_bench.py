"""The benchmark's side-by-side load (bench/peers.py) and decode-step breakdown (bench/steps.py) on
the tiny Llama: they measure what they say (no speed is asserted here)."""

from __future__ import annotations

import asyncio
import os
import socket

import pytest

from conformance.live import free_port, serve
from opentgi.bench import peers as bench_peers
from opentgi.bench import steps as bench_steps
from opentgi.config import Settings
from opentgi.models.loader import load_model


def test_parse_peer():
    assert bench_peers.parse_peer("vllm=http://127.0.0.1:8202/") == ("vllm", "http://127.0.0.1:8202")
    for bad in ("vllm", "=http://x:1", "vllm=127.0.0.1:8202"):
        with pytest.raises(ValueError, match="NAME=http"):
            bench_peers.parse_peer(bad)


def test_side_by_side_table_has_ratios_and_memory():
    levels = [bench_peers.PeerLevel("opentgi", 1, 6, 384, 4.0, 0), bench_peers.PeerLevel("vllm", 1, 6, 384, 8.0, 0),
              bench_peers.PeerLevel("opentgi", 16, 32, 2048, 8.0, 0),
              bench_peers.PeerLevel("vllm", 16, 30, 1920, 6.0, 2)]
    lines = bench_peers.table(["opentgi", "vllm"], levels, {"opentgi": 512 * 2**20, "vllm": None})
    assert lines[0] == "| server | c=1 tokens/s | c=16 tokens/s | resident memory (MiB) |"
    assert lines[2] == "| opentgi | 96.0 | 256.0 | 512 |"
    assert lines[3] == "| vllm | 48.0 | 320.0 (2 errors) | – |"
    assert lines[4] == "| opentgi / vllm | 2.00x | 0.80x | – |"


def test_server_rss_finds_the_process_listening_on_the_port():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        assert bench_peers.listening_pid(port) == os.getpid()
        rss = bench_peers.server_rss(f"http://127.0.0.1:{port}")
    assert rss is not None and rss > 10 * 2**20
    assert bench_peers.server_rss("http://example.com:80") is None  # not on this machine


def test_completions_level_counts_usage_tokens(tiny_llama, smollm2_tokenizer):
    settings = Settings(model_id=str(tiny_llama), device="cpu", hostname="127.0.0.1", port=free_port(),
                        max_batch_total_tokens=4096)
    prompts = ["The quick brown fox", "Once upon a time"]
    with serve(settings, startup_timeout_s=120) as url:
        lv = asyncio.run(bench_peers.completions_level("opentgi", url, prompts, 2, 4, 5, 60))
        bad = asyncio.run(bench_peers.completions_level("x", url.replace(str(settings.port), str(free_port())),
                                                        prompts, 1, 2, 5, 60))
    assert (lv.requests, lv.errors) == (4, 0)
    assert 4 <= lv.tokens <= 20 and lv.throughput > 0  # up to 5 each; an EOS may end one early
    assert bad.requests == 0 and bad.errors == 2 and "ConnectError" in bad.first_error


def test_step_breakdown_splits_decode_steps(tiny_llama):
    loaded = load_model(Settings(model_id=str(tiny_llama)))
    settings = Settings(model_id=str(tiny_llama), max_batch_total_tokens=4096)
    ids = loaded.tokenizer("The quick brown fox", add_special_tokens=False)["input_ids"]
    result = bench_steps.measure(loaded, settings, [ids], concurrency=3, new_tokens=6)
    assert result.steps == 5  # one prefill step gives each row its first token, then 5 decode steps
    assert set(result.median_ms) == set(bench_steps.PARTS)
    assert result.median_ms["model"] > 0 and result.step_ms > 0
    # every part of the step is inside it (medians of a noisy machine need not add up exactly)
    assert all(v <= result.step_ms for k, v in result.median_ms.items() if k != "delivery")
    assert 0 <= result.native_ms < result.step_ms and 0 < result.host_ms <= result.step_ms
    lines = bench_steps.table([result])
    assert lines[0].endswith("| c=3 |") and any(line.startswith("| model |") for line in lines)
    assert any(line.startswith("| host: the step less them | ") and line.endswith("%) |") for line in lines)


@pytest.mark.slow  # the ci tier: a long run
def test_speculate_comparison_runs_both_servers(tiny_llama):
    """The --speculate mode: a plain and a speculating server on the code-editing prompts, their
    throughputs, the acceptance rate from /metrics and the outputs compared (float32: the same)."""
    import argparse
    import contextlib
    import re

    from opentgi.bench import speculate as bench_speculate
    loaded = load_model(Settings(model_id=str(tiny_llama)))
    started = []

    @contextlib.contextmanager
    def local_server(args):
        flags = args.server_arg
        speculate = int(flags[flags.index("--speculate") + 1]) if "--speculate" in flags else None
        started.append(speculate)
        settings = Settings(model_id=str(tiny_llama), hostname="127.0.0.1", port=free_port(),
                            max_batch_total_tokens=4096, speculate=speculate, dtype="float32")
        with serve(settings, startup_timeout_s=120) as url:
            yield url

    args = argparse.Namespace(num_threads=None, server_arg=[], speculate=3, speculate_rounds=1,
                              speculate_new_tokens=24)
    text = bench_speculate.speculate_comparison(args, loaded, local_server, lambda threads: "test machine")
    assert started == [None, 3]
    assert re.search(r"^\| plain \| \d+ \| [\d.]+ \| [\d.]+ \|$", text, re.M)
    assert re.search(r"^\| `--speculate 3` \| \d+ \| [\d.]+ \| [\d.]+ \|$", text, re.M)
    accepted, proposed = map(int, re.search(r"drafts accepted / proposed \| (\d+) / (\d+)", text).groups())
    assert 0 < accepted <= proposed
    assert "| prompts with the same greedy tokens on both servers | 4 of 4 |" in text


def test_every_bench_architecture_takes_the_paged_path():
    """`--architectures` builds each family at SmolLM2-135M's shape: every one must be served by the
    paged code (checked on the configs alone; the models are built by the benchmark)."""
    import transformers

    from opentgi.bench.architectures import ARCHITECTURES, SHAPE
    from opentgi.models.registry import paged_unsupported_reason

    for name, (config_class, model_class, extra) in ARCHITECTURES.items():
        config = getattr(transformers, config_class)(vocab_size=49152, architectures=[model_class],
                                                     **{**SHAPE, **extra})
        assert paged_unsupported_reason(config) is None, name


def test_architecture_table_has_ratios_to_llama():
    from opentgi.bench.architectures import table

    totals = {("qwen3", "llama", 1): [100, 2.0, 0], ("qwen3", "llama", 16): [800, 2.0, 0],
              ("qwen3", "qwen3", 1): [90, 2.0, 0], ("qwen3", "qwen3", 16): [840, 2.0, 1]}
    assert table(["qwen3"], [1, 16], totals) == [
        "| architecture | c=1 tokens/s | Llama beside it | ratio | c=16 tokens/s | Llama beside it | ratio |",
        "|---|---:|---:|---:|---:|---:|---:|",
        "| Qwen3ForCausalLM | 45.0 | 50.0 | 0.90x | 420.0 (1 errors) | 400.0 | 1.05x |"]


def test_engine_step_comparison_measures_each_engine_beside_llama(monkeypatch, capsys):
    """`--architectures ... --engine-steps`: both engines run in this process, each round and level,
    and the table holds the tokens/s their median decode steps allow (tiny models stand in for the
    SmolLM2-shaped ones here)."""
    import argparse

    from opentgi.bench import architectures
    from opentgi.bench.runner import server_settings
    from tests.helpers import tiny_models

    paths = {"llama": tiny_models.tiny_llama_path(), "qwen3_moe": tiny_models.tiny_family_path("qwen3_moe")}
    monkeypatch.setattr(architectures, "same_shape_model", lambda name, cache_dir: paths[name])
    args = argparse.Namespace(architectures="llama,qwen3_moe", concurrency="1,3", rounds=2, new_tokens=4,
                              server_arg=["--dtype", "float32"], num_threads=1, model_id=None)
    loads = []

    def own_thread(fn):  # the benchmark's loading thread (runner.py), here the calling one
        loads.append(fn)
        return fn()

    text = architectures.engine_step_comparison(args, ["Hello there", "def add(a, b):"], server_settings,
                                                lambda threads: "test machine", own_thread)
    assert len(loads) == 2  # each model loaded by `own_thread`, not on the engines' (serial) thread
    printed = capsys.readouterr().out
    for server in ("llama", "qwen3_moe"):
        for c in (1, 3):
            assert printed.count(f"qwen3_moe round 1, {server} engine, concurrency {c}: step ") == 1
            assert printed.count(f"qwen3_moe round 2, {server} engine, concurrency {c}: step ") == 1
    row = next(line for line in text.splitlines() if line.startswith("| Qwen3MoeForCausalLM |"))
    cells = [cell.strip() for cell in row.strip("|").split("|")][1:]
    assert len(cells) == 6 and all(float(cell.rstrip("x")) > 0 for cell in cells)
    assert "engine steps" in text and "Machine: test machine." in text


def test_architecture_comparison_warms_each_new_server_with_a_round_at_every_level(monkeypatch):
    """The Llama server stays up and warm through every architecture: each newly started one gets
    an unmeasured round at every level (same prompts and tokens) before its measured rounds."""
    import argparse
    import contextlib

    from opentgi.bench import architectures
    from opentgi.bench.http_load import LevelResult

    monkeypatch.setattr(architectures, "same_shape_model", lambda name, cache_dir: f"/models/{name}")
    calls = []

    @contextlib.contextmanager
    def local_server(server_args):
        yield f"url:{server_args.model_id.rsplit('/', 1)[-1]}"

    async def run_level(url, prompts, c, n, new_tokens, limit):
        calls.append((url, c, new_tokens))
        return LevelResult(c, n, n * new_tokens, 1.0, [], [], 0)

    args = argparse.Namespace(architectures="qwen3", concurrency="1,16", rounds=1, new_tokens=64, max_requests=64,
                              level_time_limit=10.0, server_arg=[], num_threads=1)
    architectures.architecture_comparison(args, ["a", "b"], local_server, run_level, lambda threads: "m")
    qwen3 = [call for call in calls if call[0] == "url:qwen3"]
    assert qwen3[:2] == [("url:qwen3", 1, 64), ("url:qwen3", 16, 64)]  # the warm-up round
    assert qwen3[2:] == [("url:qwen3", 1, 64), ("url:qwen3", 16, 64)]  # the measured one


def test_lora_comparison_on_a_sharded_server(monkeypatch, tiny_llama):
    """`--lora K,... --shards N` runs the LoRA comparison on an N-shard server (one --shards value)."""
    import contextlib
    from types import SimpleNamespace

    from transformers import AutoConfig

    from opentgi.bench import lora, runner
    from opentgi.bench.http_load import LevelResult

    with pytest.raises(SystemExit):
        runner.parse_args(["--lora", "0,1", "--shards", "1,2"])
    args = runner.parse_args(["--lora", "0,1", "--shards", "2", "--lora-rounds", "1", "--lora-concurrency", "2"])
    started = []

    @contextlib.contextmanager
    def fake_server(server_args):
        started.append(server_args.server_arg)
        yield "http://127.0.0.1:1"

    async def fake_level(url, prompts, concurrency, num_requests, new_tokens, time_limit_s, adapters=()):
        return LevelResult(concurrency, num_requests, 10 * num_requests, 1.0, [], [], 0)

    monkeypatch.setattr(lora, "local_server", fake_server)
    monkeypatch.setattr(lora, "run_level", fake_level)
    monkeypatch.setattr(lora, "lora_op_timings", lambda *a, **k: (1.0, 1.0, 1.0))
    loaded = SimpleNamespace(hf_config=AutoConfig.from_pretrained(tiny_llama), model_id="tiny")
    text = lora.lora_comparison(args, loaded, ["a prompt"])
    assert len(started) == 1 and started[0][-2:] == ["--num-shard", "2"] and "--lora-adapters" in started[0]
    assert "LoRA adapters mixed, tiny, --num-shard 2" in text


def test_moe_comparison_times_the_per_expert_loop_beside_grouped_experts():
    import torch

    from opentgi.bench import kernels as bench_kernels
    from opentgi.kernels import native

    native.load("native")
    torch.set_num_threads(1)
    results = bench_kernels.measure_moe(repeats=1, experts=8, dtype=torch.float32)  # top 8 of 8: all used
    assert [(rows, used) for rows, used, _ in results] == [(rows, 8) for rows in bench_kernels.MOE_ROWS]
    assert all(set(us) == {"per-expert loop", "grouped"} for _, _, us in results)
    table = bench_kernels.moe_table(results)
    assert table.count("\n") == len(results) + 1 and "x |" in table


def test_bandwidth_mode_sets_each_block_type_beside_the_streaming_read():
    import torch

    from opentgi.bench import kernels as bench_kernels
    from opentgi.kernels import native

    native.load("native")
    torch.set_num_threads(1)
    stream, results = bench_kernels.measure_bandwidth(megabytes=8, repeats=1)
    names = [name for name, _ in results]
    # each type also as served where the AVX-512 variant runs: repacked by 16 rows, at both passes
    # (a float32 model: not Q6_K)
    avx512 = native.loaded().isa == "avx512"
    both = ["1", "2"]
    served = {"Q6_K": []}
    want = []
    for name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS"):
        want.append(f"native {name}")
        if name in ("Q4_0", "Q4_1", "Q4_K", "Q6_K"):
            want.append(f"native {name} 2-pass")
        for passes in served.get(name, both) if avx512 else []:
            want.append(f"native {name}{' 2-pass' if passes == '2' else ''} by 16 rows")
    assert names == want
    assert stream > 0 and all(gbs > 0 for _, gbs in results)
    table = bench_kernels.bandwidth_table(stream, results)
    assert table.count("\n") == len(results) + 2 and "| native Q6_K 2-pass |" in table


def test_kernels_mode_times_each_asked_instruction_set_side_by_side():
    import torch

    from opentgi.bench import kernels as bench_kernels
    from opentgi.kernels import native

    native.load("native")
    torch.set_num_threads(1)
    best = native.supported_isas()[-1]
    found = bench_kernels.kernels(64, 256, torch.float32, True, ("scalar", best))
    forms = ["native Q4_K", "native Q4_K 2-pass"]
    if native.loaded().isa == "avx512":  # as served there: also repacked by 16 rows
        forms += ["native Q4_K by 16 rows", "native Q4_K 2-pass by 16 rows"]
    assert [n for n in found if n.startswith("native Q4_K")] == [f"{f} {isa}" for isa in ("scalar", best) for f in forms]
    x = torch.randn(3, 256)
    for name in ("native Q4_1", "native Q6_K 2-pass"):  # each variant's kernel, the same bits
        assert torch.equal(found[f"{name} scalar"][0](x), found[f"{name} {best}"][0](x))
    for form in forms[2:]:  # the repacked groups: the file's layout's bits
        assert torch.equal(found[f"{form} {best}"][0](x), found[f"{form.replace(' by 16 rows', '')} {best}"][0](x))
    results = bench_kernels.measure(1, torch.float32, True, ("scalar", best))
    assert f"native Q8_0 {best} (us)" in bench_kernels.table(results)
