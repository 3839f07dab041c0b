"""The one settings object.

Built once by the CLI (`opentgi.cli`) from flags and environment variables and passed down; no module
reads the environment on its own. Every field has the launcher's default; `None` means "derive it
from the model / device at start-up" (the engine writes back what it derived, see `EngineInfo`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

KV_CACHE_DTYPES = ("auto", "float16", "bfloat16", "float32")  # --kv-cache-dtype


@dataclass
class Settings:
    # --- model -------------------------------------------------------------------------------
    model_id: str | None = None  # hub id, local folder or .gguf file; None = the default model
    revision: str | None = None
    dtype: str | None = None  # "float32" | "float16" | "bfloat16"; None = bf16 on CUDA and on
    # CPUs with avx512_bf16/AMX, else float32 (models/loader.py resolve_dtype)
    device: str | None = None  # "cpu" | "cuda" | "cuda:N"; None = cuda when available
    num_threads: int | None = None  # torch.set_num_threads on CPU; None = torch's default
    fixed_threads: bool = False  # every step on num_threads, even while other work holds cores
    # (default: fewer while it does, engine/execution/thread_governor.py)
    trust_remote_code: bool = False
    lora_adapters: str | None = None  # comma-separated adapter ids / folders / name=path (PEFT LoRA)
    quantize: str | None = None  # int8 | int4[-g64|-g128] | fp8 | awq | gptq | eetq (models/quantization/methods.py)
    dequantize: bool = False  # a GGUF's 4-bit layers served dense in the serving dtype
    kernels: str = "auto"  # auto | native | torch: the matmul path of GGUF blocks on CPU (opentgi.kernels)
    # auto | float16 | bfloat16 | float32: the paged KV cache's dtype; auto = float16 where the model
    # computes in float32 on CPU, else the model's (engine/execution/kv_cache.py kv_cache_dtype)
    kv_cache_dtype: str = "auto"

    # --- sharding (tensor parallelism, engine/execution/shards.py) -----------------------------------------
    num_shard: int = 1  # ranks in the tensor-parallel group
    shard_rank: int | None = None  # set (RANK) when the ranks are started externally (env://)
    local_rank: int = 0  # this rank's device index on its machine (cuda:<local_rank>)
    master_addr: str = "127.0.0.1"  # the rendezvous store (held by rank 0)
    master_port: int | None = None  # None: a free port locally, 29500 when started externally

    # --- server ------------------------------------------------------------------------------
    hostname: str = "0.0.0.0"
    port: int = 8080
    json_output: bool = False
    api: str = "tgi"  # which dialect owns the root paths: "tgi" | "lightllm"
    api_key: str | None = None  # bearer token required on every non-health route when set
    otlp_endpoint: str | None = None  # OTLP/HTTP collector for request traces; None = no tracing
    otlp_service_name: str = "text-generation-inference.router"  # TGI's default service name
    disable_ui: bool = False  # no chat page at GET /
    payload_limit: int = 2_000_000  # request body bytes at most (TGI's --payload-limit); past it: 413
    shutdown_timeout: float = 30.0  # seconds in-flight requests may finish in after SIGTERM

    # --- TGI router limits ---------------------------------------------------------------------
    max_concurrent_requests: int = 128
    max_best_of: int = 2
    max_stop_sequences: int = 4
    max_top_n_tokens: int = 5
    max_input_tokens: int | None = None  # None = min(model context - 1, 4095)
    max_total_tokens: int | None = None  # None = min(model context, 4096)
    max_client_batch_size: int = 4
    disable_grammar_support: bool = False
    watermark_gamma: float = 0.5
    watermark_delta: float = 2.0

    # --- scheduler -----------------------------------------------------------------------------
    max_batch_prefill_tokens: int | None = None  # None = max_input_tokens + 50 (TGI's default)
    max_batch_total_tokens: int | None = None  # KV pool size in tokens; None = from memory budget
    max_batch_size: int | None = None  # running sequences at most; None = unbounded
    max_waiting_tokens: int = 20
    waiting_served_ratio: float = 1.2
    chunked_prefill_tokens: int | None = 512  # per-step token budget for prefill chunks; None = off
    enable_prefix_caching: bool = True
    block_size: int | None = None  # None = the attention backend's preference (16 CPU, 256 flash-attn)
    cuda_memory_fraction: float = 1.0  # CUDA: fraction of the device's memory the server may use
    kv_cache_cpu_bytes: int = 2 << 30  # CPU: KV pool budget when max_batch_total_tokens is unset
    kv_cache_cpu_prefix_bytes: int = 128 << 20  # CPU: how far cached prefixes may grow the resident pool
    speculate: int | None = None  # n-gram drafts verified per decode step (TGI's --speculate); None/0 = off
    # False (default): batch-invariant numerics, a request's tokens and logprobs do not depend on
    # the rest of the batch nor on how its prompt was split (docs/determinism.md)
    nondeterministic: bool = False

    # --- dialect extras ------------------------------------------------------------------------
    fim_template: str | None = None  # e.g. "<fim_prefix>{prefix}<fim_suffix>{suffix}<fim_middle>"
    sensitive_words_file: str | None = None  # SenseNova: one term a line
    sensitive_words: list[str] = field(default_factory=list)
    responses_store_size: int = 1000  # OpenAI Responses: stored responses at most (LRU); 0 stores none
    cache_dir: str | None = None  # what start-up builds once (a GGUF's tokenizer, packed layers); None = ~/.cache/opentgi

    # --- chat turns (api/chat/) --------------------------------------------------------------
    chat_template_kwargs: dict | None = None  # default template variables, e.g. {"enable_thinking": false}
    reasoning_budget: int | None = None  # thinking tokens at most before `</think>` is forced; None = no limit
    tool_call_parser: str | None = None  # hermes | mistral | llama3_json | none; None = from the template
    cors_allow_origin: str | None = None  # comma-separated origins allowed by CORS; None = any (TGI's default)
    api_key_file: str | None = None  # API keys, one a line (beside api_key, which may list several, comma-separated)
    api_keys: list[str] = field(default_factory=list)  # the keys read from api_key_file
    tenants_file: str | None = None  # --tenants: tenants with keys, weights, quotas (api/tenants/table.py)

    # --- images in (api/images.py) --------------------------------------------------------------
    max_image_bytes: int = 20_000_000  # one image's encoded bytes at most (fetched or data: URL)
    max_images: int = 16  # images per request at most; more: 422
    max_image_pixels: int = 40_000_000  # width x height at most, read from the header before decoding
    image_fetch_timeout: float = 10.0  # seconds for one http(s) image, redirects included
    allow_private_image_urls: bool = False  # fetch from loopback, private, link-local and metadata addresses
