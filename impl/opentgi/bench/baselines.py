"""In-process baselines on the served model: serial transformers `generate`, and a bare loop of the
paged model's own forward with its KV cache (no scheduler, no sampler, no HTTP).

`python -m opentgi.bench images [--requests N] [--new-tokens M]` (`images_main`): image-request
throughput against transformers on the same model and CPU, in one run. A random model of
SmolVLM's layout (`Idefics3ForConditionalGeneration`: SmolLM2-135M's text shape, untied; a
six-layer SigLIP tower of hidden 384 over 256 x 256 tiles in 16 x 16 patches, pixel shuffle by 2,
so 64 tokens a tile; images resized to a longest edge of 512, so 4 tiles and the global image)
is built once with transformers (float32 safetensors under the cache folder), with the same text
model saved alone as a LlamaForCausalLM beside it. N chat requests, each with its own random
320 x 240 image, go to an engine in this process all at once (preprocessing, encoding, prefill
and M greedy tokens each, EOS ignored; default flags: each image encoded alone); transformers
runs the same prompts and pixels through `generate` one request after the other, then as one
left-padded batch. `--num-threads K` pins both sides to K torch threads (by default the engine
takes fewer while other work holds the cores, and transformers keeps all of them). Each side is warmed with one unmeasured request first. A last line compares
the decode step of text-only requests on the VLM and on its text model alone (`bench/steps.py`,
medians over alternating rounds).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from pathlib import Path


def hf_serial_generate(folder: Path, tokenizer, prompts: list[str], new_tokens: int) -> tuple[float, int]:
    """(tokens/s, tokens) of transformers `generate`, one request after the other, greedy."""
    import torch

    from opentgi.models.loader import load_transformers_model

    model = load_transformers_model(folder, torch.float32)
    eos = model.generation_config.eos_token_id
    tokens = 0
    started = time.perf_counter()
    with torch.inference_mode():
        for prompt in prompts:
            ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                 do_sample=False, eos_token_id=eos, pad_token_id=tokenizer.eos_token_id)
            tokens += out.shape[1] - ids.shape[1]
    return tokens / (time.perf_counter() - started), tokens


def bare_forward_loop(loaded, tokenizer, prompt: str, new_tokens: int) -> float:
    """Decode tokens/s of the paged model's forward + greedy argmax in a plain loop."""
    import torch

    from opentgi.engine.execution.kv_cache import allocate_kv_caches
    from opentgi.engine.scheduling.block_manager import BlockManager
    from opentgi.models.attention.metadata import AttentionMetadata

    model, spec = loaded.model, loaded.spec
    block_size = loaded.block_size
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    total = len(ids) + new_tokens
    num_blocks = BlockManager(1, block_size).blocks_for(total)
    kv = allocate_kv_caches(spec, num_blocks, block_size)
    device = torch.device(spec.device)
    table = torch.arange(num_blocks, dtype=torch.int32, device=device).unsqueeze(0)

    def meta(start: int, n: int) -> AttentionMetadata:
        i32 = {"dtype": torch.int32, "device": device}
        return AttentionMetadata(
            slot_mapping=torch.arange(start, start + n, dtype=torch.int64, device=device),
            cu_seqlens_q=torch.tensor([0, n], **i32), cu_seqlens_k=torch.tensor([0, start + n], **i32),
            max_seqlen_q=n, max_seqlen_k=start + n, context_lens=torch.tensor([start + n], **i32),
            block_tables=table, decode_only=n == 1)

    with torch.inference_mode():
        hidden = model.forward(torch.tensor(ids, device=device), torch.arange(len(ids), device=device),
                               meta(0, len(ids)), kv)
        token = model.compute_logits(hidden[-1:]).argmax(-1)
        started = time.perf_counter()
        for pos in range(len(ids), total - 1):
            hidden = model.forward(token, torch.tensor([pos], device=device), meta(pos, 1), kv)
            token = model.compute_logits(hidden).argmax(-1)
            int(token)  # the engine needs the token on the host each step too
        elapsed = time.perf_counter() - started
    return (new_tokens - 1) / elapsed


VLM_VISION = {"hidden_size": 384, "intermediate_size": 1536, "num_hidden_layers": 6, "num_attention_heads": 6,
              "image_size": 256, "patch_size": 16}
VLM_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n"
    "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)


