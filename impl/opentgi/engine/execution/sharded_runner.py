"""The model runner of a tensor-parallel group (`--num-shard N`).

Rank 0 (the driver, which owns the scheduler and the block manager) builds each step's tensors as
the single-shard runner does and broadcasts them: a fixed header of sizes, then one int64 payload
(input ids, positions, slot mapping, cu_seqlens_q/k, context lens, block tables, each row's LoRA
adapter slot (-1: the base model; models/lora/) and, where the model picks kernels by row kind,
its count of prompt tokens (models/layers/row_kinds.py), the positions to sample from (each sample
row's last one, and with speculative decoding its drafts'), and the rows to return position
logits for and to score). Every rank runs its shard of the forward pass on them, each row with
its adapter's slices; the LM head's vocabulary slices are gathered on rank 0, which samples. The
other ranks run `serve_forever`, which receives steps until the driver says stop.

While the driver is idle it sends a no-op header every few seconds, so the ranks waiting for the
next step never reach the process group's timeout; a rank that is gone or stuck makes the
driver's collectives fail within that timeout instead of hanging (engine/execution/shards.py watches the
processes themselves).
"""

from __future__ import annotations

import threading
import time

import torch

from opentgi.engine.execution.model_runner import ModelRunner, StepOutput, sample_positions, score_value
from opentgi.models.attention.metadata import AttentionMetadata
from opentgi.models.layers.row_kinds import step_row_kinds

_STEP, _NOOP, _STOP = 1, 2, 3
_HEADER = 12  # cmd, T, B, max_blocks, n_sample, n_logit, n_score, max_q, max_k, decode_only, row_kinds, pad
KEEPALIVE_S = 5.0


