"""Pydantic models GENERATED from openapi/ by codegen/ (`python -m codegen`). Never edit by hand.

``opentgi.schemas.<stem>`` holds the models of ``openapi/<stem>.json|yaml``; ``schemas/openapi/`` holds
byte-for-byte copies of the documents, so the installed package can hand them to Connexion.
"""

from pathlib import Path

SPEC_DIR = Path(__file__).resolve().parent / "openapi"


def spec_path(name: str) -> Path:
    """Path of the packaged OpenAPI document ``name`` ("tgi", "tgi.json", "lightllm", ...)."""
    candidates = [SPEC_DIR / name] if Path(name).suffix else [
        SPEC_DIR / f"{name}{suffix}" for suffix in (".json", ".yaml", ".yml")
    ]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    available = sorted(p.name for p in SPEC_DIR.iterdir()) if SPEC_DIR.is_dir() else []
    raise FileNotFoundError(f"no OpenAPI document {name!r} in {SPEC_DIR} (have: {', '.join(available)})")
