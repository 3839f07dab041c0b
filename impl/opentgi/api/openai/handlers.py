"""The OpenAI-compatible routes of TGI's document: `/v1/chat/completions` (operationId
`chat_completions`) and `/v1/completions` (`completions`), re-exported by `opentgi.api.tgi.handlers`.

Body (checked against openapi/tgi.json by Connexion) -> generated model -> prompt (chat template,
or FIM) -> one engine request per prompt -> OpenAI JSON or SSE. Everything that can be refused is
refused before the response starts, with a 422/429 in TGI's error shape (so SDKs raise their typed
errors, streaming or not); an error while streaming is one error event, then `data: [DONE]`.

SSE framing: `data:{json}` per chunk as TGI's axum server writes it, and the closing line exactly
`data: [DONE]` (huggingface_hub compares that line byte for byte; the openai SDK takes either).
"""

from __future__ import annotations

from opentgi.api.openai.chat import chat_completions
from opentgi.api.openai.completions import completions

__all__ = ["chat_completions", "completions"]
