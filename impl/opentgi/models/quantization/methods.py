"""`--quantize`: the names taken (TGI's where the meaning matches), and what each asks for.

- `int8`, and TGI's `eetq` (which is int8 weight-only, per channel): round-to-nearest at load time.
- `int4` (groups of 32, as GGUF's Q4_0), `int4-g64`, `int4-g128`: round-to-nearest at load time.
- `fp8` (TGI's name): FP8 e4m3 weights, per channel, on GPUs with FP8 (compute capability 8.9+).
- `awq`, `gptq` (TGI's names): the checkpoint is AWQ / GPTQ 4-bit (its config.json says so; such
  a checkpoint is read as it is even without the flag).

TGI's other methods compute something else and are refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass

_REFUSED = {
    "bitsandbytes": "LLM.int8() keeps outlier columns in 16 bits; use --quantize int8 (weight-only, per channel)",
    "bitsandbytes-nf4": "NF4 is a non-uniform 4-bit code; use --quantize int4",
    "bitsandbytes-fp4": "FP4 is a non-uniform 4-bit code; use --quantize int4",
    "exl2": "EXL2 checkpoints are not read",
    "marlin": "Marlin is a GPTQ kernel layout; pass the GPTQ checkpoint (served through the int4 path)",
}


class QuantizeError(ValueError):
    """A `--quantize` value that is not served; the message says what to use instead."""


@dataclass(frozen=True)
class Quantize:
    method: str  # "int8" | "int4" | "fp8" | "awq" | "gptq"
    group_size: int = 32  # int4 only

    @property
    def at_load(self) -> bool:
        """True where float weights are quantized while loading (not a quantized checkpoint)."""
        return self.method in ("int8", "int4", "fp8")


def parse_quantize(name: str | None) -> Quantize | None:
    if name is None or name == "":
        return None
    key = name.strip().lower()
    if key in ("int8", "eetq"):
        return Quantize("int8")
    if key in ("int4", "int4-g32"):
        return Quantize("int4", 32)
    if key in ("int4-g64", "int4-g128"):
        return Quantize("int4", int(key.rsplit("g", 1)[1]))
    if key in ("fp8", "awq", "gptq"):
        return Quantize(key)
    if key in _REFUSED:
        raise QuantizeError(f"--quantize {key} is not supported: {_REFUSED[key]}")
    raise QuantizeError(f"--quantize {name!r} is unknown; use int8, int4, int4-g64, int4-g128, fp8, "
                        f"awq, gptq or eetq")
