"""The admin routes of openapi/tenants.yaml (the auth middleware lets only an admin tenant's key
through): `GET /v1/usage`, per-tenant totals; `POST /v1/load_lora_adapter` and
`/v1/unload_lora_adapter`, LoRA adapters at run time as vLLM serves them (engine/adapter_loading.py)."""

from __future__ import annotations

from starlette.responses import JSONResponse, PlainTextResponse, Response

from opentgi.api import runtime
from opentgi.api.errors import StatusError, tgi_error
from opentgi.api.tenants.ledger import WINDOW_S
from opentgi.engine.errors import AdapterError, AdapterInUseError
from opentgi.schemas import tenants as schema


async def usage() -> JSONResponse:
    ledger = runtime.state().tenants
    rows = ledger.snapshot() if ledger is not None else {}
    report = schema.UsageReport(window_seconds=int(WINDOW_S),
                                tenants=[schema.TenantUsage(name=name, **row) for name, row in rows.items()])
    return JSONResponse(report.model_dump(mode="json"))


async def load_lora_adapter(body: dict) -> Response:
    request = schema.LoadLoraAdapterRequest.model_validate(body)
    try:
        await runtime.engine().load_adapter(request.lora_name, request.lora_path)
    except AdapterError as exc:
        return tgi_error(StatusError(400, exc.message)).response()
    return PlainTextResponse(f"Success: LoRA adapter '{request.lora_name}' added successfully.")


async def unload_lora_adapter(body: dict) -> Response:
    request = schema.UnloadLoraAdapterRequest.model_validate(body)
    engine = runtime.engine()
    if request.lora_name not in engine.info.adapters:
        return tgi_error(StatusError(404, f"adapter {request.lora_name!r} is not loaded")).response()
    try:
        await engine.unload_adapter(request.lora_name)
    except AdapterInUseError as exc:
        return tgi_error(StatusError(409, exc.message)).response()
    except AdapterError as exc:
        return tgi_error(StatusError(400, exc.message)).response()
    return PlainTextResponse(f"Success: LoRA adapter '{request.lora_name}' removed successfully.")
