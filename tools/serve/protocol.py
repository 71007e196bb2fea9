"""The OpenAI request bodies the server takes, as pydantic models, and the one error type every refusal raises.

Field names, defaults and ranges are OpenAI's (and vLLM's extensions `top_k`, `repetition_penalty`). A field OpenAI
defines that this server does not implement, and that would change the answer (`tools`, `response_format` other than
text, `logit_bias`, `echo`, `suffix`, ...), is refused with a 400 naming it; so is a field OpenAI does not define
(OpenAI answers "Unrecognized request argument supplied" too): nothing a client asked for is silently ignored.
"""
from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from refimpl.batch_api import MAX_LOGPROBS

MAX_N = 16  # choices a request may ask for
MAX_STOP = 4  # stop strings, as OpenAI
MAX_TOP_LOGPROBS = MAX_LOGPROBS  # as OpenAI (chat); completions' logprobs caps at 5 there, 20 here


class APIError(Exception):
    """A refused request: the HTTP status, OpenAI's error body fields."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.message, self.status, self.param, self.type, self.code = message, status, param, type, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False


class ImageURL(_Strict):
    url: str
    detail: Literal["auto", "low", "high"] = "auto"


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ImagePart(_Strict):
    type: Literal["image_url"]
    image_url: ImageURL


ContentPart = Union[TextPart, ImagePart]


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, list[ContentPart], None] = None
    name: str | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict | None = None


class _Sampling(_Strict):
    """The fields both endpoints share."""

    model: str
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)  # vLLM's extension; 0 (or -1) is off
    seed: int | None = Field(None, ge=0, lt=2 ** 63)
    stop: Union[str, list[str], None] = Field(None, validate_default=True)
    n: int = Field(1, ge=1, le=MAX_N)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, gt=0, le=10)  # vLLM's extension (HF's rule)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # OpenAI fields that would change the answer and are not implemented: refused unless absent or neutral
    logit_bias: dict[str, float] | None = None

    @field_validator("top_k", mode="before")
    @classmethod
    def _minus_one_is_off(cls, v):
        return 0 if v == -1 else v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings, got {len(stops)}")
        if any(s == "" for s in stops):
            raise ValueError("a stop string is empty")
        return stops

    def refuse_unimplemented(self) -> None:
        if self.logit_bias:
            raise APIError("logit_bias is not supported by this server", param="logit_bias")
        if self.stream_options is not None and not self.stream:
            raise APIError("stream_options is only allowed when stream is true", param="stream_options")


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    response_format: ResponseFormat | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    function_call: Any = None

    def refuse_unimplemented(self) -> None:
        super().refuse_unimplemented()
        for name in ("tools", "functions"):
            if getattr(self, name):
                raise APIError(f"{name} (function calling) is not supported by this server", param=name)
        for name in ("tool_choice", "function_call"):
            if getattr(self, name) not in (None, "none"):
                raise APIError(f"{name} is not supported by this server", param=name)
        if self.response_format is not None and self.response_format.type != "text":
            raise APIError(f"response_format {self.response_format.type!r} is not supported by this server "
                           f"(only 'text')", param="response_format")
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError("top_logprobs needs logprobs: true", param="top_logprobs")

    def limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: int = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)

    def refuse_unimplemented(self) -> None:
        super().refuse_unimplemented()
        if self.echo:
            raise APIError("echo is not supported by this server", param="echo")
        if self.suffix:
            raise APIError("suffix (insertion) is not supported by this server", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise APIError("best_of other than n is not supported by this server", param="best_of")

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of prompts: each a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise APIError("prompt is empty", param="prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


def parse(model: type[_Sampling], body: Any) -> _Sampling:
    """A JSON body -> the request, or APIError(400) naming the first offending field."""
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object")
    try:
        request = model.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err["loc"])
        if err["type"] == "extra_forbidden":
            raise APIError(f"Unrecognized request argument supplied: {where}", param=where) from None
        raise APIError(f"{where}: {err['msg']}", param=where or None) from None
    request.refuse_unimplemented()
    return request
