"""One step's adapters: which rows use which adapter, shared by every LoRA layer of the model.

`LoraState` holds the loaded adapters' slots; the model runner begins each step with the rows'
adapters (`begin_step`, or `begin_step_slots` on a tensor-parallel rank) and every `LoraLinear`
and experts block reads the step's `LoraStep`: the slots it uses, the rows of each, and the masks
of the stacked (`--nondeterministic`) form. A step whose rows use no adapter has no `LoraStep`.
"""

from __future__ import annotations

import torch


class LoraStep:
    """One step's adapter assignment: the slots it uses and, per token, the mask of its slot."""

    def __init__(self, token_slots: torch.Tensor, used_slots: list[int], num_slots: int, rank: int, dtype,
                 one_slot: bool = False):
        self.token_slots = token_slots
        self.all_slots = len(used_slots) == num_slots
        self.num_used = len(used_slots)
        self.used = torch.tensor(used_slots, device=token_slots.device)
        self.used_key = tuple(used_slots)
        self.one_slot = one_slot  # every token of the step uses the one adapter used
        self.rank, self.dtype = rank, dtype
        self._slot_mask: torch.Tensor | None = None
        self._masks: dict[int, torch.Tensor] = {}
        self._token_masks: dict[int, torch.Tensor] = {}
        self._rows: dict[int, torch.Tensor | None] = {}
        self._adapter_tokens: torch.Tensor | None = None

    def rows_of(self, slot: int) -> torch.Tensor | None:
        """The indices of the tokens of adapter `slot`; None when every token of the step is one."""
        if self.one_slot:
            return None
        found = self._rows.get(slot)
        if found is None:
            found = self._rows[slot] = (self.token_slots == slot).nonzero().squeeze(1)
        return found

    def token_mask(self, slot: int) -> torch.Tensor:
        """[T, 1] float32: 1 for the tokens of adapter `slot` (the experts' LoRA,
        models/layers/expert_lora.py)."""
        found = self._token_masks.get(slot)
        if found is None:
            found = self._token_masks[slot] = (self.token_slots == slot).float().unsqueeze(1)
        return found

    def adapter_tokens(self) -> torch.Tensor:
        """[T] bool: the tokens whose row uses an adapter."""
        if self._adapter_tokens is None:
            self._adapter_tokens = self.token_slots >= 0
        return self._adapter_tokens

    def mask(self, parts: int) -> torch.Tensor:
        """[T, parts*used*R], columns (part, slot, r): 1 where the slot is the token's adapter."""
        found = self._masks.get(parts)
        if found is None:
            if self._slot_mask is None:
                onehot = (self.token_slots.unsqueeze(1) == self.used.unsqueeze(0)).to(self.dtype)  # [T, used]
                self._slot_mask = onehot.repeat_interleave(self.rank, dim=1)  # [T, used*R]: columns (slot, r)
            found = self._masks[parts] = self._slot_mask.repeat(1, parts)
        return found


class LoraState:
    """Shared by every LoraLinear of a model: the adapters' slots and the current step."""

    def __init__(self, names: list[str], rank: int, dtype: torch.dtype, device: torch.device):
        self.names = names
        self.slot_of = {name: i for i, name in enumerate(names)}
        self.rank = rank
        self.dtype = dtype
        self.device = device
        self.step: LoraStep | None = None

    def slots_of(self, adapter_ids: list[str | None]) -> list[int]:
        """Rows' adapters (None = base) -> their slots (-1 = base)."""
        return [-1 if a is None else self.slot_of[a] for a in adapter_ids]

    def begin_step(self, adapter_ids: list[str | None], num_new_tokens: list[int]) -> None:
        """Rows' adapters (None = base) and token counts, in the varlen order of the step."""
        self.begin_step_slots(self.slots_of(adapter_ids), num_new_tokens)

    def begin_step_slots(self, slots: list[int], num_new_tokens: list[int]) -> None:
        """As `begin_step`, the rows' adapters given by slot (-1 = base): how a tensor-parallel
        rank gets them from the driver."""
        used = sorted({s for s in slots if s >= 0})
        if not used:
            self.step = None
            return
        token_slots = torch.repeat_interleave(torch.tensor(slots, dtype=torch.int64),
                                              torch.tensor(num_new_tokens, dtype=torch.int64)).to(self.device)
        self.step = LoraStep(token_slots, used, len(self.names), self.rank, self.dtype,
                             one_slot=len(set(slots)) == 1)

    def end_step(self) -> None:
        self.step = None
