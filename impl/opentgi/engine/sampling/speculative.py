"""Speculative decoding with n-gram prompt-lookup drafts (`--speculate N`).

Proposal: the last n tokens of a sequence (n from `MAX_NGRAM` down to `MIN_NGRAM`) are looked up in
its own prompt + output; the tokens that followed their first occurrence are proposed, up to N
(`NgramProposer`, an index of the sequence's n-grams kept up to date incrementally).

Verification: the scheduler feeds the sequence's last token and its drafts in one forward (1 + N
query tokens, the chunked-prefill path of the attention backend), so the step has logits for every
draft position. `verify` walks them in order (vLLM / TGI's rule): a greedy row keeps a draft while
it is the argmax; a sampled row keeps draft x with probability p(x) under the row's processed
distribution (temperature, top-k, top-p, typical-p, logit bias) and otherwise draws from p with x
removed and renormalised, which leaves the output distributed exactly as p (the n-gram draft is a
point mass). After the last kept draft comes one more token from the next position's
distribution, so every step emits 1 to N + 1 tokens. The k/v written for rejected drafts lies past
the sequence's computed tokens: never registered in the prefix cache, overwritten by later steps,
and the blocks that only held them are given back (`Scheduler.update_from_output`).

Rows that are not speculated (`can_speculate`): penalties that depend on the tokens before each
position (repetition, frequency, presence), per-row processors that keep state (grammar,
watermark), `min_new_tokens` not yet reached (the EOS mask depends on the position), reward-model
scoring. They decode one token per step beside speculated rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from opentgi.engine.sampling.sampler import greedy_tokens, row_log_softmax
from opentgi.engine.scheduling.sequence import Sequence

MAX_NGRAM = 4
MIN_NGRAM = 1


def can_speculate(seq: Sequence) -> bool:
    request = seq.request
    sampling = request.sampling
    return not (request.score or seq.processors or sampling.repetition_penalty != 1.0
                or sampling.frequency_penalty != 0.0 or sampling.presence_penalty != 0.0
                or seq.num_generated_tokens < request.stopping.min_new_tokens)


class _NgramIndex:
    """n-gram -> the position just after its first occurrence, over token_ids[:indexed_end]."""

    __slots__ = ("first", "indexed_end")

    def __init__(self):
        self.first: dict[tuple[int, ...], int] = {}
        self.indexed_end = 0

    def extend(self, ids: list[int], end: int) -> None:
        first = self.first
        for e in range(self.indexed_end + 1, end + 1):
            for n in range(MIN_NGRAM, min(MAX_NGRAM, e) + 1):
                first.setdefault(tuple(ids[e - n:e]), e)
        self.indexed_end = max(self.indexed_end, end)


class NgramProposer:
    def __init__(self, num_speculative_tokens: int):
        self.k = num_speculative_tokens
        self._index: dict[int, _NgramIndex] = {}  # seq_id -> its n-gram index

    def propose(self, seq: Sequence) -> list[int]:
        """Up to k tokens that may follow seq.token_ids, [] when nothing matches or nothing more may
        be generated."""
        ids = seq.token_ids
        length = len(ids)
        limit = min(self.k, seq.max_new_tokens - seq.num_generated_tokens - 1)
        if seq.stop_checker is not None:
            limit = min(limit, seq.stop_checker.max_total_tokens - length - 1)
        if limit <= 0:
            return []
        index = self._index.get(seq.seq_id)
        if index is None:
            index = self._index[seq.seq_id] = _NgramIndex()
        # grams ending before the last token: each has at least one token after it
        index.extend(ids, length - 1)
        for n in range(min(MAX_NGRAM, length - 1), MIN_NGRAM - 1, -1):
            start = index.first.get(tuple(ids[length - n:]))
            if start is not None:
                return ids[start:start + limit]
        return []

    def forget(self, seq: Sequence) -> None:
        self._index.pop(seq.seq_id, None)


@dataclass
class VerifyOutput:
    """Per sequence: the tokens it keeps this step (its accepted drafts, then one more), their
    logprobs and top-n alternatives."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    top: list[list]


