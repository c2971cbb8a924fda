"""Request and response bodies of the OpenAI-compatible API (pydantic v2).

Requests are parsed strictly: a wrong JSON type is an error (no "5" -> 5 coercion), NaN and
infinities are rejected, and an unknown field is an error ("Unrecognized request argument",
as OpenAI does) so that a client never silently loses an option it relies on. Value limits
that depend on the model (max_tokens against the context, token ids against the vocabulary,
temperature/top_p ranges) are checked by the engine's ``Server.submit`` and mapped to 400s.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Annotated, Any, Callable, Literal

import pydantic_core
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ..guided import GuidedSpec, choice_spec, json_object_spec, json_schema_spec, regex_spec
from ..errors import InvalidRequestError
from ..guided.tools import MAX_TOOLS, check_tools, tool_call_spec
from ..sampling_params import MAX_LOGPROBS
from .errors import bad_request

# Completions' max_tokens default is OpenAI's (16). Chat has no fixed default in OpenAI (the rest
# of the context); with Orca's reservation of len(prompt) + max_tokens KV slots per request that
# would tie up the whole cache, so chat defaults to a bounded number, set by the server.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


@dataclass(frozen=True)
class ParseBounds:
    """The server's bounds on a body's lists that are checked before the body is validated.
    `check_message_count(n)` raises InvalidRequestError when n chat messages cannot fit (None:
    no bound)."""
    check_message_count: Callable[[int], None] | None = None


def parse_request(model_cls: type[BaseModel], raw: bytes, bounds: ParseBounds) -> BaseModel:
    """The body as model_cls, its lists counted first: pydantic validates a chat message in ~7 us
    of the event loop, so 30,000 one-character messages held it ~0.2 s for a request refused
    anyway; parsing the JSON alone to count them takes ~17 ms. InvalidRequestError for a list
    past its bound, ValidationError for anything else wrong."""
    if bounds.check_message_count is not None and "messages" in model_cls.model_fields:
        try:
            data = pydantic_core.from_json(raw)
        except ValueError:
            data = None  # malformed: pydantic's validation below says how, in its own words
        if isinstance(data, dict) and isinstance(data.get("messages"), list):
            bounds.check_message_count(len(data["messages"]))
    return model_cls.model_validate_json(raw)


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
    # Extensions (vLLM's names): repetition_penalty (1 = off), min_tokens (stop tokens are masked
    # until this many tokens were generated).
    repetition_penalty: float | None = None
    min_tokens: int | None = None

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
        if self.n is not None and not 1 <= self.n <= MAX_SEQUENCES:
            raise bad_request(f"n must be an integer in [1, {MAX_SEQUENCES}], got {self.n}", "n")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true", "stream_options")

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
    def num_prompts(self) -> int:
        """Prompts in this request (a completions batch has several); each counts as one request
        against the server's --max-queue."""
        return 1

    @property
    def num_sequences(self) -> int:
        """Sequences generated for each prompt: n (best_of when larger)."""
        return self.n or 1

    @property
    def ranks_sequences(self) -> bool:
        """Whether more sequences are generated than returned (best_of > n)."""
        return False

    def logits_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for orca_ext.SamplingParams: penalties, logit_bias, min_tokens and
        logprobs (SamplingParams checks their ranges)."""
        kwargs: dict[str, Any] = dict(
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            min_tokens=self.min_tokens or 0,
            logit_bias=logit_bias_ids(self.logit_bias),
        )
        kwargs.update(self.logprobs_kwargs())
        return kwargs

    def logprobs_kwargs(self) -> dict[str, Any]:
        return {}

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def field_names(self) -> dict[str, str]:
        """Engine field name -> this request's field name, where they differ (errors.py reports
        the engine's rejections under the client's names). Completions use the engine's names."""
        return {}


# Completions' logprobs limit (OpenAI's); chat allows sampling_params.MAX_LOGPROBS (20).
MAX_COMPLETION_LOGPROBS = 5
MAX_LOGIT_BIAS_KEY_CHARS = 20
# n and best_of: sequences per request. Each is a request of its own in the engine (sharing one
# prefill), so this bounds how much of the batch one HTTP request can take.
MAX_SEQUENCES = 16
# A completions batch (several prompts, each with its n / best_of sequences) is at most this many
# engine requests; its prompts also count one each against the server's --max-queue.
MAX_REQUEST_SEQUENCES = 256


