"""One generated sequence: its tokens, its KV blocks and where it stands.

A request with n > 1 owns n sequences over the same prompt. `token_ids` holds the prompt followed by
the generated tokens; `num_computed_tokens` of them have their k/v in the KV cache (the rest are fed
to the model by the next steps); `block_table` lists the KV blocks holding them, in order.
"""

from __future__ import annotations

import itertools
from enum import Enum
from typing import TYPE_CHECKING

from opentgi.engine.output.detokenizer import IncrementalDetokenizer
from opentgi.engine.output.stop_checker import StopChecker
from opentgi.engine.request import FinishReason, GenerationRequest

if TYPE_CHECKING:
    from opentgi.engine.sampling.processors import RowLogitsProcessor

_seq_ids = itertools.count()


class SequenceStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(self, request: GenerationRequest, index: int, *, seed: int | None,
                 detokenizer: IncrementalDetokenizer, stop_checker: StopChecker,
                 processors: list[RowLogitsProcessor], parent: Sequence | None = None):
        self.seq_id = next(_seq_ids)
        self.request = request
        self.index = index
        self.seed = seed
        self.token_ids: list[int] = list(request.prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.num_computed_tokens = 0  # tokens whose k/v are in the cache
        self.num_cached_tokens = 0  # of those, how many came from the prefix cache (last admission)
        self.num_prompt_cached_tokens: int | None = None  # the prompt's, at its first admission (usage)
        self.block_table: list[int] = []
        self.num_hashed_blocks = 0  # leading full blocks registered in the prefix cache
        self.block_hashes: list[int] = []
        # proposed continuation verified by this step's forward (speculative decoding); never in
        # token_ids, whose tokens are all accepted
        self.draft_token_ids: list[int] = []
        self.status = SequenceStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.detokenizer = detokenizer
        self.stop_checker = stop_checker
        self.processors = processors
        # n > 1: the siblings wait for sequence 0 to compute the prompt, then share its full blocks.
        self.parent = parent
        self.text = ""
        self.cumulative_logprob = 0.0
        self.prompt_logprobs: list[float] | None = [] if request.prompt_logprobs else None
        self.score: float | None = None
        self.generator = None  # torch.Generator, created by the sampler on first use

    # --- sizes -------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def generated_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_prefilling(self) -> bool:
        """More than one token left to feed (a prompt, or a recompute after preemption)."""
        return self.num_uncomputed_tokens > 1

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def max_new_tokens(self) -> int:
        return self.request.stopping.max_new_tokens

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, req={self.request.request_id}, idx={self.index}, "
                f"len={len(self)}, computed={self.num_computed_tokens}, status={self.status.value})")
