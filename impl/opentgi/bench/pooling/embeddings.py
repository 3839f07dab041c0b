"""`python -m opentgi.bench embeddings`: the server's `/v1/embeddings` against sentence-transformers'
`encode` in this process, on the same machine, model and thread count.

Random-weight sentence-transformers folders (float32 safetensors under the cache folder, built
once) of two shapes:
- `bge-small`: a BERT encoder of bge-small-en-v1.5's shape (hidden 384, 12 layers, 12 heads,
  intermediate 1536, 512 positions, a 30,522-token WordPiece vocabulary), CLS pooling, Normalize;
- `qwen3-0.6b`: a Qwen3 decoder of Qwen3-Embedding-0.6B's shape (hidden 1024, 28 layers, 16 heads
  of 128, 8 kv heads, intermediate 3072, 151,669-token vocabulary, tied embeddings; SmolLM2's
  tokenizer from the default model's GGUF), last-token pooling, Normalize.

For each: `--texts` different texts of about `--tokens` tokens (from `--tokens` - 10 to + 10), all
in one request (`input` a list, float encoding), on a server started here (`--dtype float32
--num-threads N --max-client-batch-size`), timed at the client from sending to the whole answer;
and `SentenceTransformer(folder).encode(texts)` (its defaults: batches of 32, sorted by length)
with N torch threads, the server idle meanwhile. One unmeasured warm-up each (the first 4 texts),
then `--rounds`
rounds of one request and one encode right after each other (both meet the same load on a shared
machine); the best of each counts.
The two answers are checked to agree (cosine) so that both computed the same vectors.
"""

from __future__ import annotations

import argparse
import json
import random
import string
import time
from pathlib import Path

BGE_SMALL = {"hidden_size": 384, "num_hidden_layers": 12, "num_attention_heads": 12, "intermediate_size": 1536,
             "max_position_embeddings": 512, "vocab_size": 30522}
QWEN3_06B = {"hidden_size": 1024, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
             "head_dim": 128, "intermediate_size": 3072, "max_position_embeddings": 32768, "vocab_size": 151669,
             "rope_theta": 1000000.0, "tie_word_embeddings": True, "rms_norm_eps": 1e-6}
MODELS = ("bge-small", "qwen3-0.6b")
WORDS = ("the of and to in is was for on that with as by at from it an be this are which or had his not but "
         "what all were when we there can been has more if will one would about who out so up said into "
         "them some could time these two may then do first any my now such like other how its our over "
         "city river bridge market merchant scholar story chapter generation spice cloth distant land "
         "history surprise long full new tale every added wrote came bringing learning deep network data "
         "model search query document answer question relevant science computer neural machine").split()


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m opentgi.bench embeddings", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    p.add_argument("--texts", type=int, default=64)
    p.add_argument("--tokens", type=int, default=200, help="tokens a text, about")
    p.add_argument("--rounds", type=int, default=3, help="timed requests (and encodes); the best counts")
    p.add_argument("--num-threads", type=int, default=None, help="torch threads, server and encode")
    p.add_argument("--server-arg", action="append", default=[], help="extra `opentgi serve` argument")
    p.add_argument("--startup-timeout", type=float, default=900.0)
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--output", default="", help="a markdown file to append the table to")
    return p.parse_args(argv)


def _st_files(folder: Path, pooling: str, dim: int, max_seq_length: int) -> None:
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    (folder / "modules.json").write_text(json.dumps(modules, indent=2))
    for sub in ("1_Pooling", "2_Normalize"):
        (folder / sub).mkdir(exist_ok=True)
    flags = {"pooling_mode_cls_token": pooling == "cls", "pooling_mode_mean_tokens": pooling == "mean",
             "pooling_mode_lasttoken": pooling == "lasttoken", "pooling_mode_max_tokens": False,
             "pooling_mode_mean_sqrt_len_tokens": False}
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": dim, **flags}))
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_seq_length,
                                                                  "do_lower_case": False}))


def _bert_tokenizer(folder: Path, vocab_size: int) -> None:
    from transformers import BertTokenizerFast

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *dict.fromkeys(WORDS)]
    chars = string.ascii_lowercase + string.digits + string.punctuation
    vocab += [c for c in chars if c not in vocab] + [f"##{c}" for c in string.ascii_lowercase + string.digits]
    vocab += [f"[unused{i}]" for i in range(vocab_size - len(vocab))]
    (folder / "vocab.txt").write_text("\n".join(vocab) + "\n", encoding="utf-8")
    BertTokenizerFast(vocab_file=str(folder / "vocab.txt"), model_max_length=512).save_pretrained(folder)


