"""Loading a pooling model the settings name: the folder (models/loader.py resolves local folders
and hub ids alike), its tokenizer, dtype and device, and the model in row-invariant form: a decoder
of the paged path's families on its model code (models/pooling/paged.py), any other body on
transformers' classes (models/pooling/model.py)."""

from __future__ import annotations

from opentgi.config import Settings
from opentgi.models.loader import ModelLoadError, resolve_device, resolve_dtype, resolve_model_folder
from opentgi.models.pooling.folder import PoolingFolder, PoolingFolderError, detect
from opentgi.models.pooling.model import PoolingModel, load_pooling_model, max_length_of
from opentgi.models.pooling.paged import PagedPoolingModel, load_paged_pooling_model, paged_body_config


def pooling_folder_of(settings: Settings) -> PoolingFolder | None:
    """What the settings' model serves as a pooling model; None for a generation model."""
    if settings.model_id is None or settings.model_id.endswith(".gguf"):
        return None
    try:
        folder, _, _ = resolve_model_folder(settings)
    except ModelLoadError:  # the generation engine's loader says why, in its own words
        return None
    try:
        return detect(folder)
    except PoolingFolderError as exc:
        raise ModelLoadError(str(exc)) from None


def build_pooling_model(folder: PoolingFolder, tokenizer, dtype, device, *, max_input_tokens: int | None = None,
                        batch_invariant: bool = True,
                        trust_remote_code: bool = False) -> PoolingModel | PagedPoolingModel:
    """The model of `folder`: on the paged decoder code where it has the body's family
    (models/pooling/paged.py), else on transformers' classes (models/pooling/model.py)."""
    config = paged_body_config(folder, trust_remote_code)
    if config is None:
        return load_pooling_model(folder, tokenizer, dtype, device, max_input_tokens=max_input_tokens,
                                  batch_invariant=batch_invariant, trust_remote_code=trust_remote_code)
    return load_paged_pooling_model(folder, config, dtype, device, batch_invariant=batch_invariant,
                                    max_length=max_length_of(config, tokenizer, folder, max_input_tokens))


def load_pooling(settings: Settings, folder: PoolingFolder) -> tuple[PoolingModel | PagedPoolingModel, object, str, str | None]:
    """(model, tokenizer, model id, hub commit)."""
    from transformers import AutoTokenizer

    if settings.num_shard > 1 or settings.lora_adapters or settings.quantize or settings.speculate:
        raise ModelLoadError(f"{folder.kind} models are served on one shard, without LoRA adapters, "
                             f"--quantize or --speculate")
    _, model_id, model_sha = resolve_model_folder(settings)
    device = resolve_device(settings)
    dtype = resolve_dtype(settings, device)
    if device.type == "cpu":  # row-invariant forms probed on an earlier start are read back
        from opentgi.models.checkpoints import default_model
        from opentgi.models.layers.linear import kernel_choices

        kernel_choices.attach(default_model.default_cache_dir(settings.cache_dir))
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder.body, trust_remote_code=settings.trust_remote_code)
        model = build_pooling_model(folder, tokenizer, dtype, device, max_input_tokens=settings.max_input_tokens,
                                    batch_invariant=not settings.nondeterministic,
                                    trust_remote_code=settings.trust_remote_code)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load {model_id!r}: {exc}") from None
    return model, tokenizer, model_id, model_sha