class ShardedModelRunner(ModelRunner):
    def __init__(self, model, num_blocks: int, block_size: int, tp):
        super().__init__(model, num_blocks, block_size)
        self.tp = tp
        self.vocab_size = self.spec.vocab_size
        self._lock = threading.Lock()  # the driver's collectives, in one order: steps and keepalives
        self._last_sent = time.monotonic()
        self._stopped = False
        self.failure: str | None = None  # set by the shard monitor: the group is broken

    # --- the driver (rank 0) ---------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, seqs, num_new_tokens, sample_rows, logit_rows=(), score_rows=(), greedy_vocab=0) -> StepOutput:
        # greedy_vocab: the ranks return logits, whatever the rows want of them
        if self.failure is not None:
            raise RuntimeError(self.failure)
        input_ids, positions, attn, cu_q = self.prepare(seqs, num_new_tokens)
        rows = [sample_positions(seqs, sample_rows, cu_q), list(logit_rows), list(score_rows)]
        adapters = ([-1] * len(seqs) if self.lora is None
                    else self.lora.slots_of([s.request.adapter_id for s in seqs]))
        with self._lock:
            self._send(_STEP, input_ids, positions, attn, adapters, rows)
            return self._run(input_ids, positions, attn, adapters, rows)

    def keepalive(self) -> None:
        """A no-op header when no step went out for KEEPALIVE_S (called from a timer thread)."""
        if time.monotonic() - self._last_sent < KEEPALIVE_S or self._stopped or self.failure:
            return
        with self._lock:
            if not self._stopped:
                self._broadcast_header(_NOOP)

    def stop(self) -> None:
        """Tell every rank to leave `serve_forever` (the driver's last collective)."""
        with self._lock:
            if not self._stopped and self.failure is None:
                self._stopped = True
                self._broadcast_header(_STOP)
            self._stopped = True

    def _broadcast_header(self, cmd: int, values=()) -> None:
        import torch.distributed as dist

        header = torch.zeros(_HEADER, dtype=torch.int64, device=self.device)
        header[0] = cmd
        if values:
            header[1:1 + len(values)] = torch.tensor(values, dtype=torch.int64)
        dist.broadcast(header, 0, group=self.tp.group)
        self._last_sent = time.monotonic()

    def _send(self, cmd, input_ids, positions, attn: AttentionMetadata, adapters: list[int], rows) -> None:
        import torch.distributed as dist

        bt = attn.block_tables
        kinds = attn.prompt_new_tokens
        self._broadcast_header(cmd, (input_ids.numel(), bt.shape[0], bt.shape[1], *map(len, rows),
                                     attn.max_seqlen_q, attn.max_seqlen_k, int(attn.decode_only),
                                     int(kinds is not None)))
        dev, i64 = self.device, torch.int64
        per_seq = adapters + (kinds if kinds is not None else [0] * len(adapters))
        payload = torch.cat([input_ids, positions, attn.slot_mapping, attn.cu_seqlens_q.to(i64),
                             attn.cu_seqlens_k.to(i64), attn.context_lens.to(i64), bt.to(i64).reshape(-1),
                             torch.tensor(per_seq + [r for part in rows for r in part], dtype=i64, device=dev)])
        dist.broadcast(payload, 0, group=self.tp.group)

    # --- every rank ------------------------------------------------------------------------------
    def _run(self, input_ids, positions, attn: AttentionMetadata, adapters: list[int],
             rows) -> StepOutput | None:
        sample_at, logit_rows, score_rows = rows
        cu_q = attn.cu_seqlens_q.tolist()
        num_new = [b - a for a, b in zip(cu_q, cu_q[1:])]
        if self.lora is not None:  # every rank: the rows' adapters, as the driver's slots say
            self.lora.begin_step_slots(adapters, num_new)
        try:  # every rank: the rows' kinds, so that each picks the kernels the driver does
            with step_row_kinds(self.row_kinds(attn.prompt_new_tokens, num_new)):
                hidden = self.model.forward(input_ids, positions, attn, self.kv_caches)
        finally:
            if self.lora is not None:
                self.lora.end_step()
        out = StepOutput(sample_logits=None)
        if sample_at:
            last = torch.tensor(sample_at, device=self.device)
            out.sample_logits = self._logits(hidden.index_select(0, last))
        for r in logit_rows:
            out.position_logits[r] = self._logits(hidden[cu_q[r]:cu_q[r + 1]])
        for r in score_rows:  # the score head is replicated: every rank computes it, rank 0 reports
            out.scores[r] = score_value(self.model.compute_score(hidden[cu_q[r + 1] - 1:cu_q[r + 1]]))
        return out if self.tp.is_driver else None

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.tp.gather_logits(self.model.compute_logits(hidden), self.vocab_size)

    # --- the other ranks -------------------------------------------------------------------------
    @torch.inference_mode()
    def serve_forever(self) -> None:
        """Receive and run steps until the driver sends stop (ranks > 0)."""
        import torch.distributed as dist

        dev, i32 = self.device, torch.int32
        header = torch.zeros(_HEADER, dtype=torch.int64, device=dev)
        while True:
            dist.broadcast(header, 0, group=self.tp.group)
            cmd, n_tok, n_seq, max_blocks, n_s, n_l, n_sc, max_q, max_k, decode_only, kinds = header[:11].tolist()
            if cmd == _STOP:
                return
            if cmd != _STEP:
                continue
            sizes = [n_tok, n_tok, n_tok, n_seq + 1, n_seq + 1, n_seq, n_seq * max_blocks, n_seq, n_seq,
                     n_s, n_l, n_sc]
            payload = torch.empty(sum(sizes), dtype=torch.int64, device=dev)
            dist.broadcast(payload, 0, group=self.tp.group)
            (ids, pos, slots, cu_q, cu_k, ctx, bt, adapters, prompt_new,
             s_rows, l_rows, sc_rows) = payload.split(sizes)
            attn = AttentionMetadata(
                slot_mapping=slots, cu_seqlens_q=cu_q.to(i32), cu_seqlens_k=cu_k.to(i32),
                max_seqlen_q=max_q, max_seqlen_k=max_k, context_lens=ctx.to(i32),
                block_tables=bt.to(i32).reshape(n_seq, max_blocks), decode_only=bool(decode_only),
                prompt_new_tokens=prompt_new.tolist() if kinds else None)
            self._run(ids, pos, attn, adapters.tolist(), [s_rows.tolist(), l_rows.tolist(), sc_rows.tolist()])
