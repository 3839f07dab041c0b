"""Tensor parallelism for the families beside Llama: 2 ranks (gloo, spawned processes) give the
logits of 1 rank through prefill chunks and decodes: Gemma 2 (soft-capping, windows, sandwich
norms), Phi-3 (q/k/v and gate/up fused in the checkpoint), StarCoder2 (biases on row-parallel
projections), Qwen3-MoE and Mixtral (experts split by their features, the router replicated), and
Gemma3ForConditionalGeneration's text tower (its tensors renamed as they are read in slices)."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp
from transformers import AutoConfig

from opentgi.models.attention.torch_backend import TorchAttentionBackend
from opentgi.models.checkpoints.text_tower import text_config
from opentgi.models.registry import build_paged_model
from tests.helpers import tiny_models
from tests.helpers.paged import PROMPT, PagedRunner

FAMILIES = ["gemma2", "phi3", "starcoder2", "qwen3_moe", "mixtral", "gemma3_multimodal"]
STEPS = [PROMPT[:20], PROMPT[20:30], [PROMPT[30]], [PROMPT[31]]]


def _checkpoint(family: str):
    if family == "gemma3_multimodal":
        path = tiny_models.tiny_gemma3_multimodal_path()
    else:
        path = tiny_models.tiny_family_path(family)
    return path, text_config(AutoConfig.from_pretrained(path))


def _logits(model, tp=None) -> torch.Tensor:
    runner, out = PagedRunner(model), []
    for tokens in STEPS:
        logits = model.compute_logits(runner.step({0: tokens}))
        out.append(logits if tp is None else tp.gather_logits(logits, model.spec.vocab_size))
    return None if out[0] is None else torch.cat(out)


def _rank(rank: int, world: int, init: str, result: str) -> None:
    import torch.distributed as dist

    from opentgi.models.parallel import TPGroup

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    tp, got = TPGroup(rank, world), {}
    for family in FAMILIES:
        path, config = _checkpoint(family)
        model = build_paged_model(path, config, TorchAttentionBackend(), torch.float32, torch.device("cpu"), tp=tp)
        got[family] = _logits(model, tp)
    if rank == 0:
        torch.save(got, result)
    dist.destroy_process_group()


@pytest.mark.slow  # two ranks: processes that talk over gloo
def test_two_ranks_match_one(tmp_path):
    for family in FAMILIES:  # built before the ranks start, so that they do not race to build
        _checkpoint(family)
    result = tmp_path / "logits.pt"
    mp.spawn(_rank, args=(2, f"file://{tmp_path / 'rendezvous'}", str(result)), nprocs=2, join=True)
    sharded = torch.load(result)
    for family in FAMILIES:
        path, config = _checkpoint(family)
        single = build_paged_model(path, config, TorchAttentionBackend(), torch.float32, torch.device("cpu"))
        assert sharded[family].shape == (len(STEPS), single.spec.vocab_size)
        torch.testing.assert_close(sharded[family], _logits(single), atol=1e-4, rtol=1e-4, msg=family)
