"""LoRA adapters loaded and unloaded while serving (vLLM's `/v1/load_lora_adapter` and
`/v1/unload_lora_adapter`).

The adapter's folder is read and checked off the engine thread, as at start-up (models/lora/peft.py);
the model's LoRA is then rebuilt on the engine thread between two steps (`replace_lora`), with the
adapters given at start first, so a loaded adapter is served exactly as one given at start in the
same position. Requests name adapters by name, so the slots renumbered by a rebuild change nothing
for them. Unloading refuses (AdapterInUseError) while a request in flight or queued uses the
adapter; the engine thread, which sees every request, decides. Served on the paged path with one
shard only.
"""

from __future__ import annotations

import asyncio
import logging

from opentgi.engine.errors import AdapterError, AdapterInUseError

log = logging.getLogger(__name__)


def _check_served(engine) -> None:
    if engine.runner.kind != "paged":
        raise AdapterError("LoRA adapters are served on the paged path only")
    if engine.settings.num_shard > 1:
        raise AdapterError("LoRA adapters cannot be loaded at run time with --num-shard > 1; give them at start "
                           "(--lora-adapters)")


async def load_adapter(engine, name: str, path: str) -> None:
    """Reads and checks the adapter at `path`, then serves it as `name` (AdapterError otherwise)."""
    from opentgi.models.lora import LoraAdapterError, check_fits, load_peft_adapter, resolve_adapter_folder

    _check_served(engine)
    info = engine.info
    if name == info.model_id:
        raise AdapterError(f"adapter name {name!r} is the base model's id, which selects the base model")
    if name in info.adapters:
        raise AdapterError(f"an adapter named {name!r} is already loaded")

    def read():
        adapter = load_peft_adapter(name, resolve_adapter_folder(name, path))
        check_fits(adapter, engine.loaded.hf_config, info.model_id)
        return adapter

    try:
        adapter = await asyncio.to_thread(read)
    except LoraAdapterError as exc:
        raise AdapterError(str(exc)) from None
    model = engine.runner.model

    def swap():
        current = list(getattr(model, "lora_adapters", None) or [])
        if any(a.name == name for a in current):
            raise AdapterError(f"an adapter named {name!r} is already loaded")
        _serve(engine, model, [*current, adapter])

    await asyncio.wrap_future(engine.core.call_between_steps(swap))
    info.adapters.append(name)
    log.info("LoRA adapter %r loaded at run time: rank %d, %s", name, adapter.rank, "/".join(adapter.target_modules))


async def unload_adapter(engine, name: str) -> None:
    """Stops serving `name`: AdapterError when it is not loaded, AdapterInUseError while requests use it."""
    _check_served(engine)
    if name not in engine.info.adapters:
        raise AdapterError(f"adapter {name!r} is not loaded")
    model = engine.runner.model
    core = engine.core

    def swap():
        users = [s for s in [*core.requests.values(), *core._inbox] if s.request.adapter_id == name and not s.done]
        if users:
            raise AdapterInUseError(f"adapter {name!r} is in use by {len(users)} requests in flight; unload it "
                                    "once they are done")
        _serve(engine, model, [a for a in getattr(model, "lora_adapters", None) or [] if a.name != name])

    adapters = engine.info.adapters
    position = adapters.index(name)
    adapters.remove(name)  # refused from now on (`submit` checks again after a grammar compiles)
    try:
        await asyncio.wrap_future(core.call_between_steps(swap))
    except BaseException:
        adapters.insert(position, name)
        raise
    log.info("LoRA adapter %r unloaded", name)


def _serve(engine, model, adapters) -> None:
    """On the engine thread: rebuild the model's LoRA for `adapters` and point the runner at it."""
    from opentgi.models.lora import replace_lora

    engine.runner.lora = replace_lora(model, adapters)
