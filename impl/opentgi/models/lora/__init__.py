"""LoRA adapters on the paged decoder: PEFT checkpoints loaded at start-up, many adapters served
in one batch.

Adapted: q/k/v/o and the dense MLP's gate/up/down of every family, Phi-3's checkpoint-fused
qkv_proj/gate_up_proj, StarCoder2's c_fc/c_proj, a routed-experts block's experts and its router.

- `targets.py`: the PEFT module names accepted and each one's shape in the base model.
- `peft.py`: reading and checking the adapters' folders (`load_adapters`).
- `step.py`: one step's rows and their adapters (`LoraState`, `LoraStep`), shared by every layer.
- `projection.py`: `LoraLinear`, a projection plus its adapters' deltas, batch invariant or stacked.
- `attach.py`: wrapping a model's projections and experts blocks (`attach_lora`), per tensor
  parallel rank.

A step where no row uses an adapter, or a server without adapters, does no LoRA work at all.
"""

from opentgi.models.lora.attach import attach_lora, detach_lora, replace_lora
from opentgi.models.lora.peft import (
    LoraAdapter,
    LoraAdapterError,
    check_fits,
    load_adapters,
    load_peft_adapter,
    parse_adapter_list,
    resolve_adapter_folder,
)
from opentgi.models.lora.projection import LoraLinear, bgmv_delta
from opentgi.models.lora.step import LoraState, LoraStep
from opentgi.models.lora.targets import (
    ACCEPTED_MODULES,
    EXPERT_MODULES,
    GROUPS,
    OTHER_GROUPS,
    ROUTER,
    TARGET_MODULES,
    expert_of,
    module_shapes,
    num_experts,
    shape_key,
)

__all__ = [
    "ACCEPTED_MODULES", "EXPERT_MODULES", "GROUPS", "OTHER_GROUPS", "ROUTER", "TARGET_MODULES", "LoraAdapter",
    "LoraAdapterError", "LoraLinear", "LoraState", "LoraStep", "attach_lora", "bgmv_delta", "check_fits",
    "detach_lora", "replace_lora",
    "expert_of", "load_adapters", "load_peft_adapter", "module_shapes", "num_experts", "parse_adapter_list",
    "resolve_adapter_folder", "shape_key",
]
