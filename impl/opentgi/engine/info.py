"""What the engine tells the APIs about itself: static facts (EngineInfo) and live counters
(EngineStats)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EngineInfo:
    model_id: str
    model_sha: str | None
    model_dtype: str  # e.g. "torch.float32"
    model_device_type: str  # "cpu" | "cuda"
    architecture: str
    pipeline_tag: str  # "text-generation" (or "text-classification" for a reward model)
    max_input_tokens: int
    max_total_tokens: int
    max_batch_total_tokens: int  # the real KV pool, in tokens
    max_batch_prefill_tokens: int
    block_size: int
    num_blocks: int
    eos_token_ids: list[int] = field(default_factory=list)
    chat_template: str | None = None
    is_reward_model: bool = False
    bos_token: str | None = None
    eos_token: str | None = None
    max_concurrent_requests: int = 128
    max_best_of: int = 2
    max_stop_sequences: int = 4
    max_top_n_tokens: int = 5
    max_waiting_tokens: int = 20
    max_batch_size: int | None = None
    waiting_served_ratio: float = 1.2
    chunked_prefill_tokens: int | None = None
    runner_kind: str = "paged"  # "paged" | "generic"
    vocab_size: int = 0
    adapters: list[str] = field(default_factory=list)  # LoRA adapters loaded at start-up, in order
    speculate: int = 0  # n-gram drafts per decode step (--speculate; 0 when off or not possible)
    deterministic: bool = True  # batch-invariant numerics (False with --nondeterministic)
    supported_architectures: list[str] = field(default_factory=list)  # those of the paged path
    kernels: str = "torch"  # a GGUF's matmul path: "native (avx2)" or "torch (why)" (opentgi.kernels)
    kv_cache_dtype: str | None = None  # the paged KV cache's ("float16", ...); None: no paged cache
    image_input: bool = False  # a vision-language model served with its image encoder
    image_marker: str | None = None  # where an image goes in its prompt text (e.g. Idefics3's `<image>`)
    model_kind: str = "generation"  # | "embedding" | "rerank" | "classification" (engine/pooling/)
    embedding_dimension: int = 0  # an embedding model's vector size


@dataclass
class EngineStats:
    waiting: int
    running: int
    num_blocks: int
    used_blocks: int
    cached_blocks: int
    tokens_held_running: int
    peak_tokens_running: int
    preemptions_total: int
    prefix_hit_tokens: int
    prefix_query_tokens: int
    steps_total: int
    last_step_at: float
    requests_in_flight: int = 0


@dataclass(frozen=True)
class ChatTemplate:
    """What a chat template renders with: the template (or the tokenizer's named templates, so
    `tool_use` can be picked when tools are given) and the special tokens it may name."""

    template: str | dict[str, str] | None
    bos_token: str | None = None
    eos_token: str | None = None
    special_tokens: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class TokenizedText:
    """/tokenize's answer: token ids and each token's (start, end) character offsets."""

    ids: list[int]
    offsets: list[tuple[int, int]]

    @staticmethod
    def of(tokenizer, text: str) -> TokenizedText | None:
        """`text` through `tokenizer` with offsets; None when it is not a fast one (no offsets)."""
        if not getattr(tokenizer, "is_fast", False):
            return None
        encoding = tokenizer(text, return_offsets_mapping=True)
        return TokenizedText(list(encoding["input_ids"]), [tuple(o) for o in encoding["offset_mapping"]])