def smolvlm_shaped_model(cache_dir: str | None) -> tuple[Path, Path]:
    """(the VLM's folder, its text model's folder), built on first use."""
    import torch
    from transformers import (
        GenerationConfig,
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3ImageProcessor,
        Idefics3Processor,
        LlamaConfig,
        LlamaForCausalLM,
    )

    from opentgi.bench.architectures import SHAPE
    from opentgi.models.checkpoints.default_model import default_cache_dir, default_gguf_path
    from opentgi.models.checkpoints.gguf_tokenizer import load_gguf_tokenizer

    folder = default_cache_dir(cache_dir) / "bench-models" / "smolvlm-576x30-siglip384x6"
    text_folder = folder / "text-model"
    if (folder / ".complete").exists():
        return folder, text_folder
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = load_gguf_tokenizer(default_gguf_path())
    processor = Idefics3Processor(image_processor=Idefics3ImageProcessor(
        size={"longest_edge": 2 * VLM_VISION["image_size"]}, max_image_size={"longest_edge": VLM_VISION["image_size"]}),
        tokenizer=tokenizer, image_seq_len=64, chat_template=VLM_TEMPLATE)
    tokenizer.chat_template = VLM_TEMPLATE
    text = {**SHAPE, "tie_word_embeddings": False, "vocab_size": len(tokenizer), "bos_token_id": 1, "eos_token_id": 2}
    config = Idefics3Config(text_config=text, vision_config=VLM_VISION, scale_factor=2, tie_word_embeddings=False,
                            image_token_id=tokenizer.convert_tokens_to_ids("<image>"), torch_dtype="float32")
    torch.manual_seed(0)
    model = Idefics3ForConditionalGeneration(config).to(torch.float32).eval()
    model.save_pretrained(folder, safe_serialization=True)
    processor.save_pretrained(folder)
    generation = GenerationConfig(bos_token_id=1, eos_token_id=[2, 0], pad_token_id=2)
    generation.save_pretrained(folder)
    alone = LlamaForCausalLM(LlamaConfig(**text)).to(torch.float32).eval()
    alone.model.load_state_dict(model.model.text_model.state_dict())
    alone.lm_head.load_state_dict(model.lm_head.state_dict())
    alone.save_pretrained(text_folder, safe_serialization=True)
    tokenizer.save_pretrained(text_folder)
    generation.save_pretrained(text_folder)
    (folder / ".complete").write_text("smolvlm")
    return folder, text_folder


def _random_images(n: int, seed: int = 0) -> list[tuple[bytes, object]]:
    import io

    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        image = Image.fromarray(rng.integers(0, 256, (240, 320, 3), dtype=np.uint8))
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        out.append((buffer.getvalue(), image))
    return out


def _prompt(i: int) -> str:
    return f"<|im_start|>User:<image>Describe picture {i} in detail.<end_of_utterance>\nAssistant:"


async def _opentgi_images(loaded, settings, images, new_tokens: int) -> float:
    """Seconds for the engine to answer every (index, image) request, all submitted at once
    (preprocessing included), after one unmeasured request."""
    from opentgi.engine.engine import Engine
    from opentgi.engine.request import GenerationRequest, SamplingParams, StoppingParams

    engine = Engine(loaded, settings)
    await engine.start()

    async def request(i: int, raw: bytes, image):
        ids, inputs = await engine.encode_images(_prompt(i), [_image_data((raw, image))], add_special_tokens=False)
        req = GenerationRequest(ids, SamplingParams(), StoppingParams(max_new_tokens=new_tokens, ignore_eos=True))
        req.images = inputs
        return await (await engine.submit(req)).result()

    try:
        await request(-1, *images[0])
        started = time.perf_counter()
        await asyncio.gather(*(request(i, raw, image) for i, (raw, image) in enumerate(images[1:])))
        return time.perf_counter() - started
    finally:
        await engine.stop()