def logit_bias_ids(bias: dict[str, float] | None) -> dict[int, float]:
    """logit_bias with its JSON string keys as token ids; a key that is not an integer is a 400."""
    if not bias:
        return {}
    out = {}
    for key, value in bias.items():
        text = key.strip()
        if len(text) > MAX_LOGIT_BIAS_KEY_CHARS or not text.lstrip("-").isdigit():
            raise bad_request(f"logit_bias keys must be token ids (integers), got {key[:40]!r}", "logit_bias")
        out[int(text)] = value
    return out


class ResponseJsonSchema(_Strict):
    name: str = Field(max_length=64)
    description: str | None = None
    schema_: Any = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: ResponseJsonSchema | None = None


class _GuidedFields(_Strict):
    """Structured outputs: OpenAI's response_format and vLLM's guided_* extensions (at most one
    of them). Their bounds are orca_ext.guided's (spec.py); compiling happens in service.py."""

    response_format: ResponseFormat | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None

    def guided_spec(self) -> GuidedSpec | None:
        """The output constraint, or None; InvalidRequestError naming the field when it is
        malformed or over its bounds, or when two are given."""
        given = [name for name in ("guided_json", "guided_regex", "guided_choice")
                 if getattr(self, name) is not None]
        fmt = self.response_format
        if fmt is not None and fmt.type != "text":
            given.append("response_format")
        if len(given) > 1:
            raise bad_request(f"give at most one of {', '.join(given)}", given[1])
        if not given:
            return None
        field = given[0]
        if field == "guided_json":
            return json_schema_spec(self.guided_json, field)
        if field == "guided_regex":
            return regex_spec(self.guided_regex, field)
        if field == "guided_choice":
            return choice_spec(self.guided_choice, field)
        if fmt.type == "json_object":
            return json_object_spec(field)
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise bad_request('response_format of type "json_schema" needs json_schema.schema', field)
        return json_schema_spec(fmt.json_schema.schema_, field)


class CompletionRequest(_SamplingFields, _GuidedFields):
    prompt: Any
    logprobs: int | None = None
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, v: Any) -> tuple[str | list[int], ...]:
        """The prompts of the request: one text or token-id list, or OpenAI's batch (a list of
        texts or of token-id lists)."""
        def is_ids(x: Any) -> bool:
            # bool is an int subclass in Python; true/false are not token ids.
            return isinstance(x, list) and all(type(t) is int for t in x)

        if isinstance(v, str) or is_ids(v):
            return (v,)
        if isinstance(v, list) and all(isinstance(p, str) or (p and is_ids(p)) for p in v):
            return tuple(v)
        raise ValueError("prompt must be a string, a list of token ids, or a list of either")

    @property
    def prompts(self) -> tuple[str | list[int], ...]:
        return self.prompt

    @property
    def num_prompts(self) -> int:
        return len(self.prompt)

    def logprobs_kwargs(self) -> dict[str, Any]:
        # echo reports the prompt's logprobs too; max_tokens 0 with echo scores the prompt alone.
        kwargs: dict[str, Any] = {"logprobs": self.logprobs}
        if self.echo and (self.logprobs is not None or self.max_tokens == 0):
            kwargs["prompt_logprobs"] = self.logprobs or 0
        return kwargs

    @property
    def num_sequences(self) -> int:
        return max(self.n or 1, self.best_of or 1)

    @property
    def ranks_sequences(self) -> bool:
        return self.num_sequences > (self.n or 1)

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_COMPLETION_LOGPROBS:
            raise bad_request(f"logprobs must be an integer in [0, {MAX_COMPLETION_LOGPROBS}], got {self.logprobs}",
                              "logprobs")
        if self.best_of is not None and not (self.n or 1) <= self.best_of <= MAX_SEQUENCES:
            raise bad_request(f"best_of must be an integer in [n, {MAX_SEQUENCES}] (n = {self.n or 1}), "
                              f"got {self.best_of}", "best_of")
        if self.ranks_sequences and self.stream:
            raise bad_request("best_of > n cannot be streamed (the best sequences are known only at the end)",
                              "best_of")
        if self.suffix:
            raise bad_request("suffix is not supported", "suffix")
        sequences = self.num_prompts * self.num_sequences
        if sequences > MAX_REQUEST_SEQUENCES:
            raise bad_request(f"prompt: {self.num_prompts} prompts x {self.num_sequences} sequences each = "
                              f"{sequences} sequences, over the limit of {MAX_REQUEST_SEQUENCES} per request",
                              "prompt")


