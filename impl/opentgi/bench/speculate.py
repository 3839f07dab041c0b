"""The speculative-decoding comparison of the benchmark (`python -m opentgi.bench --speculate N`).

A code-editing workload, where the answer repeats much of the prompt: the model's chat template
around "Rewrite this function with type hints", for a few Python functions. Two servers on the same
model run side by side in one run, one plain and one with `--speculate N`; one request at a time
(single stream), greedy, through TGI's `/generate`, in interleaved rounds (this machine's load
swings between rounds: each round runs every prompt on both servers, the order alternating). It
reports each server's single-stream throughput (generated tokens / request wall time), their
ratio, the draft acceptance rate from the speculating server's /metrics, and whether both
servers generated the same tokens.
"""

from __future__ import annotations

import argparse
import re
import statistics
import time
from dataclasses import dataclass, field

FUNCTIONS = [
    '''def merge_intervals(intervals):
    """Merge overlapping intervals and return them sorted by start."""
    if not intervals:
        return []
    intervals = sorted(intervals, key=lambda pair: pair[0])
    merged = [intervals[0]]
    for start, end in intervals[1:]:
        last_start, last_end = merged[-1]
        if start <= last_end:
            merged[-1] = (last_start, max(last_end, end))
        else:
            merged.append((start, end))
    return merged
''',
    '''def word_frequencies(text, stop_words, limit):
    """Count the words of a text, leaving out stop words, and return the most common ones."""
    counts = {}
    for line in text.splitlines():
        for word in line.lower().split():
            word = word.strip(".,;:!?\\"'()")
            if not word or word in stop_words:
                continue
            counts[word] = counts.get(word, 0) + 1
    ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
    return ranked[:limit]
''',
    '''class Inventory:
    def __init__(self):
        self.items = {}

    def add(self, name, quantity, price):
        if name in self.items:
            self.items[name]["quantity"] += quantity
        else:
            self.items[name] = {"quantity": quantity, "price": price}

    def remove(self, name, quantity):
        if name not in self.items or self.items[name]["quantity"] < quantity:
            raise ValueError("not enough " + name)
        self.items[name]["quantity"] -= quantity

    def total_value(self):
        return sum(item["quantity"] * item["price"] for item in self.items.values())
''',
    '''def parse_config(lines, defaults):
    """Read key = value lines into a dict, on top of the defaults; # starts a comment."""
    config = dict(defaults)
    for number, line in enumerate(lines, start=1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        if "=" not in line:
            raise ValueError("line " + str(number) + ": expected key = value")
        key, value = line.split("=", 1)
        config[key.strip()] = value.strip()
    return config
''',
]
INSTRUCTION = "Rewrite this function with type hints. Keep everything else the same.\n\n```python\n{code}```"


def code_edit_prompts(tokenizer) -> list[str]:
    prompts = []
    for code in FUNCTIONS:
        messages = [{"role": "user", "content": INSTRUCTION.format(code=code)}]
        prompts.append(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    return prompts


@dataclass
class Totals:
    tokens: int = 0
    wall_s: float = 0.0
    per_round: list[float] = field(default_factory=list)  # tokens/s of each round

    @property
    def throughput(self) -> float:
        return self.tokens / self.wall_s if self.wall_s else 0.0


def generate(client, url: str, prompt: str, new_tokens: int) -> tuple[list[int], float]:
    body = {"inputs": prompt, "parameters": {"max_new_tokens": new_tokens, "do_sample": False, "details": True}}
    started = time.perf_counter()
    response = client.post(f"{url}/generate", json=body)
    wall = time.perf_counter() - started
    response.raise_for_status()
    return [t["id"] for t in response.json()["details"]["tokens"]], wall


def _counter(metrics: str, name: str) -> float:
    found = re.search(rf"^{name} (\S+)$", metrics, re.M)
    return float(found.group(1)) if found else 0.0


def speculate_comparison(args, loaded, local_server, machine_line) -> str:
    import httpx

    prompts = code_edit_prompts(loaded.tokenizer)
    n = args.speculate
    plain_args = argparse.Namespace(**vars(args))
    spec_args = argparse.Namespace(**vars(args))
    spec_args.server_arg = [*args.server_arg, "--speculate", str(n)]
    totals = {"plain": Totals(), "speculate": Totals()}
    outputs: dict[str, dict[int, list[int]]] = {"plain": {}, "speculate": {}}
    with local_server(plain_args) as plain_url, local_server(spec_args) as spec_url, \
            httpx.Client(timeout=httpx.Timeout(600.0)) as client:
        urls = {"plain": plain_url, "speculate": spec_url}
        for url in urls.values():  # warm-up
            generate(client, url, prompts[0], 4)
        for round_ in range(args.speculate_rounds):
            order = ["plain", "speculate"] if round_ % 2 == 0 else ["speculate", "plain"]
            for name in order:
                tokens, wall = 0, 0.0
                for i, prompt in enumerate(prompts):
                    ids, seconds = generate(client, urls[name], prompt, args.speculate_new_tokens)
                    outputs[name][i] = ids
                    tokens += len(ids)
                    wall += seconds
                t = totals[name]
                t.tokens += tokens
                t.wall_s += wall
                t.per_round.append(tokens / wall)
                print(f"round {round_ + 1}, {name}: {tokens} tokens in {wall:.1f}s = {tokens / wall:.1f} tokens/s",
                      flush=True)
        metrics = client.get(f"{spec_url}/metrics").text
    drafted = _counter(metrics, "opentgi_spec_draft_tokens_total")
    accepted = _counter(metrics, "opentgi_spec_accepted_tokens_total")
    same = sum(outputs["plain"][i] == outputs["speculate"][i] for i in outputs["plain"])
    p, s = totals["plain"], totals["speculate"]
    ratios = [b / a for a, b in zip(p.per_round, s.per_round)]
    lines = [
        f"## {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} — speculative decoding, code editing, "
        f"{loaded.model_id}, {loaded.spec.dtype}",
        "",
        f"Machine: {machine_line(args.num_threads)}.",
        (f"Two servers side by side in one run, `{' '.join(['opentgi serve', *args.server_arg])}` and the same with "
         f"`--speculate {n}`; single stream (one request at a time), greedy, TGI `/generate`, up to "
         f"{args.speculate_new_tokens} new tokens; {len(prompts)} chat prompts \"Rewrite this function with "
         f"type hints\" around 11-17-line Python functions; {args.speculate_rounds} interleaved rounds "
         f"(every prompt on both servers, the order alternating)."),
        "",
        "| server | tokens | tokens/s (all rounds) | tokens/s (median round) |",
        "|---|---:|---:|---:|",
        f"| plain | {p.tokens} | {p.throughput:.1f} | {statistics.median(p.per_round):.1f} |",
        f"| `--speculate {n}` | {s.tokens} | {s.throughput:.1f} | {statistics.median(s.per_round):.1f} |",
        "",
        "| measure | value |",
        "|---|---:|",
        f"| single-stream throughput, speculate / plain (all rounds) | {s.throughput / p.throughput:.2f}x |",
        f"| same, median of the rounds' ratios | {statistics.median(ratios):.2f}x |",
        f"| drafts accepted / proposed | {accepted:.0f} / {drafted:.0f} = "
        f"{accepted / drafted if drafted else 0.0:.2f} |",
        f"| prompts with the same greedy tokens on both servers | {same} of {len(prompts)} |",
    ]
    return "\n".join(lines) + "\n"
