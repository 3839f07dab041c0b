"""Validate every OpenAPI document in openapi/ with openapi-spec-validator.

Usage: ``python -m codegen.validate [FILE ...]`` (or ``python -m codegen --validate``) (default: every document in openapi/).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: python codegen/validate.py
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from openapi_spec_validator import validate
from openapi_spec_validator.validation.exceptions import OpenAPIValidationError

from codegen.generate import REPO_ROOT, find_documents


def load_document(path: Path) -> dict:
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        return json.loads(text)
    import yaml

    return yaml.safe_load(text)


def validation_errors(path: Path) -> list[str]:
    try:
        validate(load_document(path))
    except OpenAPIValidationError as exc:
        return [f"{path.name}: {exc.message} (at {'/'.join(map(str, exc.absolute_path))})"]
    return []


def _display(path: Path) -> str:
    resolved = path.resolve()
    return resolved.relative_to(REPO_ROOT).as_posix() if resolved.is_relative_to(REPO_ROOT) else str(path)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    paths = [Path(a) for a in argv] or [d.path for d in find_documents()]
    errors = [e for p in paths for e in validation_errors(p)]
    for error in errors:
        print(f"codegen.validate: {error}", file=sys.stderr)
    if not errors:
        names = ", ".join(_display(p) for p in paths)
        print(f"codegen.validate: OK ({names})")
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