def model_folder(name: str, cache_dir: str | None) -> Path:
    """The random-weight sentence-transformers folder of `name`, built on first use."""
    import torch
    import transformers

    from opentgi.models.checkpoints.default_model import default_cache_dir, default_gguf_path
    from opentgi.models.checkpoints.gguf_tokenizer import load_gguf_tokenizer

    folder = default_cache_dir(cache_dir) / "bench-models" / f"embedding-{name}"
    if (folder / ".complete").exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    if name == "bge-small":
        _bert_tokenizer(folder, BGE_SMALL["vocab_size"])
        model = transformers.BertModel(transformers.BertConfig(**BGE_SMALL))
        _st_files(folder, "cls", BGE_SMALL["hidden_size"], 512)
    else:
        load_gguf_tokenizer(default_gguf_path()).save_pretrained(folder)
        model = transformers.Qwen3Model(transformers.Qwen3Config(bos_token_id=1, eos_token_id=2, **QWEN3_06B))
        _st_files(folder, "lasttoken", QWEN3_06B["hidden_size"], 32768)
    model.to(torch.float32).eval().save_pretrained(folder, safe_serialization=True)
    (folder / ".complete").write_text(name)
    return folder


def make_texts(tokenizer, count: int, tokens: int, seed: int = 0) -> list[str]:
    """`count` different texts of `tokens` - 10 to `tokens` + 10 tokens (with special tokens)."""
    rng = random.Random(seed)
    special = len(tokenizer("a")["input_ids"]) - len(tokenizer("a", add_special_tokens=False)["input_ids"])
    texts = []
    for i in range(count):
        target = tokens - 10 + i % 21 - special
        ids = tokenizer(" ".join(rng.choice(WORDS) for _ in range(2 * tokens)), add_special_tokens=False)["input_ids"]
        texts.append(tokenizer.decode(ids[:target]))
    return texts


def _server(args, folder: Path):
    from opentgi.bench.http_load import local_server

    server_args = argparse.Namespace(
        model_id=str(folder), num_threads=args.num_threads, startup_timeout=args.startup_timeout,
        server_arg=["--dtype", "float32", "--max-client-batch-size", str(args.texts), *args.server_arg])
    return local_server(server_args)


def _compare(url: str, folder: Path, texts: list[str], rounds: int, threads: int):
    """(best served seconds, best encode seconds, served vectors, encoded vectors): a warm-up of
    each, then `rounds` rounds of one request and one encode, one right after the other, so that
    both meet the same load on a shared machine."""
    import httpx
    import torch
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(threads)
    model = SentenceTransformer(str(folder), device="cpu")
    body = {"model": "bench", "input": texts}
    served, encoded = [], []
    with httpx.Client(timeout=3600) as client:
        for i in range(rounds + 1):  # the first is a warm-up, of the first 4 texts
            batch = texts if i else texts[:4]
            start = time.perf_counter()
            response = client.post(f"{url}/v1/embeddings", json={**body, "input": batch})
            served.append(time.perf_counter() - start)
            response.raise_for_status()
            got = [row["embedding"] for row in response.json()["data"]]
            start = time.perf_counter()
            expected = model.encode(batch)
            encoded.append(time.perf_counter() - start)
            print(f"  round {i}{' (warm-up)' if i == 0 else ''}: server {served[-1]:.3f} s, "
                  f"sentence-transformers {encoded[-1]:.3f} s", flush=True)
    return min(served[1:]), min(encoded[1:]), got, expected


def main(argv=None) -> None:
    import os

    import numpy as np
    import sentence_transformers
    import torch
    from transformers import AutoTokenizer

    from opentgi.bench.report import machine_line

    args = parse_args(argv)
    args.num_threads = args.num_threads or torch.get_num_threads()
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        raise SystemExit(f"--models: unknown {unknown}; known: {', '.join(MODELS)}")
    rows = []
    for name in names:
        folder = model_folder(name, args.cache_dir)
        tokenizer = AutoTokenizer.from_pretrained(folder)
        texts = make_texts(tokenizer, args.texts, args.tokens)
        total = sum(len(tokenizer(t)["input_ids"]) for t in texts)
        print(f"{name}: {len(texts)} texts, {total} tokens", flush=True)
        with _server(args, folder) as url:
            served, encoded, got, expected = _compare(url, folder, texts, args.rounds, args.num_threads)
        a, b = np.asarray(got, dtype=np.float64), np.asarray(expected, dtype=np.float64)
        cosine = float(((a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)).min())
        rows.append((name, total, served, encoded, cosine))
    load = os.getloadavg()[0]
    lines = [f"## {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} — `/v1/embeddings` vs sentence-transformers",
             "", f"Machine: {machine_line(args.num_threads)}; sentence-transformers {sentence_transformers.__version__}; "
             f"1-minute load average at the end {load:.2f}.", "",
             f"{args.texts} texts of about {args.tokens} tokens in one request, float32, best of {args.rounds} "
             f"after a warm-up (`python -m opentgi.bench embeddings`).", "",
             "| model | tokens | opentgi `/v1/embeddings` | sentence-transformers `encode` | ratio | min cosine |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, total, served, encoded, cosine in rows:
        lines.append(f"| {name} (random weights) | {total} | {served:.2f} s ({total / served:.0f} tokens/s) | "
                     f"{encoded:.2f} s ({total / encoded:.0f} tokens/s) | {encoded / served:.2f}x | {cosine:.6f} |")
    text = "\n".join(lines) + "\n"
    print()
    print(text)
    if args.output:
        with Path(args.output).open("a") as f:
            f.write("\n" + text)
