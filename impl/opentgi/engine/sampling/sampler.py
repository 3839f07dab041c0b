"""Chooses every row's next token at once.

Order (TGI's): penalties (repetition, frequency/presence), logit bias, min-new-tokens EOS mask,
per-row processors (grammar, watermark), then for sampled rows temperature, min-p (vLLM's), top-k,
top-p, typical-p and a draw from the row's own seeded generator (so a seed reproduces its output whatever
the batch around it); greedy rows take the argmax. The reported logprob of the chosen token and
the top-n alternatives come from the raw logits' log-softmax, computed only when some row of the
batch reports them (`GenerationRequest.needs_logprobs`, or top-n): a row that does not gets None.

Cost: a draw is one uniform number per row from its generator, looked up in the cumulative
distribution (not a noise tensor over the vocabulary). When every sampled row keeps only its top
tokens (top-k, or a top-p nucleus that `CANDIDATES` tokens cover), the warpers run on a `topk` of
the logits instead of a sort of the whole vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from opentgi.engine.sampling.sampling_batch import SamplingBatch
from opentgi.engine.scheduling.sequence import Sequence

CANDIDATES = 1024  # tokens examined for a top-p nucleus before falling back to a full sort


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[float | None]  # None for rows that do not need it (needs_logprobs False)
    top: list[list[tuple[int, float]] | None]  # per row: (token id, logprob), best first


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device):
        self.vocab_size = vocab_size
        self.device = device
        self._batch: SamplingBatch | None = None

    def batch_for(self, seqs: list[Sequence]) -> SamplingBatch:
        key = tuple(s.seq_id for s in seqs)
        if self._batch is None or self._batch.key != key:
            self._batch = SamplingBatch(seqs, self.vocab_size, self.device)
        return self._batch

    def sample(self, seqs: list[Sequence], logits: torch.Tensor) -> SamplerOutput:
        batch = self.batch_for(seqs)
        if logits.shape[-1] != self.vocab_size or logits.dtype != torch.float32:
            logits = logits[:, :self.vocab_size].float()
        if batch.plain_greedy and not batch.any_logprobs:  # each row's argmax is the whole answer
            return SamplerOutput(greedy_token_list(logits), [None] * batch.size, [None] * batch.size)
        # log-probabilities over the whole vocabulary: only when some row reports logprobs
        log_probs = row_log_softmax(logits) if batch.any_logprobs else None
        if batch.plain_greedy:  # every row greedy, nothing to apply: one pass finds the token
            next_tokens = greedy_tokens(logits)
        else:
            scores = self._process(batch, logits.clone())
            next_tokens = self._choose(batch, scores)
        chosen_logprobs = None if log_probs is None else log_probs.gather(1, next_tokens.unsqueeze(1)).squeeze(1)
        top = self._top_n(batch, logits, log_probs) if batch.any_top_n else [None] * batch.size
        batch.update(next_tokens)
        token_list = next_tokens.tolist()
        if batch.any_processors:
            for procs, tok in zip(batch.processors, token_list):
                for proc in procs:
                    proc.accept(tok)
        if chosen_logprobs is None:
            logprobs: list[float | None] = [None] * batch.size
        else:
            logprobs = chosen_logprobs.tolist()
            if not batch.all_logprobs:  # a row that did not ask gets None whatever its neighbours
                logprobs = [lp if need else None for lp, need in zip(logprobs, batch.needs_logprobs)]
        return SamplerOutput(token_list, logprobs, top)

    # --- logits processors -----------------------------------------------------------------------
    def _process(self, batch: SamplingBatch, scores: torch.Tensor) -> torch.Tensor:
        if batch.any_repetition:
            penalty = torch.where(batch.seen, batch.repetition_penalty, 1.0)
            scores = torch.where(scores < 0, scores * penalty, scores / penalty)
        if batch.any_output_penalty:
            scores -= batch.frequency_penalty * batch.counts + batch.presence_penalty * (batch.counts > 0)
        if batch.any_bias:
            scores.index_put_(batch.bias_index, batch.bias_values, accumulate=True)
        if batch.any_min_tokens:
            for i, seq in enumerate(batch.seqs):
                if seq.num_generated_tokens < batch.min_new_tokens[i] and batch.eos_ids[i]:
                    scores[i, [t for t in batch.eos_ids[i] if t < self.vocab_size]] = float("-inf")
        if batch.any_processors:
            for i, procs in enumerate(batch.processors):
                for proc in procs:
                    proc(scores[i])
        return scores

    # --- choice --------------------------------------------------------------------------------
    def _choose(self, batch: SamplingBatch, scores: torch.Tensor) -> torch.Tensor:
        next_tokens = greedy_tokens(scores)
        if not batch.any_sample:
            return next_tokens
        probs, ids = self.distribution(batch, scores)
        # inverse CDF with one uniform per row from the row's own generator
        u = torch.cat([torch.rand(1, generator=g, device=probs.device) for g in batch.generators])
        cdf = probs.cumsum(dim=-1)
        target = (u * cdf[:, -1]).unsqueeze(1)
        chosen = torch.searchsorted(cdf, target, right=True).clamp_(max=probs.shape[-1] - 1)
        zero = probs.gather(1, chosen) == 0  # rounding at the very end of the CDF
        if bool(zero.any()):
            chosen = torch.where(zero, probs.argmax(dim=-1, keepdim=True), chosen)
        sampled = (chosen if ids is None else ids.gather(1, chosen)).squeeze(1)
        next_tokens.index_copy_(0, batch.sample_index, sampled)
        return next_tokens

    def distribution(self, batch: SamplingBatch, scores: torch.Tensor):
        """(probs [Bs, K], token ids [Bs, K] or None for the whole vocabulary) of the sampled rows
        after temperature, top-k, top-p and typical-p. Candidates are in token-id order on both
        paths, so a seed draws the same token whichever path the row's batch neighbours send it
        down (the sampler's draw and speculative verification alike)."""
        s = scores.index_select(0, batch.sample_index)
        if batch.any_temperature:
            s = s / batch.temperature
        found = self._candidate_probs(batch, s)
        if found is None:
            return torch.softmax(self._warp(batch, s), dim=-1), None
        probs, ids = found
        ids, order = ids.sort(dim=-1)
        return probs.gather(1, order), ids

    def _candidate_probs(self, batch: SamplingBatch, s: torch.Tensor):
        """(probs [Bs, K], token ids [Bs, K]) after top-k / top-p over each row's K best tokens, or
        None when some row needs the whole vocabulary (no top-k or top-p, typical-p, or a nucleus
        wider than CANDIDATES). Same result as softmax(_warp(s)) restricted to the candidates."""
        if batch.any_typical or not batch.candidates_only:
            return None
        vocab = s.shape[-1]
        k = min(vocab, batch.max_top_k if batch.all_top_k else max(CANDIDATES, batch.max_top_k))
        if k < vocab:
            # one more: a tie across the window's edge leaves which tied tokens are inside to topk;
            # the full path decides it as the other rows' batches would
            values, ids = s.topk(k + 1, dim=-1)
            if bool((values[:, k - 1] == values[:, k]).any()):
                return None
            values, ids = values[:, :k], ids[:, :k]
        else:
            values, ids = s.topk(k, dim=-1)  # sorted, best first
        # ties in token-id order, as the full path's stable sort has them (top-k / top-p keep the
        # same tied tokens on both paths, so a seed draws the same token on either)
        ids, order = ids.sort(dim=-1)
        values, order = values.gather(1, order).sort(dim=-1, descending=True, stable=True)
        ids = ids.gather(1, order)
        neg_inf = float("-inf")
        if batch.any_top_k:
            positions = torch.arange(k, device=s.device).unsqueeze(0)
            values = values.masked_fill(positions >= batch.top_k_t, neg_inf)
        if batch.any_top_p:
            # probabilities over what top-k left: the candidates, or the whole vocabulary for rows
            # without top-k
            lse = torch.where(batch.top_k_on, row_logsumexp(values), row_logsumexp(s))
            probs = (values - lse).exp()
            if not batch.all_top_k and k < vocab:
                covered = probs.sum(dim=-1, keepdim=True) >= batch.top_p
                if not bool((covered | batch.top_k_on).all()):
                    return None
            mass_before = probs.cumsum(dim=-1) - probs
            remove = (mass_before >= batch.top_p) & batch.top_p_on
            remove[:, 0] = False
            values = values.masked_fill(remove, neg_inf)
        return torch.softmax(values, dim=-1), ids

    def _warp(self, batch: SamplingBatch, s: torch.Tensor) -> torch.Tensor:
        neg_inf = float("-inf")
        if batch.any_min_p:  # after temperature, before the others (vLLM's order)
            s = s.masked_fill(s < s.max(dim=-1, keepdim=True).values + batch.log_min_p, neg_inf)
        if not (batch.any_top_k or batch.any_top_p or batch.any_typical):
            return s
        if batch.any_top_k or batch.any_top_p:
            sorted_s, sorted_idx = s.sort(dim=-1, descending=True, stable=True)  # ties: lower id first
            if batch.any_top_k:
                positions = torch.arange(s.shape[-1], device=s.device).unsqueeze(0)
                sorted_s = sorted_s.masked_fill(positions >= batch.top_k_t, neg_inf)
            if batch.any_top_p:
                probs = torch.softmax(sorted_s, dim=-1)
                mass_before = probs.cumsum(dim=-1) - probs
                remove = (mass_before >= batch.top_p) & batch.top_p_on
                remove[:, 0] = False
                sorted_s = sorted_s.masked_fill(remove, neg_inf)
            s = torch.full_like(s, neg_inf).scatter_(1, sorted_idx, sorted_s)
        if batch.any_typical:
            log_p = torch.log_softmax(s, dim=-1)
            p = log_p.exp()
            entropy = -(torch.nan_to_num(p * log_p)).sum(dim=-1, keepdim=True)
            shifted = (-log_p - entropy).abs()
            sorted_shift, order = shifted.sort(dim=-1)
            sorted_p = p.gather(1, order)
            cum = sorted_p.cumsum(dim=-1)
            last_ind = (cum < batch.typical_p).sum(dim=-1, keepdim=True).clamp_(max=s.shape[-1] - 1)
            cutoff = sorted_shift.gather(1, last_ind)
            remove = (shifted > cutoff) & batch.typical_on
            s = s.masked_fill(remove, neg_inf)
        return s

    # --- reporting -------------------------------------------------------------------------------
    def _top_n(self, batch: SamplingBatch, logits: torch.Tensor, log_probs: torch.Tensor):
        """Each row's top_n most likely tokens as (id, logprob), best first, ties in token-id
        order: with the row's `top_n_ties` (TGI), every token tied with the n-th too; else exactly
        n (OpenAI's top_logprobs), the lower ids of a tie first."""
        n_max = max(batch.top_n)
        k = min(self.vocab_size, n_max + 16)  # room for ties at the n-th value
        raw, ids = torch.topk(logits, k, dim=-1)
        values = log_probs.gather(1, ids).tolist()
        raw_list, ids = raw.tolist(), ids.tolist()
        out: list[list[tuple[int, float]] | None] = []
        for row, n in enumerate(batch.top_n):
            if not n:
                out.append(None)
                continue
            nth = raw_list[row][min(n, k) - 1]
            found = {t: (r, v) for t, r, v in zip(ids[row], raw_list[row], values[row]) if r >= nth}
            if not batch.top_n_ties[row] and k < self.vocab_size and raw_list[row][k - 1] == nth:
                # the window's edge cuts a tie: which tied ids topk kept is arbitrary, take them all
                tied = (logits[row] == nth).nonzero().flatten()
                found.update({t: (nth, v) for t, v in zip(tied.tolist(), log_probs[row, tied].tolist())})
            ranked = sorted(found.items(), key=lambda item: (-item[1][0], item[0]))
            if not batch.top_n_ties[row]:
                ranked = ranked[:n]
            out.append([(t, v) for t, (_, v) in ranked])
        return out


def greedy_tokens(scores: torch.Tensor) -> torch.Tensor:
    """Each row's argmax (int64 [B]): the first of tied maxima, a NaN before any number, as
    torch's argmax. On CPU by numpy's, which scans a row in SIMD registers (torch's CPU argmax
    tracks an index per element: several times the cost of a decode step's sampling)."""
    if _numpy_argmax_serves(scores):
        return torch.from_numpy(scores.numpy().argmax(axis=-1))
    return scores.argmax(dim=-1)


def greedy_token_list(scores: torch.Tensor) -> list[int]:
    """`greedy_tokens(scores).tolist()`, without the tensor on CPU."""
    if _numpy_argmax_serves(scores):
        return scores.numpy().argmax(axis=-1).tolist()
    return scores.argmax(dim=-1).tolist()


def _numpy_argmax_serves(scores: torch.Tensor) -> bool:
    return scores.device.type == "cpu" and scores.dtype == torch.float32 and scores.dim() == 2


def row_log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """log_softmax over the last dimension, each row computed alike whatever the row count:
    torch's logsumexp cuts one row's sum across threads for some row counts (a row's bits then
    depend on the batch: docs/determinism.md), its log_softmax does not (and is cheaper)."""
    return torch.log_softmax(logits, dim=-1)


def row_logsumexp(x: torch.Tensor) -> torch.Tensor:
    """logsumexp over the last dimension, keepdim, row-invariant (`row_log_softmax`): the maximum
    less the log-probability it has."""
    top, at = x.max(dim=-1, keepdim=True)
    return torch.where(torch.isfinite(top), top - torch.log_softmax(x, dim=-1).gather(-1, at), top)
