"""Request and response bodies of the OpenAI-compatible API (pydantic v2).

Requests are parsed strictly: a wrong JSON type is an error (no "5" -> 5 coercion), NaN and
infinities are rejected, and an unknown field is an error ("Unrecognized request argument",
as OpenAI does) so that a client never silently loses an option it relies on. Value limits
that depend on the model (max_tokens against the context, token ids against the vocabulary,
temperature/top_p ranges) are checked by the engine's ``Server.submit`` and mapped to 400s.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from .errors import bad_request

# Completions' max_tokens default is OpenAI's (16). Chat has no fixed default in OpenAI (the rest
# of the context); with Orca's reservation of len(prompt) + max_tokens KV slots per request that
# would tie up the whole cache, so chat defaults to a bounded number, set by the server.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


class _Strict(BaseModel):
    # null is accepted wherever a field is optional, as OpenAI does.
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool | None = False


class _SamplingFields(_Strict):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: Any = None
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # Extensions (vLLM's names): top_k = 0 (or -1) disables top-k; ignore_eos keeps generating
    # past the end-of-sequence token; stop_token_ids end the request on any of these ids.
    top_k: int | None = None
    ignore_eos: bool | None = False
    stop_token_ids: list[int] | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, v: Any) -> tuple[str, ...]:
        if v is None:
            return ()
        if isinstance(v, str):
            return (v,)
        if isinstance(v, list) and all(isinstance(s, str) for s in v):
            return tuple(v)
        raise ValueError("stop must be a string or a list of strings")

    def check_unsupported(self) -> None:
        """400 for options the engine does not implement, naming the field."""
        if self.n is not None and self.n != 1:
            raise bad_request(f"n must be 1 (got {self.n}): one choice per request is supported", "n")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true", "stream_options")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if value not in (None, 0.0):
                raise bad_request(f"{name} is not supported (only 0)", name)
        if self.logit_bias:
            raise bad_request("logit_bias is not supported", "logit_bias")

    def sampling_kwargs(self, max_tokens: int) -> dict[str, Any]:
        """Keyword arguments for orca_ext.SamplingParams."""
        top_k = self.top_k if self.top_k is not None else 0
        if top_k == -1:  # vLLM's spelling of "disabled"
            top_k = 0
        return dict(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=top_k,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=bool(self.ignore_eos),
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def field_names(self) -> dict[str, str]:
        """Engine field name -> this request's field name, where they differ (errors.py reports
        the engine's rejections under the client's names). Completions use the engine's names."""
        return {}


class CompletionRequest(_SamplingFields):
    prompt: Any
    logprobs: int | None = None
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, v: Any) -> str | list[int]:
        def is_ids(x: Any) -> bool:
            # bool is an int subclass in Python; true/false are not token ids.
            return isinstance(x, list) and all(type(t) is int for t in x)

        if isinstance(v, str) or is_ids(v):
            return v
        # OpenAI also takes a batch: a list of strings or of token-id lists. One is fine.
        if isinstance(v, list) and v and all(isinstance(p, str) or (p and is_ids(p)) for p in v):
            if len(v) == 1:
                return v[0]
            raise ValueError(f"prompt: a batch of {len(v)} prompts is not supported; send one prompt per request")
        raise ValueError("prompt must be a string or a list of token ids")

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.logprobs is not None:
            raise bad_request("logprobs are not supported by this server", "logprobs")
        if self.echo:
            raise bad_request("echo is not supported", "echo")
        if self.best_of not in (None, 1):
            raise bad_request(f"best_of must be 1 (got {self.best_of})", "best_of")
        if self.suffix:
            raise bad_request("suffix is not supported", "suffix")


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: Any = None
    name: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, v: Any) -> str:
        # A string, or OpenAI's list of content parts of which we support the text kind.
        if v is None:
            return ""
        if isinstance(v, str):
            return v
        if isinstance(v, list):
            texts = []
            for part in v:
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise ValueError('content parts must be {"type": "text", "text": "..."} (only text is supported)')
                texts.append(part["text"])
            return "".join(texts)
        raise ValueError("content must be a string or a list of text parts")


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.logprobs:
            raise bad_request("logprobs are not supported by this server", "logprobs")
        if self.top_logprobs is not None:
            raise bad_request("top_logprobs is not supported by this server", "top_logprobs")
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise bad_request("give max_completion_tokens or max_tokens, not two different values",
                              "max_completion_tokens")

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def max_tokens_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    @property
    def field_names(self) -> dict[str, str]:
        # The engine's prompt is the rendered messages; its max_tokens is whichever of the two
        # spellings the client sent.
        return {"prompt": "messages", "max_tokens": self.max_tokens_field}

    def message_dicts(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.content} for m in self.messages]


# ---------------------------------------------------------------------------------------------
# Responses. Plain dict builders: the shapes are OpenAI's, and the openai client parses them.
# ---------------------------------------------------------------------------------------------

def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage block; cached_tokens: prompt tokens served from the prefix cache."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def completion_body(rid: str, created: int, model: str, text: str, finish_reason: str | None,
                    usage_: dict | None, *, chunk: bool) -> dict:
    body = {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
    }
    if usage_ is not None or not chunk:
        body["usage"] = usage_
    return body


def chat_body(rid: str, created: int, model: str, text: str, finish_reason: str | None,
              usage_: dict | None) -> dict:
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": finish_reason,
        }],
        "usage": usage_,
    }


def chat_chunk(rid: str, created: int, model: str, delta: dict | None, finish_reason: str | None,
               usage_: dict | None = None, *, with_usage_field: bool = False) -> dict:
    """One chat.completion.chunk; delta None gives the usage-only chunk (empty choices)."""
    body: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
    body["choices"] = [] if delta is None else [
        {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    ]
    if with_usage_field:
        body["usage"] = usage_
    return body


def model_card(model_name: str, created: int, max_model_len: int | None, vocab_size: int | None) -> dict:
    card: dict[str, Any] = {"id": model_name, "object": "model", "created": created, "owned_by": "orca_ext"}
    # Extensions (vLLM reports max_model_len too); the serving benchmark reads vocab_size.
    if max_model_len is not None:
        card["max_model_len"] = max_model_len
    if vocab_size is not None:
        card["vocab_size"] = vocab_size
    return card


def now() -> int:
    return int(time.time())