def _draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One index drawn from the unnormalised distribution probs [K] (inverse CDF, one uniform)."""
    cdf = probs.cumsum(dim=-1)
    u = torch.rand(1, generator=generator, device=probs.device)
    chosen = int(torch.searchsorted(cdf, u * cdf[-1], right=True).clamp_(max=probs.shape[-1] - 1))
    if float(probs[chosen]) == 0.0:  # rounding at the very end of the CDF
        chosen = int(probs.argmax())
    return chosen


def verify(sampler, seqs: list[Sequence], drafts: list[list[int]], logits: torch.Tensor) -> VerifyOutput:
    """logits: [sum(1 + len(d) for d in drafts), vocab], each sequence's positions in order (the
    logits after its last computed token, then after each draft)."""
    rows = [seq for seq, d in zip(seqs, drafts) for _ in range(1 + len(d))]
    batch = sampler.batch_for(rows)
    logits = logits[:, :sampler.vocab_size].float()
    log_probs = row_log_softmax(logits)  # as the sampler's, row for row
    scores = logits if batch.plain_greedy else sampler._process(batch, logits.clone())
    argmax = greedy_tokens(scores).tolist()
    probs = ids = None
    sample_pos: dict[int, int] = {}
    if batch.any_sample:
        probs, ids = sampler.distribution(batch, scores)
        sample_pos = {row: i for i, row in enumerate(batch.sample_rows)}

    def draw(row: int, excluded: int | None = None) -> int:
        p = probs[sample_pos[row]]
        if excluded is not None:
            p = p.masked_fill((ids[sample_pos[row]] if ids is not None else
                               torch.arange(p.shape[0], device=p.device)) == excluded, 0.0)
            if float(p.sum()) <= 0.0:  # p(x) was 1 up to rounding: nothing else to draw
                return excluded
        i = _draw(p, rows[row].generator)
        return int(ids[sample_pos[row], i]) if ids is not None else i

    def prob_of(row: int, token: int) -> float:
        p = probs[sample_pos[row]]
        if ids is None:
            return float(p[token])
        return float(p[ids[sample_pos[row]] == token].sum())

    out = VerifyOutput([], [], [])
    chosen_rows: list[int] = []
    chosen_all: list[int] = list(argmax)
    row = 0
    for seq, d in zip(seqs, drafts):
        sampled = seq.request.sampling.do_sample
        kept: list[int] = []
        for j, x in enumerate(d):
            r = row + j
            if not sampled:
                t = argmax[r]
            else:
                u = float(torch.rand(1, generator=seq.generator, device=logits.device))
                t = x if u < prob_of(r, x) else draw(r, excluded=x)
            kept.append(t)
            chosen_all[r] = t
            if t != x:
                break
        else:
            r = row + len(d)
            t = argmax[r] if not sampled else draw(r)
            kept.append(t)
            chosen_all[r] = t
        chosen_rows.extend(range(row, row + len(kept)))
        out.token_ids.append(kept)
        row += 1 + len(d)
    index = torch.tensor(chosen_rows, device=logits.device)
    chosen = torch.tensor([chosen_all[r] for r in chosen_rows], device=logits.device)
    lps = log_probs.index_select(0, index).gather(1, chosen.unsqueeze(1)).squeeze(1).tolist()
    top = sampler._top_n(batch, logits, log_probs) if batch.any_top_n else [None] * batch.size
    batch.update(torch.tensor(chosen_all, device=logits.device))
    if batch.any_processors:  # rows with processors are never speculated: one position each
        for procs, tok in zip(batch.processors, chosen_all):
            for proc in procs:
                proc.accept(tok)
    k = 0
    for kept in out.token_ids:
        out.logprobs.append(lps[k:k + len(kept)])
        out.top.append([top[r] for r in chosen_rows[k:k + len(kept)]])
        k += len(kept)
    return out