def _transformers_images(folder: Path, images, new_tokens: int) -> tuple[float, float]:
    """(seconds serially, seconds as one batch) for transformers' processor and `generate` on the
    same requests, after one unmeasured request."""
    import torch
    from transformers import AutoProcessor, Idefics3ForConditionalGeneration

    processor = AutoProcessor.from_pretrained(folder, use_fast=False)
    processor.tokenizer.padding_side = "left"
    model = Idefics3ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()

    def run(indices: list[int], pictures: list) -> None:
        inputs = processor(text=[_prompt(i) for i in indices], images=[[p] for p in pictures], padding=True,
                           add_special_tokens=False, return_tensors="pt")
        inputs.pop("token_type_ids", None)
        with torch.inference_mode():
            model.generate(**inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                           pad_token_id=2)

    run([-1], [images[0][1]])
    started = time.perf_counter()
    for i, (_, image) in enumerate(images[1:]):
        run([i], [image])
    serial = time.perf_counter() - started
    started = time.perf_counter()
    run(list(range(len(images) - 1)), [image for _, image in images[1:]])
    return serial, time.perf_counter() - started


def images_main(argv: list[str]) -> None:
    from opentgi.bench.report import machine_line
    from opentgi.bench.steps import measure
    from opentgi.config import Settings
    from opentgi.models.loader import load_model

    p = argparse.ArgumentParser(prog="python -m opentgi.bench images", description=__doc__.split("\n\n")[1])
    p.add_argument("--requests", type=int, default=8, help="image requests, each with its own image")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--text-concurrency", type=int, default=4, help="text-only requests per decode comparison")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds of the text-only comparison")
    p.add_argument("--num-threads", type=int, default=None,
                   help="torch threads on both sides, the engine's fixed (default: torch's; the engine "
                        "then takes fewer while other work holds cores, transformers does not)")
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--output", help="also append the lines to this file")
    args = p.parse_args(argv)
    if args.num_threads:
        import torch

        torch.set_num_threads(args.num_threads)
    folder, text_folder = smolvlm_shaped_model(args.cache_dir)
    images = _random_images(args.requests + 1)
    settings = Settings(model_id=str(folder), dtype="float32", num_threads=args.num_threads,
                        fixed_threads=bool(args.num_threads))
    loaded = load_model(settings)
    tokens = args.requests * args.new_tokens
    ours = asyncio.run(_opentgi_images(loaded, settings, images, args.new_tokens))
    serial, batched = _transformers_images(folder, images, args.new_tokens)
    ids, inputs = loaded.image_prompts(_prompt(0), [_image_data(images[1])], False)
    text = load_model(Settings(model_id=str(text_folder), dtype="float32", num_threads=args.num_threads))
    prompts = [loaded.tokenizer(f"<|im_start|>User:Tell me story {i}.<end_of_utterance>\nAssistant:",
                                add_special_tokens=False)["input_ids"] for i in range(args.text_concurrency)]
    steps: dict[str, list[float]] = {"vlm": [], "text": []}
    for _ in range(args.rounds):
        for name, model in (("vlm", loaded), ("text", text)):
            steps[name].append(measure(model, settings, prompts, args.text_concurrency, args.new_tokens).step_ms)
    vlm_ms, text_ms = statistics.median(steps["vlm"]), statistics.median(steps["text"])
    load = os.getloadavg()
    lines = [
        f"Machine: {machine_line(args.num_threads)}; load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}.",
        f"SmolVLM-shaped random model (float32), {args.requests} requests x {args.new_tokens} new tokens, one "
        f"320 x 240 image each ({len(inputs[0].positions)} image tokens, {len(ids)} prompt tokens):",
        "",
        "| server | seconds | tokens/s | opentgi's ratio |",
        "|---|---:|---:|---:|",
        f"| opentgi engine, all requests at once | {ours:.2f} | {tokens / ours:.1f} | 1.00 |",
        f"| transformers generate, one after another | {serial:.2f} | {tokens / serial:.1f} | {serial / ours:.2f} |",
        f"| transformers generate, one padded batch | {batched:.2f} | {tokens / batched:.1f} | {batched / ours:.2f} |",
        "",
        f"Text-only decode step at c={args.text_concurrency} (median of {args.rounds} alternating rounds): "
        f"VLM {vlm_ms:.2f} ms, its text model alone {text_ms:.2f} ms (ratio {vlm_ms / text_ms:.3f}).",
    ]
    print("\n".join(lines))
    if args.output:
        with open(args.output, "a") as f:
            f.write("\n".join(lines) + "\n")


def _image_data(item):
    import hashlib

    from opentgi.engine.request import ImageData

    raw, image = item
    return ImageData(image, hashlib.sha256(raw).hexdigest())
