"""Tensor parallelism (Megatron-style) for the paged decoder (every family of families/structure.py).

Each rank holds one slice of every large weight:
- column-parallel (rows of the output features): q/k/v and gate/up projections (also where the
  checkpoint stores them fused, Phi-3's qkv_proj and gate_up_proj: each part sliced), StarCoder2's
  c_fc, and every expert's gate/up (w1/w3);
- row-parallel (input features): o and down projections (c_proj, every expert's down/w2),
  followed by one all-reduce each (`RowParallel`; a mixture-of-experts block all-reduces its
  combined output once); a bias is added once, by rank 0. Routers and norms are replicated;
- vocab-parallel: the embedding (`VocabParallelEmbedding`: each rank looks up the ids it holds,
  zeros elsewhere, one all-reduce) and the LM head (each rank computes its vocabulary slice of the
  logits, `TPGroup.gather_logits` concatenates them on rank 0, which samples).

Attention heads are split by whole key/value groups, so every rank keeps a uniform
query-per-kv-head ratio: with K kv heads and N ranks, N <= K hands each rank K/N groups (as evenly
as possible when N does not divide K: SmolLM2-135M's 3 groups over 2 ranks are 2 + 1); N > K needs
K | N and N | H, and each kv head is replicated on N/K ranks (as vLLM does). The MLP's intermediate
features and the vocabulary are split as evenly as possible. `ShardPlan.slice` gives each
checkpoint tensor's slice for this rank, so a rank reads only its slices (safetensors get_slice).

LoRA adapters follow their base layers' slices (`ShardPlan.slice_lora`, as vLLM's and TGI's
column/row-parallel LoRA layers do; models/lora/attach.py says how).

With one rank none of this is built: the single-shard model has no collectives.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from opentgi.models.base import ForwardWithoutHooks


class TPGroup:
    """This rank's place in the tensor-parallel group and its collectives (torch.distributed)."""

    def __init__(self, rank: int, world_size: int, group=None):
        self.rank = rank
        self.world_size = world_size
        self.group = group  # None: the default process group

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        dist.all_reduce(x, group=self.group)
        return x

    def gather_logits(self, local: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
        """Each rank's [n, V/N] logits -> [n, vocab_size] on rank 0 (None on the others)."""
        import torch.distributed as dist

        local = local.contiguous()
        if self.rank == 0:
            parts = [torch.empty_like(local) for _ in range(self.world_size)]
            dist.gather(local, parts, dst=0, group=self.group)
            return torch.cat(parts, dim=-1)[..., :vocab_size]
        dist.gather(local, None, dst=0, group=self.group)
        return None

    def min_over_ranks(self, value: int) -> int:
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.int64)
        if dist.get_backend(self.group) == "nccl":
            t = t.cuda()
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())


def even_split(total: int, parts: int, index: int) -> tuple[int, int]:
    """[start, end) of part `index` when `total` items are split as evenly as possible."""
    base, extra = divmod(total, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


# the projections `ShardPlan.slice` splits by output rows (column-parallel) and by input columns
COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "qkv_proj", "gate_proj", "up_proj", "gate_up_proj", "c_fc",
                   "w1", "w3")
ROW_PARALLEL = ("o_proj", "down_proj", "c_proj", "w2")


class ShardingError(ValueError):
    """The model cannot be split this many ways; the message says why and what would work."""


