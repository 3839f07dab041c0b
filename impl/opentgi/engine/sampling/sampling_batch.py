"""Per-row sampling parameters of one batch composition, held as tensors (TGI's "heterogeneous"
processors). Built once when the set of sampled sequences changes; the penalty state (tokens seen,
output token counts) is then updated in place from each step's chosen tokens."""

from __future__ import annotations

import math

import torch

from opentgi.engine.scheduling.sequence import Sequence


class SamplingBatch:
    def __init__(self, seqs: list[Sequence], vocab_size: int, device: torch.device):
        self.key = tuple(s.seq_id for s in seqs)
        self.seqs = seqs
        self.vocab_size = vocab_size
        self.device = device
        params = [s.request.sampling for s in seqs]
        B = len(seqs)
        self.size = B

        def col(values, dtype=torch.float32):
            return torch.tensor(values, dtype=dtype, device=device).unsqueeze(1)

        self.do_sample = [p.do_sample for p in params]
        self.sample_rows = [i for i, d in enumerate(self.do_sample) if d]
        self.greedy_rows = [i for i, d in enumerate(self.do_sample) if not d]
        self.any_sample = bool(self.sample_rows)
        sp = [params[i] for i in self.sample_rows]
        if sp:
            self.sample_index = torch.tensor(self.sample_rows, dtype=torch.long, device=device)
            self.temperature = col([max(p.temperature, 1e-5) for p in sp])
            self.any_temperature = any(p.temperature != 1.0 for p in sp)
            self.top_k = [p.top_k if 0 < p.top_k < vocab_size else 0 for p in sp]
            self.any_top_k = any(self.top_k)
            self.top_k_t = col([k if k else vocab_size for k in self.top_k], torch.long)
            self.top_p = col([p.top_p for p in sp])
            self.top_p_on = col([0.0 < p.top_p < 1.0 for p in sp], torch.bool)
            self.any_top_p = any(0.0 < p.top_p < 1.0 for p in sp)
            self.typical_p = col([p.typical_p for p in sp])
            self.typical_on = col([0.0 < p.typical_p < 1.0 for p in sp], torch.bool)
            self.any_typical = any(0.0 < p.typical_p < 1.0 for p in sp)
            self.any_min_p = any(p.min_p > 0.0 for p in sp)
            if self.any_min_p:  # log(min_p): a token is kept when its logit >= the best's + log(min_p)
                self.log_min_p = col([float("-inf") if p.min_p <= 0.0 else math.log(p.min_p)
                                      for p in sp])
            self.top_k_on = col([bool(k) for k in self.top_k], torch.bool)
            self.all_top_k = all(self.top_k)
            self.max_top_k = max(self.top_k)
            # every sampled row keeps only its best tokens (the sampler's topk path may serve it)
            self.candidates_only = not self.any_min_p and all(k or 0.0 < p.top_p < 1.0
                                                              for k, p in zip(self.top_k, sp))
            self.generators = [self._generator(seqs[i]) for i in self.sample_rows]

        # penalties over all rows (greedy rows too, as in HF generate)
        self.any_repetition = any(p.repetition_penalty != 1.0 for p in params)
        self.any_output_penalty = any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params)
        if self.any_repetition:
            self.repetition_penalty = col([p.repetition_penalty for p in params])
            self.seen = torch.zeros(B, vocab_size, dtype=torch.bool, device=device)
            for i, s in enumerate(seqs):
                ids = torch.tensor(s.token_ids, dtype=torch.long, device=device).clamp_(0, vocab_size - 1)
                self.seen[i].index_fill_(0, ids, True)
        if self.any_output_penalty:
            self.frequency_penalty = col([p.frequency_penalty for p in params])
            self.presence_penalty = col([p.presence_penalty for p in params])
            self.counts = torch.zeros(B, vocab_size, dtype=torch.float32, device=device)
            for i, s in enumerate(seqs):
                if s.num_generated_tokens:
                    ids = torch.tensor(s.generated_token_ids, dtype=torch.long, device=device)
                    self.counts[i].index_add_(0, ids.clamp_(0, vocab_size - 1),
                                              torch.ones(len(ids), device=device))
        bias_rows, bias_ids, bias_vals = [], [], []
        for i, p in enumerate(params):
            for tok, val in (p.logit_bias or {}).items():
                if 0 <= tok < vocab_size:
                    bias_rows.append(i)
                    bias_ids.append(tok)
                    bias_vals.append(float(val))
        self.any_bias = bool(bias_rows)
        if self.any_bias:
            self.bias_index = (torch.tensor(bias_rows, device=device), torch.tensor(bias_ids, device=device))
            self.bias_values = torch.tensor(bias_vals, dtype=torch.float32, device=device)
        self.min_new_tokens = [s.request.stopping.min_new_tokens for s in seqs]
        self.any_min_tokens = any(self.min_new_tokens)
        self.eos_ids = [sorted(s.stop_checker.eos_token_ids) for s in seqs]
        self.processors = [s.processors for s in seqs]
        self.any_processors = any(self.processors)
        self.top_n = [s.request.top_n_tokens for s in seqs]
        self.any_top_n = any(self.top_n)
        self.top_n_ties = [s.request.top_n_ties for s in seqs]
        # rows whose chosen token's logprob reaches the client (the top-n alternatives need it too)
        self.needs_logprobs = [s.request.needs_logprobs or bool(s.request.top_n_tokens) for s in seqs]
        self.any_logprobs = any(self.needs_logprobs)
        self.all_logprobs = all(self.needs_logprobs)
        self.plain_greedy = not (self.any_sample or self.any_repetition or self.any_output_penalty
                                 or self.any_bias or self.any_min_tokens or self.any_processors)

    def _generator(self, seq: Sequence) -> torch.Generator:
        if seq.generator is None:
            g = torch.Generator(device=self.device)
            g.manual_seed(seq.seed)
            seq.generator = g
        return seq.generator

    def update(self, next_tokens: torch.Tensor) -> None:
        """Fold this step's chosen tokens [B] into the penalty state."""
        if not (self.any_repetition or self.any_output_penalty):
            return
        idx = next_tokens.clamp(0, self.vocab_size - 1).unsqueeze(1)
        if self.any_repetition:
            self.seen.scatter_(1, idx, True)
        if self.any_output_penalty:
            self.counts.scatter_add_(1, idx, torch.ones_like(idx, dtype=torch.float32))
