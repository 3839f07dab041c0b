"""TGI 3.x's `POST /chat_tokenize` (a chat request rendered by the template and tokenized, as the
chat route would) and `POST /detokenize` (vLLM's shape: token ids -> text; TGI has none)."""

from __future__ import annotations

from starlette.responses import JSONResponse, Response

from opentgi.api import runtime
from opentgi.api.chat import prepare_chat_turn
from opentgi.api.errors import tgi_error
from opentgi.api.openai import common
from opentgi.api.openai.params import response_format_grammar
from opentgi.api.tgi import shapes as encode
from opentgi.engine.errors import OpenTGIError, ValidationError
from opentgi.schemas.tgi import ChatRequest, DetokenizeRequest

NO_FAST_TOKENIZER = {"error": "No fast tokenizer or tokenizer.json for this model", "error_type": "no fast tokenizer"}


async def get_chat_tokenize(body: dict) -> Response:
    from opentgi.api.openai.chat import chat_turn

    state = runtime.state()
    engine = state.engine
    try:
        limits = common.limits_of(state)
        req = common.parse_model(ChatRequest, body)
        turn = chat_turn(body, req)
        prepared = await prepare_chat_turn(engine, turn, settings=state.settings,
                                           max_input_tokens=limits.max_input_tokens,
                                           format_grammar=response_format_grammar(turn.response_format, limits))
    except OpenTGIError as exc:
        return tgi_error(exc).response()
    text = prepared.prompt_text
    tokenized = await engine.tokenize(text)
    if tokenized is None:
        return JSONResponse(NO_FAST_TOKENIZER, status_code=404)
    return JSONResponse({"tokenize_response": encode.tokenize_response(text, tokenized.ids, tokenized.offsets),
                         "templated_text": text})


async def detokenize(body: dict) -> Response:
    engine = runtime.engine()
    try:
        req = common.parse_model(DetokenizeRequest, body)
        tokens = [int(t) for t in body["tokens"]]  # the model wraps each id (a bounded integer)
        vocab = engine.info.vocab_size
        limit = engine.info.max_batch_total_tokens
        if len(tokens) > limit:
            raise ValidationError(f"`tokens` holds {len(tokens)} ids; at most {limit} are allowed")
        bad = next((t for t in tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValidationError(f"token id {bad} is outside the vocabulary (0..{vocab - 1})")
    except OpenTGIError as exc:
        return tgi_error(exc).response()
    return JSONResponse({"prompt": engine.decode(tokens, skip_special_tokens=bool(req.skip_special_tokens))})