@dataclass(frozen=True)
class ShardPlan:
    rank: int
    world_size: int
    head_dim: int
    q_heads: tuple[int, int]  # [start, end) of this rank's query heads
    kv_heads: tuple[int, int]  # [start, end) of this rank's key/value heads
    intermediate: tuple[int, int]
    vocab_start: int
    vocab_local: int  # rows of this rank's (padded) vocabulary slice: ceil(vocab / N)
    vocab_size: int
    num_heads: int = 0  # of the whole model: where k and v start in a fused qkv_proj
    num_kv: int = 0
    intermediate_size: int = 0  # of the whole model: where up starts in a fused gate_up_proj
    expert_intermediate: tuple[int, int] = (0, 0)  # [start, end) of each expert's features

    @classmethod
    def of(cls, config, rank: int, world_size: int) -> ShardPlan:
        heads = config.num_attention_heads
        kv = getattr(config, "num_key_value_heads", None) or heads
        n = world_size
        if n > heads:
            raise ShardingError(f"cannot split the model {n} ways: it has only {heads} attention heads "
                                f"(use --num-shard {heads} or fewer)")
        group = heads // kv
        if n <= kv:
            g0, g1 = even_split(kv, n, rank)
            kv_heads, q_heads = (g0, g1), (g0 * group, g1 * group)
        else:
            if n % kv or heads % n:
                ok = [m for m in range(1, heads + 1) if (m <= kv) or (m % kv == 0 and heads % m == 0)]
                raise ShardingError(
                    f"cannot split the model {n} ways: its {heads} attention heads share {kv} key/value "
                    f"heads, so the number of shards must be at most {kv}, or a multiple of {kv} that "
                    f"divides {heads} (possible: {', '.join(map(str, ok))})")
            per = heads // n
            q0 = rank * per
            kv_heads, q_heads = (q0 // group, q0 // group + 1), (q0, q0 + per)
        vocab = config.vocab_size
        vocab_local = -(-vocab // n)
        experts = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
        return cls(rank=rank, world_size=n,
                   head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
                   q_heads=q_heads, kv_heads=kv_heads,
                   intermediate=even_split(config.intermediate_size, n, rank),
                   vocab_start=rank * vocab_local, vocab_local=vocab_local, vocab_size=vocab,
                   num_heads=heads, num_kv=kv, intermediate_size=config.intermediate_size,
                   expert_intermediate=even_split(experts, n, rank))

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]

    def local_config(self, config):
        """The config this rank's modules are built from: its heads, intermediate and vocabulary."""
        local = copy.deepcopy(config)
        local.head_dim = self.head_dim
        local.num_attention_heads = self.q_heads[1] - self.q_heads[0]
        local.num_key_value_heads = self.num_kv_heads
        local.intermediate_size = self.intermediate[1] - self.intermediate[0]
        if getattr(config, "moe_intermediate_size", None):
            local.moe_intermediate_size = self.expert_intermediate[1] - self.expert_intermediate[0]
        local.vocab_size = self.vocab_local
        return local

    def slice(self, name: str, shape: tuple[int, ...], read) -> torch.Tensor:
        """This rank's part of checkpoint tensor `name` (full shape `shape`); `read(index)` reads
        only the indexed part of the stored tensor."""
        d = self.head_dim
        leaf = name.rsplit(".", 2)[-2:]  # e.g. ["q_proj", "weight"]
        module, kind = (leaf[0], leaf[1]) if len(leaf) == 2 else ("", leaf[0])
        expert = ".experts." in name
        columns = self.expert_intermediate if expert else self.intermediate
        if module == "qkv_proj":  # stored fused: this rank's q heads, then its k and v heads
            q0, k0 = self.num_heads * d, (self.num_heads + self.num_kv) * d
            return torch.cat([read(slice(self.q_heads[0] * d, self.q_heads[1] * d)),
                              read(slice(q0 + self.kv_heads[0] * d, q0 + self.kv_heads[1] * d)),
                              read(slice(k0 + self.kv_heads[0] * d, k0 + self.kv_heads[1] * d))])
        if module == "gate_up_proj":  # stored fused: this rank's gate rows, then its up rows
            size = self.intermediate_size
            return torch.cat([read(slice(*self.intermediate)),
                              read(slice(size + self.intermediate[0], size + self.intermediate[1]))])
        if module == "q_proj":
            return read(slice(self.q_heads[0] * d, self.q_heads[1] * d))
        if module in ("k_proj", "v_proj"):
            return read(slice(self.kv_heads[0] * d, self.kv_heads[1] * d))
        if module in ("gate_proj", "up_proj", "c_fc", "w1", "w3"):
            return read(slice(*columns))
        if module in ("o_proj", "down_proj", "c_proj", "w2"):
            if kind == "bias":  # added once, after the all-reduce
                full = read(slice(None))
                return full if self.rank == 0 else torch.zeros_like(full)
            lo, hi = (self.q_heads[0] * d, self.q_heads[1] * d) if module == "o_proj" else columns
            return read((slice(None), slice(lo, hi)))
        if name.endswith(("embed_tokens.weight", "lm_head.weight")):
            end = min(self.vocab_start + self.vocab_local, self.vocab_size)
            part = read(slice(self.vocab_start, end))
            if part.shape[0] < self.vocab_local:  # the last rank's slice, padded with zero rows
                part = torch.cat([part, part.new_zeros(self.vocab_local - part.shape[0], *part.shape[1:])])
            return part
        return read(slice(None))

    def slice_lora(self, name: str, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's part of a LoRA pair on the projection whose weight is `name` (a [r, in], b
        [out, r]): on a column-parallel projection B's rows of this rank's weight rows, on a
        row-parallel one A's columns of its weight columns; anything else (the router) whole."""
        module = name.rsplit(".", 2)[-2]
        if module in ROW_PARALLEL:
            return self.slice(name, tuple(a.shape), a.__getitem__).clone(), b
        if module in COLUMN_PARALLEL:
            return a, self.slice(name, tuple(b.shape), b.__getitem__).clone()
        return a, b


class RowParallel(ForwardWithoutHooks, nn.Module):
    """A row-parallel linear: this rank's partial product, summed over ranks by one all-reduce."""

    def __init__(self, linear: nn.Module, tp: TPGroup):
        super().__init__()
        self.linear = linear
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.linear(x))


class VocabParallelEmbedding(nn.Module):
    """The rows [start, start + weight.shape[0]) of the embedding; ids elsewhere look up zeros and
    one all-reduce assembles every token's row."""

    def __init__(self, weight: torch.Tensor, start: int, tp: TPGroup):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.start = start
        self.tp = tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(out)


def parallelize(model: nn.Module, plan: ShardPlan, tp: TPGroup) -> None:
    """After a rank's slices are loaded: all-reduce after every o/down projection (a
    mixture-of-experts block: after its combined output) and a vocab-parallel embedding (the LM
    head's logits are gathered by the runner)."""
    for layer in model.model.layers:
        layer.self_attn.o_proj = RowParallel(layer.self_attn.o_proj, tp)
        block = layer.feed_forward
        if hasattr(block, "experts"):
            block.tp = tp
        else:
            out = "c_proj" if hasattr(block, "c_proj") else "down_proj"
            setattr(block, out, RowParallel(getattr(block, out), tp))
    embed = model.model.embed_tokens
    model.model.embed_tokens = VocabParallelEmbedding(embed.weight.data, plan.vocab_start, tp)
    model.shard_plan = plan  # LoRA adapters attached later take their slices by it (models/lora/)