class FunctionCall(_Strict):
    name: str = Field(max_length=64)
    arguments: str


class MessageToolCall(_Strict):
    id: str = Field(max_length=128)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Any = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None   # assistant: the calls it made
    tool_call_id: str | None = Field(default=None, max_length=128)  # tool: the call it answers

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


class FunctionDef(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: str = Field(max_length=64)


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields, _GuidedFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: Annotated[list[ToolDef], Field(min_length=1, max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice(cls, v: Any) -> Any:
        # One message naming the field for every form not taken (OpenAI's allowed_tools and
        # custom choices too), rather than one error per member of the union.
        if v is None or v in ("none", "auto", "required"):
            return v
        if isinstance(v, dict) and v.get("type") == "function":
            try:
                return NamedToolChoice.model_validate(v)
            except ValidationError as exc:
                err = exc.errors(include_url=False)[0]
                where = ".".join(str(p) for p in err["loc"])
                raise ValueError(f"tool_choice.{where}: {err['msg']}") from None
        kind = v.get("type") if isinstance(v, dict) else v
        kind = (repr(kind[:40]) if isinstance(kind, str) else "without a type" if isinstance(v, dict)
                else f"of JSON type {type(v).__name__}")
        raise ValueError(f'tool_choice {kind} is not supported; use "none", "auto", "required" or '
                         '{"type": "function", "function": {"name": ...}}')

    def tool_dicts(self) -> list[dict] | None:
        """The tools as the chat template takes them (None: no tools)."""
        if not self.tools:
            return None
        tools = [t.model_dump(exclude_none=True) for t in self.tools]
        check_tools(tools)
        return tools

    @property
    def parses_tool_calls(self) -> bool:
        """Whether the output is parsed into tool_calls (tools given, tool_choice not "none")."""
        return bool(self.tools) and self.tool_choice != "none"

    def guided_spec(self) -> GuidedSpec | None:
        """Structured outputs, or the grammar of a forced tool call (tool_choice "required" or a
        named function); not both."""
        choice = self.tool_choice
        if choice is not None and choice != "none" and not self.tools:
            raise bad_request("tool_choice needs tools", "tool_choice")
        forced = None
        if self.tools and choice not in (None, "auto", "none"):
            named = choice if isinstance(choice, str) else choice.model_dump()
            forced = tool_call_spec(self.tool_dicts(), named, parallel=self.parallel_tool_calls is not False)
        own = super().guided_spec()
        if forced is not None and own is not None:
            raise bad_request(f"tool_choice {choice if isinstance(choice, str) else 'naming a function'} "
                              f"cannot be combined with {own.field}", "tool_choice")
        return forced or own

    def logprobs_kwargs(self) -> dict[str, Any]:
        if not self.logprobs:
            return {}
        return {"logprobs": self.top_logprobs or 0}

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise bad_request(f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.top_logprobs}",
                              "top_logprobs")
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

    def message_dicts(self) -> list[dict[str, Any]]:
        dicts: list[dict[str, Any]] = []
        for m in self.messages:
            d: dict[str, Any] = {"role": m.role, "content": m.content or ""}  # absent (None): ""
            if m.tool_calls:
                d["tool_calls"] = [c.model_dump() for c in m.tool_calls]
            if m.tool_call_id is not None:
                d["tool_call_id"] = m.tool_call_id
            dicts.append(d)
        return dicts


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
