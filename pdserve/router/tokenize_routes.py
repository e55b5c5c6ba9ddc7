"""vLLM's tokenizer endpoints and /version, served at the root beside /v1 as vLLM serves them,
and behind the API key like /v1 (app.py):

    POST /tokenize    {"prompt": text} | {"messages": [...]}  (+ add_special_tokens,
                      add_generation_prompt, continue_final_message, return_token_strs)
                      -> {"count", "max_model_len", "tokens", "token_strs"}
    POST /detokenize  {"tokens": [ids]} -> {"prompt": text}
    GET  /version     -> {"version": pdserve's version}

A chat body is rendered by the same template path as /v1/chat/completions, so /tokenize
returns exactly the prompt a chat request would send (add_special_tokens defaults to false
there, as the template writes its own; true for a text prompt). An unknown model is a 404,
token ids outside the vocabulary a 400.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, model_validator

import pdserve
from pdserve.router.errors import ApiError
from pdserve.router.openai_protocol import ChatMessage, TokenId, check_unicode
from pdserve.router.routes import Serving, _chat_prompt_ids, _check_model, _max_model_len

tokenize_routes = APIRouter()


class TokenizerBody(BaseModel):
    """Fields every body here takes; unknown ones are ignored, as on /v1."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, body: Any) -> Any:
        return check_unicode(body)


class TokenizeCompletionRequest(TokenizerBody):
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(TokenizerBody):
    messages: list[ChatMessage]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool | None = False

    @model_validator(mode="after")
    def _one_ending(self) -> TokenizeChatRequest:
        if not self.messages:
            raise ValueError("messages must not be empty")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both "
                             "be true")
        return self


class DetokenizeRequest(TokenizerBody):
    tokens: list[TokenId]


@tokenize_routes.post("/tokenize")
async def tokenize(body: TokenizeCompletionRequest | TokenizeChatRequest, serving: Serving
                   ) -> dict[str, Any]:
    _check_model(serving.model, body.model)
    tokenizer = serving.model.tokenizer
    if isinstance(body, TokenizeChatRequest):
        ids = await serving.off_loop(_chat_prompt_ids, tokenizer, body, None,
                                     body.add_special_tokens)
    else:
        ids = await serving.off_loop(
            lambda: tokenizer(body.prompt, add_special_tokens=body.add_special_tokens).input_ids)
    token_strs = tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
    return {"count": len(ids), "max_model_len": _max_model_len(serving), "tokens": ids,
            "token_strs": token_strs}


@tokenize_routes.post("/detokenize")
async def detokenize(body: DetokenizeRequest, serving: Serving) -> dict[str, str]:
    _check_model(serving.model, body.model)
    vocab_size = serving.model.vocab_size
    bad = [t for t in body.tokens if t >= vocab_size]
    if bad:
        raise ApiError(400, f"token id(s) {bad[:8]} are out of the vocabulary "
                       f"[0, {vocab_size})", "tokens")
    try:
        text = await serving.off_loop(serving.model.tokenizer.decode, body.tokens)
    except Exception as exc:  # e.g. an id the model has but its tokenizer does not
        raise ApiError(400, f"cannot detokenize: {exc}", "tokens") from None
    return {"prompt": text}


@tokenize_routes.get("/version")
async def version() -> dict[str, str]:
    return {"version": pdserve.__version__}
