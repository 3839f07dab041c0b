"""Tensor parallelism (`--num-shard`): the shard plan, TGI's launcher rules, and a 2-rank server
(gloo on CPU, spawned processes) against a 1-shard server on the same tiny model.

The 2-shard server is a real `opentgi serve --num-shard 2` process shared by the tests of this
module; the last test kills one of its ranks (so it runs last, and the fixture tolerates that).
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import re
import signal
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from conformance.live import free_port, serve
from opentgi.cli import main as cli_main
from opentgi.cli import resolve_shards
from opentgi.config import Settings
from opentgi.models.parallel import ShardingError, ShardPlan
from tests.helpers.servers import CHUNK, SERVER_FLAGS, spawn_server, stop, wait_ready

ROOT = Path(__file__).resolve().parents[2]


def _config(heads, kv, hidden=64, inter=128, vocab=100):
    return SimpleNamespace(num_attention_heads=heads, num_key_value_heads=kv, hidden_size=hidden,
                           intermediate_size=inter, vocab_size=vocab)


def test_shard_plan_splits_whole_kv_groups():
    # SmolLM2-135M: 9 heads over 3 kv heads, 2 ranks -> 2 groups + 1 group
    plans = [ShardPlan.of(_config(9, 3, hidden=576, inter=1536, vocab=49152), r, 2) for r in range(2)]
    assert [(p.q_heads, p.kv_heads) for p in plans] == [((0, 6), (0, 2)), ((6, 9), (2, 3))]
    assert [p.intermediate for p in plans] == [(0, 768), (768, 1536)]
    assert [(p.vocab_start, p.vocab_local) for p in plans] == [(0, 24576), (24576, 24576)]


def test_shard_plan_replicates_kv_heads_when_fewer_than_ranks():
    plans = [ShardPlan.of(_config(8, 2), r, 4) for r in range(4)]
    assert [p.q_heads for p in plans] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert [p.kv_heads for p in plans] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert ShardPlan.of(_config(4, 4, vocab=10), 2, 3).vocab_local == 4  # 4 + 4 + 2, last padded


def test_shard_plan_refuses_splits_that_do_not_fit():
    with pytest.raises(ShardingError, match="only 4 attention heads"):
        ShardPlan.of(_config(4, 2), 0, 8)
    with pytest.raises(ShardingError, match=r"at most 2, or a multiple of 2 that divides 4 \(possible: 1, 2, 4\)"):
        ShardPlan.of(_config(4, 2), 0, 3)


def test_plan_slices_read_only_this_ranks_part():
    import torch

    plan = ShardPlan.of(_config(4, 2, hidden=8, inter=6, vocab=5), 1, 2)  # head_dim 2
    full = torch.arange(8 * 8).reshape(8, 8)
    reads = []

    def read(index):
        reads.append(index)
        return full[index]

    assert plan.slice("model.layers.0.self_attn.q_proj.weight", (8, 8), read).equal(full[4:8])
    assert plan.slice("model.layers.0.self_attn.k_proj.weight", (4, 8), read).equal(full[2:4])
    assert plan.slice("model.layers.0.self_attn.o_proj.weight", (8, 8), read).equal(full[:, 4:8])
    assert plan.slice("model.layers.0.mlp.down_proj.weight", (8, 6), read).equal(full[:, 3:6])
    assert plan.slice("model.layers.0.self_attn.o_proj.bias", (8,), read).abs().sum() == 0  # rank 0's
    embed = plan.slice("model.embed_tokens.weight", (5, 8), read)
    assert embed.shape == (3, 8) and embed[:2].equal(full[3:5]) and embed[2].abs().sum() == 0
    assert all(i != slice(None) for i in reads[:4])


@pytest.mark.parametrize(("values", "environ", "expected"), [
    ({}, {}, (1, None)),
    ({"num_shard": 2}, {}, (2, None)),
    ({"sharded": True, "num_shard": 4}, {}, (4, None)),
    ({"sharded": True}, {"CUDA_VISIBLE_DEVICES": "0,1,2"}, (3, None)),
    ({}, {"CUDA_VISIBLE_DEVICES": "0,1"}, (2, None)),  # TGI: no flags = every visible device
    ({"sharded": False}, {"CUDA_VISIBLE_DEVICES": "0,1"}, (1, None)),
    ({"rank": 1, "world_size": 2}, {}, (2, 1)),  # started externally (env://)
])
def test_num_shard_follows_tgi_launcher(values, environ, expected):
    assert resolve_shards(dict(values), environ) == expected


@pytest.mark.parametrize(("values", "message"), [
    ({"sharded": True, "num_shard": 1}, "`sharded` is true but `num_shard` <= 1"),
    ({"sharded": True}, "needs --num-shard or CUDA_VISIBLE_DEVICES"),
    ({"num_shard": 0}, "`num_shard` cannot be < 1"),
    ({"rank": 2, "world_size": 2}, "RANK 2 is outside 0..1"),
])
def test_num_shard_errors(values, message):
    with pytest.raises(SystemExit, match=re.escape(message)):
        resolve_shards(dict(values), {})


def test_env_vars_num_shard_and_sharded(monkeypatch):
    from opentgi.cli import build_parser, settings_from

    args = build_parser().parse_args(["serve"])
    assert settings_from(args, {"NUM_SHARD": "2"}).num_shard == 2
    with pytest.raises(SystemExit, match="num_shard` <= 1"):
        settings_from(args, {"SHARDED": "true", "NUM_SHARD": "1"})


def test_start_up_errors_before_any_rank_starts(tiny_llama, capsys):
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        _start_up_errors(tiny_llama)
    finally:  # cli_main logs to the captured stderr of this test; later tests must not write there
        root.handlers[:], root.level = handlers, level


def _start_up_errors(tiny_llama):
    with pytest.raises(SystemExit, match=r"--num-shard 3: cannot split the model 3 ways: its 4 attention heads"):
        cli_main(["serve", "--model-id", str(tiny_llama), "--num-shard", "3"])
    with pytest.raises(SystemExit, match="does not exist|no config.json|not a local folder"):
        cli_main(["serve", "--model-id", str(tiny_llama / "missing.gguf"), "--num-shard", "2"])


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.fixture(scope="module")
def sharded(tiny_llama):
    port = free_port()
    # with speculative decoding: the drafts' logits come back from the shards too
    proc = spawn_server(tiny_llama, port, "--num-shard", "2", "--speculate", "3", *SERVER_FLAGS)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, url)
        yield SimpleNamespace(proc=proc, url=url)
    finally:
        stop(proc)


@pytest.fixture(scope="module")
def single(tiny_llama):
    settings = Settings(model_id=str(tiny_llama), hostname="127.0.0.1", port=free_port(), num_threads=1,
                        chunked_prefill_tokens=CHUNK, max_batch_total_tokens=4096, dtype="float32")
    with serve(settings) as url:
        yield url


PROMPTS = [
    "Hello",
    "The quick brown fox jumps over the lazy dog, and then it runs far away into the forest.",
    "The quick brown fox jumps over the lazy dog, and then it sleeps",  # shares a prefix (cached)
    "One two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
    "sixteen seventeen eighteen nineteen twenty",
    "a b",
]


def _greedy_tokens(url: str, prompt: str, max_new_tokens: int) -> list[int]:
    body = {"inputs": prompt, "parameters": {"max_new_tokens": max_new_tokens, "details": True,
                                             "decoder_input_details": True}}
    response = httpx.post(f"{url}/generate", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return [t["id"] for t in response.json()["details"]["tokens"]]


@pytest.mark.slow  # a 2-rank server: processes that talk over gloo
def test_greedy_batch_matches_one_shard(sharded, single):
    def batch(url):  # all at once: mixed-length prompts batched together, long ones chunked
        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
            return list(pool.map(lambda p: _greedy_tokens(url, p, 24), PROMPTS * 2))

    got = batch(sharded.url)
    assert got == batch(single)
    assert got[:len(PROMPTS)] == got[len(PROMPTS):]  # the repeats ran on cached prefixes


@pytest.mark.slow  # a 2-rank server: processes that talk over gloo
def test_seeded_sampling_reproduces(sharded):
    body = {"inputs": "Once upon a time", "parameters": {"max_new_tokens": 16, "do_sample": True,
                                                         "temperature": 1.5, "seed": 1234, "details": True}}
    runs = [httpx.post(f"{sharded.url}/generate", json=body, timeout=60).json() for _ in range(2)]
    assert runs[0]["details"]["tokens"] == runs[1]["details"]["tokens"]
    other = {**body, "parameters": {**body["parameters"], "seed": 99}}
    assert httpx.post(f"{sharded.url}/generate", json=other, timeout=60).json() != runs[0]


def _route_answers(url: str) -> dict:
    c = httpx.Client(base_url=url, timeout=120)
    gen = {"inputs": "What is AI?", "parameters": {"max_new_tokens": 8}}
    answers = {
        "/generate": c.post("/generate", json=gen).json()["generated_text"],
        "/": c.post("/", json=gen).json()[0]["generated_text"],
        "/tokenize": [t["id"] for t in c.post("/tokenize", json={"inputs": "What is AI?"}).json()],
        "/v1/chat/completions": c.post("/v1/chat/completions", json={
            "model": "tgi", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8,
            "temperature": 0}).json()["choices"][0]["message"]["content"],
        "/v1/completions": c.post("/v1/completions", json={
            "model": "tgi", "prompt": "What is AI?", "max_tokens": 8, "temperature": 0}).json()["choices"][0]["text"],
        "/lightllm/generate": c.post("/lightllm/generate", json=gen).json()["generated_text"],
        "/v1/llm/completions": c.post("/v1/llm/completions", json={
            "prompt": "What is AI?", "model": "tiny", "max_new_tokens": 8,  # top_p this small: greedy
            "top_p": 1e-6}).json()["data"]["choices"][0]["text"],
    }
    for path in ("/generate_stream", "/lightllm/generate_stream"):
        with c.stream("POST", path, json=gen) as response:
            events = [json.loads(line[5:]) for line in response.iter_lines() if line.startswith("data:")]
        answers[path] = [e["token"]["id"] for e in events]
    return answers


@pytest.mark.slow  # a 2-rank server: processes that talk over gloo
def test_every_route_answers_as_one_shard(sharded, single):
    got = _route_answers(sharded.url)
    assert got == _route_answers(single)
    assert len(got["/generate_stream"]) == 8 and got["/generate"]


@pytest.mark.slow  # a 2-rank server: processes that talk over gloo
def test_info_and_metrics(sharded, single):
    info = httpx.get(f"{sharded.url}/info").json()
    assert {k: v for k, v in info.items()} == httpx.get(f"{single}/info").json()
    assert httpx.get(f"{sharded.url}/health").status_code == 200
    metrics = httpx.get(f"{sharded.url}/metrics").text
    success = re.search(r"^tgi_request_success (\S+)$", metrics, re.M)
    assert success and float(success.group(1)) >= 2 * len(PROMPTS) + 3
    assert re.search(r"^tgi_queue_size 0(\.0)?$", metrics, re.M)
    assert re.search(r"^tgi_batch_current_size 0(\.0)?$", metrics, re.M)


@pytest.mark.slow  # a 2-rank server: processes that talk over gloo
def test_killed_rank_makes_the_server_exit(sharded):
    """Runs last: it breaks the shared server. A rank killed -> unhealthy, a clear message, a
    non-zero exit within seconds, no process left."""
    proc = sharded.proc
    workers = [p for p in _children(proc.pid)
               if "spawn_main" in Path(f"/proc/{p}/cmdline").read_text(errors="replace")]
    assert len(workers) == 1
    helpers = [p for p in _children(proc.pid) if p not in workers]
    os.kill(workers[0], signal.SIGKILL)
    started = time.monotonic()
    code = proc.wait(30)
    assert code != 0 and time.monotonic() - started < 15
    stderr = proc.stderr.read()
    assert stderr.count("shards: tensor-parallel group broken: shard 1 exited with code -9") == 1, stderr
    time.sleep(1)
    assert not any(_alive(p) for p in workers + helpers)


def _scores(url: str) -> list[float]:
    chats = ["<|im_start|>user\nhi<|im_end|>\n", "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"]
    replies = [httpx.post(f"{url}/get_score", json={"chat": c}, timeout=60) for c in chats]
    assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
    return [r.json()["score"] for r in replies]


@pytest.mark.slow  # a 2-rank server: processes that talk over gloo
def test_env_rendezvous_hung_rank_and_no_orphans(tiny_reward):
    """Ranks started one by one with torch's env:// variables (as deploy/kubernetes/multi-node does):
    rank 0 serves, rank 1 only computes; a reward model's /get_score (LightLLM) scores as one shard.
    Rank 1 frozen (SIGSTOP) -> rank 0 unhealthy, one clear message, non-zero exit within seconds;
    rank 1, resumed, finds rank 0 gone and exits too."""
    port, master_port = free_port(), free_port()
    common = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master_port)}
    worker = spawn_server(tiny_reward, free_port(), *SERVER_FLAGS, env={**common, "RANK": "1"})
    leader = spawn_server(tiny_reward, port, *SERVER_FLAGS, env={**common, "RANK": "0"})
    url = f"http://127.0.0.1:{port}"
    try:
        settings = Settings(model_id=str(tiny_reward), hostname="127.0.0.1", port=free_port(), num_threads=1,
                            dtype="float32")
        with serve(settings) as single:
            expected = _scores(single)
        wait_ready(leader, url)
        assert _scores(url) == pytest.approx(expected, abs=1e-5)
        os.kill(worker.pid, signal.SIGSTOP)
        started = time.monotonic()
        code = leader.wait(30)
        assert code != 0 and time.monotonic() - started < 20
        err = leader.stderr.read()
        assert err.count("shards: tensor-parallel group broken: shard 1 stopped responding") == 1, err
        os.kill(worker.pid, signal.SIGCONT)
        assert worker.wait(20) != 0
        assert "shard 1:" in worker.stderr.read()
    finally:
        for proc in (leader, worker):
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
                os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.slow  # a 2-rank server: processes that talk over gloo
def test_start_up_error_on_another_rank_is_reported_once(tiny_llama):
    """Rank 1 cannot load its model (rank 0 can): rank 0 reports rank 1's error once and both exit."""
    master_port = free_port()
    common = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master_port)}
    missing = tiny_llama.parent / "no-such-model"
    worker = spawn_server(missing, free_port(), *SERVER_FLAGS, env={**common, "RANK": "1"})
    leader = spawn_server(tiny_llama, free_port(), *SERVER_FLAGS, env={**common, "RANK": "0"})
    try:
        assert leader.wait(120) != 0 and worker.wait(30) != 0
        err = leader.stderr.read()
        assert err.count("shard 1 failed to start: ModelLoadError:") == 1, err
        assert "no-such-model" in err
    finally:
        for proc in (leader, worker):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)


def test_kv_pool_is_the_smallest_over_ranks(tiny_llama):
    """Each rank sizes its pool from its own memory budget; all take the minimum (agreed through
    the group: here a stand-in that says another rank can hold only 7 blocks)."""
    from opentgi.engine.execution.assembly import build_runner
    from opentgi.engine.execution.sharded_runner import ShardedModelRunner
    from opentgi.models.loader import load_model

    offered = []

    class OtherRankHoldsLess:
        rank, world_size, is_driver = 0, 2, True

        def min_over_ranks(self, value):
            offered.append(value)
            return min(value, 7)

    settings = Settings(model_id=str(tiny_llama), dtype="float32", kv_cache_cpu_bytes=1 << 20)
    loaded = load_model(settings)
    loaded.tp = OtherRankHoldsLess()
    runner, _spec, num_blocks, _block_size = build_runner(loaded, settings)
    assert isinstance(runner, ShardedModelRunner) and num_blocks == runner.num_blocks == 7
    assert offered[0] > 7 and runner.kv_caches[0][0].shape[0] == 7
