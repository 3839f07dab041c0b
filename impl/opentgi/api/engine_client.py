"""The engine as the API sees it: one typed protocol every handler codes against.

`opentgi.engine.engine.Engine` implements it; the tests' fake engines implement the same methods.
The API never reaches past it (no tokenizer, no scheduler): text in and out, the chat template,
submitting requests, health, live stats and the static facts of `info`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:  # the API imports without torch: these are only types
    from opentgi.engine.handle import RequestHandle
    from opentgi.engine.info import ChatTemplate, EngineInfo, EngineStats, TokenizedText
    from opentgi.engine.request import GenerationRequest


@runtime_checkable
class EngineClient(Protocol):
    info: EngineInfo

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    # --- text ------------------------------------------------------------------------------------
    async def encode(self, text: str, add_special_tokens: bool = True, max_tokens: int | None = None) -> list[int]:
        """Token ids; with `max_tokens`, a text that cannot fit is refused (InputTooLongError) before
        the tokenizer runs."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str: ...

    async def tokenize(self, text: str) -> TokenizedText | None: ...

    async def encode_fim(self, prefix: str, suffix: str, fim_template: str | None = None) -> list[int]: ...

    def chat_template(self) -> ChatTemplate: ...

    # --- generation ------------------------------------------------------------------------------
    async def submit(self, request: GenerationRequest) -> RequestHandle: ...

    # --- LoRA adapters at run time --------------------------------------------------------------
    async def load_adapter(self, name: str, path: str) -> None:
        """Serve the adapter at `path` as `name` (AdapterError: refused, the server keeps serving)."""

    async def unload_adapter(self, name: str) -> None:
        """Stop serving `name` (AdapterInUseError while requests use it)."""

    # --- health and load -------------------------------------------------------------------------
    def healthy(self) -> bool: ...

    async def probe(self) -> bool: ...

    def stats(self) -> EngineStats: ...
