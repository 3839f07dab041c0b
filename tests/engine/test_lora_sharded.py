"""LoRA adapters under tensor parallelism (`--num-shard`, models/parallel.py `slice_lora`): 2 ranks
(gloo, spawned processes) serve the logits of 1 rank, through the sharded runner (each row's
adapter sent to every rank with the step), for rows of two adapters and base rows in one batch
(prefill, decodes, a lone row's decode): Llama (also with --nondeterministic's stacked form),
Phi-3 with q/k/v and gate/up fused in the checkpoint and 3 key/value heads split 2 + 1, StarCoder2
(biases on the row-parallel projections) and Qwen3-MoE (every expert's projections and the
router); every forward all-reduces exactly as often as without adapters, every rank is told the
step's row kinds (its prompt tokens' attention form) as the driver is, and on 2 ranks a row keeps
its bits whether its batch holds the other rows or not. A live `--num-shard 2`
server answers each request with its adapter's tokens, as one shard does, and says so in /info.
A bad adapter (the LM head's LoRA too, served by no shard count) stops a sharded start-up once,
before any rank starts."""

from __future__ import annotations

import concurrent.futures
import functools
import logging

import httpx
import pytest
import torch
import torch.multiprocessing as mp
from transformers import AutoConfig

from conformance.live import free_port, serve
from opentgi.config import Settings
from opentgi.engine.execution.model_runner import ModelRunner
from opentgi.engine.execution.sharded_runner import ShardedModelRunner
from opentgi.engine.output.stop_checker import StopChecker
from opentgi.engine.request import GenerationRequest, SamplingParams, StoppingParams
from opentgi.engine.scheduling.sequence import Sequence
from opentgi.models.attention.torch_backend import TorchAttentionBackend
from opentgi.models.lora import attach_lora, load_adapters
from opentgi.models.registry import build_paged_model
from tests.helpers import tiny_models
from tests.helpers.paged import PROMPT
from tests.helpers.servers import SERVER_FLAGS, spawn_server, stop, wait_ready

TOL = {"atol": 1e-4, "rtol": 1e-4}
BLOCK_SIZE, BLOCKS_PER_ROW = 16, 3
# family (and config overrides) -> targets of adapter a (rank 4) and of adapter b (rank 8, rsLoRA)
CASES = {
    "llama": ("llama", {}, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
              ["q_proj", "v_proj", "down_proj"]),
    "phi3": ("phi3", {"hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 3},
             ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"], ["qkv_proj", "down_proj"]),
    "starcoder2": ("starcoder2", {}, ["q_proj", "k_proj", "v_proj", "o_proj", "c_fc", "c_proj"],
                   ["o_proj", "c_proj"]),
    "qwen3_moe": ("qwen3_moe", {}, ["q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "gate"],
                  r".*\.experts\.[02]\.(gate_proj|up_proj|down_proj)"),
}
# (case, batch invariant, dtype): bfloat16 is where the tiny models attend prompt tokens in their
# own form (row kinds), float32 where 2 ranks and 1 agree to float32 rounding
RUNS = [("llama", True, torch.float32), ("llama", False, torch.float32), ("phi3", True, torch.float32),
        ("starcoder2", True, torch.float32), ("qwen3_moe", True, torch.float32), ("llama", True, torch.bfloat16)]
TOLERANCE = {torch.float32: TOL, torch.bfloat16: {"atol": 0.1, "rtol": 0.02}}
# row -> (adapter, tokens, how many the prefill step takes); then two decodes of every row and one of row 1
ROWS = [("a", PROMPT[:23], 20), ("b", PROMPT[4:33], 26), (None, PROMPT[9:29], 17)]


@functools.cache
def case(name: str):
    family, overrides, a_targets, b_targets = CASES[name]
    path = tiny_models.tiny_llama_path() if family == "llama" else tiny_models.tiny_family_path(family, **overrides)
    a = tiny_models.tiny_lora_path(path, seed=5, r=4, alpha=8, targets=a_targets)
    b = tiny_models.tiny_lora_path(path, seed=6, r=8, alpha=4, use_rslora=True, targets=b_targets)
    return path, f"a={a},b={b}"


def _model(name: str, batch_invariant: bool, dtype: torch.dtype = torch.float32, tp=None):
    path, spec = case(name)
    config = AutoConfig.from_pretrained(path)
    model = build_paged_model(path, config, TorchAttentionBackend(), dtype, torch.device("cpu"), tp=tp,
                              batch_invariant=batch_invariant)
    attach_lora(model, load_adapters(spec, config, str(path)))  # checked against the whole model's shapes
    return model


def _seq(adapter: str | None, tokens: list[int], row: int) -> Sequence:
    req = GenerationRequest(list(tokens), SamplingParams(), StoppingParams(max_new_tokens=4), adapter_id=adapter)
    seq = Sequence(req, 0, seed=None, detokenizer=None, stop_checker=StopChecker(req.stopping, [], 99),
                   processors=[])
    seq.block_table = list(range(row * BLOCKS_PER_ROW, (row + 1) * BLOCKS_PER_ROW))
    return seq


def _drive(runner, together: bool = True) -> dict[int, list[torch.Tensor]]:
    """The steps of ROWS through a runner, all rows in one batch or each alone: per row, its
    prefill's every position's logits, then each step's sampled logits."""
    out: dict[int, list[torch.Tensor]] = {r: [] for r in range(len(ROWS))}
    for group in [list(out)] if together else [[r] for r in out]:
        seqs = {r: _seq(ROWS[r][0], ROWS[r][1], r) for r in group}

        def step(rows: list[int], new: list[int], logits: bool = False) -> None:
            chosen = [seqs[r] for r in rows]
            result = runner.execute(chosen, new, sample_rows=list(range(len(rows))),
                                    logit_rows=list(range(len(rows))) if logits else ())
            for i, (r, seq, n) in enumerate(zip(rows, chosen, new, strict=True)):
                if logits:
                    out[r].append(result.position_logits[i])
                out[r].append(result.sample_logits[i:i + 1])
                seq.num_computed_tokens += n

        step(group, [ROWS[r][2] for r in group], logits=True)
        step(group, [1] * len(group))
        step(group, [1] * len(group))
        if 1 in group:
            step([1], [1])
    return out


def _rank(rank: int, world: int, init: str, result: str) -> None:
    import torch.distributed as dist

    from opentgi.models.parallel import TPGroup

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    tp, got = TPGroup(rank, world), {}
    reduces: list[int] = []
    every_reduce = tp.all_reduce

    def counted(x):
        reduces[-1] += 1
        return every_reduce(x)

    kinds: list = []  # each forward's prompt token counts (row kinds), as this rank was told

    tp.all_reduce = counted
    for run in RUNS:
        model = _model(*run, tp=tp)
        forward = model.forward

        def counting_forward(*args, forward=forward):
            reduces.append(0)
            kinds.append(args[2].prompt_new_tokens)
            return forward(*args)

        model.forward = counting_forward
        runner = ShardedModelRunner(model, BLOCKS_PER_ROW * len(ROWS), BLOCK_SIZE, tp)
        if rank == 0:
            got[run] = _drive(runner), _drive(runner, together=False) if run[1] else None
            runner.stop()
        else:
            runner.serve_forever()
        layers = model.spec.num_layers
        # the embedding's, then per layer the attention's and the feed-forward block's: none for LoRA
        got[(*run, "all-reduces")] = sorted(set(reduces)) == [1 + 2 * layers]
        got[(*run, "row kinds")] = list(kinds)
        reduces.clear()
        kinds.clear()
    torch.save(got, f"{result}.{rank}")
    dist.destroy_process_group()


@pytest.mark.slow  # two ranks: processes that talk over gloo
def test_two_ranks_match_one(tmp_path):
    for name in CASES:  # built before the ranks start, so that they do not race to build
        case(name)
    result = tmp_path / "logits.pt"
    mp.spawn(_rank, args=(2, f"file://{tmp_path / 'rendezvous'}", str(result)), nprocs=2, join=True)
    sharded, other = torch.load(f"{result}.0"), torch.load(f"{result}.1")
    for run in RUNS:
        _, invariant, dtype = run
        assert sharded[(*run, "all-reduces")] and other[(*run, "all-reduces")], run
        # every rank attends a step's prompt tokens in the form the driver does (the driver's counts)
        assert other[(*run, "row kinds")] == sharded[(*run, "row kinds")], run
        assert (sharded[(*run, "row kinds")][0] is not None) == (dtype == torch.bfloat16), run
        single = _drive(ModelRunner(_model(*run), BLOCKS_PER_ROW * len(ROWS), BLOCK_SIZE))
        together, alone = sharded[run]
        for row, expected in single.items():
            msg = f"{run}, row {row}"
            got, expected = torch.cat(together[row]).float(), torch.cat(expected).float()
            assert got.shape == expected.shape, msg
            torch.testing.assert_close(got, expected, **TOLERANCE[dtype], msg=msg)
            if dtype == torch.float32:
                torch.testing.assert_close(got.log_softmax(-1), expected.log_softmax(-1), **TOL, msg=msg)
                assert got.argmax(-1).tolist() == expected.argmax(-1).tolist(), msg
            if invariant:  # every rank keeps a row's bits whatever else its batch holds
                torch.testing.assert_close(got, torch.cat(alone[row]).float(), atol=0, rtol=0, msg=msg)


def test_adapters_change_the_rows_they_serve():
    """The comparison above means something: each adapter's rows differ from the base model's."""
    name = "qwen3_moe"
    with_adapters = _drive(ModelRunner(_model(name, True), BLOCKS_PER_ROW * len(ROWS), BLOCK_SIZE))
    path, _ = case(name)
    base = build_paged_model(path, AutoConfig.from_pretrained(path), TorchAttentionBackend(), torch.float32,
                             torch.device("cpu"))
    without = _drive(ModelRunner(base, BLOCKS_PER_ROW * len(ROWS), BLOCK_SIZE))
    # a's row, b's row and the base row
    assert not torch.allclose(torch.cat(with_adapters[0]), torch.cat(without[0]), atol=1e-2)
    assert not torch.allclose(torch.cat(with_adapters[1]), torch.cat(without[1]), atol=1e-2)
    torch.testing.assert_close(torch.cat(with_adapters[2]), torch.cat(without[2]), atol=0, rtol=0)


def _greedy(url: str, prompt: str, adapter: str | None) -> list[int]:
    parameters = {"max_new_tokens": 12, "details": True, **({"adapter_id": adapter} if adapter else {})}
    response = httpx.post(f"{url}/generate", json={"inputs": prompt, "parameters": parameters}, timeout=120)
    assert response.status_code == 200, response.text
    return [t["id"] for t in response.json()["details"]["tokens"]]


@pytest.mark.slow  # two ranks: processes that talk over gloo
def test_a_two_shard_server_serves_each_requests_adapter():
    """Requests of a, b and the base model at once (batched together, the long prompt chunked):
    the tokens of one shard, each adapter's own; /info lists the adapters as one shard does."""
    path, spec = case("qwen3_moe")
    prompts = ["The quick brown fox jumps over the lazy dog, and then it runs far away into the forest.", "Hi"]
    work = [(p, adapter) for p in prompts for adapter in ("a", "b", None)]

    def answers(url: str) -> list[list[int]]:
        with concurrent.futures.ThreadPoolExecutor(len(work)) as pool:
            return list(pool.map(lambda job: _greedy(url, *job), work))

    port = free_port()
    proc = spawn_server(path, port, "--num-shard", "2", "--lora-adapters", spec, *SERVER_FLAGS)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, url)
        got, info = answers(url), httpx.get(f"{url}/info").json()
    finally:
        stop(proc)
    settings = Settings(model_id=str(path), hostname="127.0.0.1", port=free_port(), num_threads=1,
                        chunked_prefill_tokens=16, max_batch_total_tokens=4096, dtype="float32", lora_adapters=spec)
    with serve(settings) as single:
        assert got == answers(single)
        assert info["adapters"] == httpx.get(f"{single}/info").json()["adapters"] == ["a", "b"]
    assert got[0] != got[2] and got[1] != got[2]  # each adapter's tokens are its own


def test_a_bad_adapter_stops_a_sharded_start_up_before_any_rank_starts(tmp_path):
    from opentgi.cli import main as cli_main

    path, _ = case("llama")
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        with pytest.raises(SystemExit, match=r"^opentgi: adapter 'x': '/nonexistent/x' is not a local folder"):
            cli_main(["serve", "--model-id", str(path), "--num-shard", "2", "--lora-adapters", "x=/nonexistent/x"])
        _, other = case("phi3")  # adapters of another model: their shapes do not fit this one
        with pytest.raises(SystemExit, match=r"^opentgi: adapter 'a' does not fit base model"):
            cli_main(["serve", "--model-id", str(path), "--num-shard", "2", "--lora-adapters", other])
        # the LM head's and the embedding's LoRA are served by no shard count: refused by name
        untied, _ = case("qwen3_moe")
        head = tiny_models.tiny_lora_path(untied, seed=7, r=4, alpha=8, targets=["q_proj", "lm_head"])
        with pytest.raises(SystemExit, match=r"^opentgi: adapter 'h' targets \['lm_head'\]: only"):
            cli_main(["serve", "--model-id", str(untied), "--num-shard", "2", "--lora-adapters", f"h={head}"])
    finally:
        root.handlers[:], root.level = handlers, level
