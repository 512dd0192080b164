"""The OpenAI request schema the server accepts, validated the way vLLM does it.

Requests are parsed from raw bytes here (not by FastAPI) so every failure, from bad JSON to
a wrong type deep in `messages`, becomes one 400 with an OpenAI-style body
`{"error": {"message", "type", "param", "code"}}` whose `param` names the field. Types are
strict (no "5" for 5, no true for 1). What clients send beyond that is taken as vLLM takes it:
- an unknown field, at any depth, is ignored, and one warning line names every one a
  request had ("messages[0].foo");
- null for an optional field means unset (its default);
- OpenAI and vLLM fields that this engine does not implement (`UNSUPPORTED`, and the
  penalties) pass at the value that changes nothing and get a 400 otherwise, since ignoring
  them would change the output unseen.
- temperature, top_p and top_k left unset take the target's generation_config.json values
  (the server's `default_sampling`), as vLLM does by default; serving/server/app.py applies them.
Extension fields (vLLM's names where vLLM has one): `top_k`, `speculate` (false: plain
decoding for this request) and `ignore_eos`; on chat requests, the fields vLLM passes to the
chat template: `add_generation_prompt`, `continue_final_message`, `chat_template` and
`chat_template_kwargs`. Chat messages carry tool-call history (an assistant's `tool_calls`,
a tool reply's `tool_call_id`), a `name`, and an earlier reply's reasoning
(`reasoning_content`, or vLLM's newer `reasoning`), all handed to the template.
"""

from __future__ import annotations

import json
import logging
import math
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from specheads.serving.decode.sampling import MAX_SEED
from specheads.serving.server.logprobs import MAX_LOGPROBS

log = logging.getLogger("specheads.serve")

MAX_CHOICES = 64  # n x number of prompts
MAX_STOP_STRINGS = 16


class APIError(Exception):
    """An error answered as OpenAI-style JSON with an HTTP status."""

    def __init__(self, status: int, message: str, err_type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None,
                 rejected: bool = True):
        super().__init__(message)
        self.rejected = rejected  # counted in request_rejected_total (False: counted where it happened)
        self.status = status
        self.message = message
        self.err_type = err_type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.err_type, "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    """Fields shared by completions and chat completions."""
    model: str
    max_tokens: int | None = None
    temperature: float | None = None  # None: the target's generation_config, else 1
    top_p: float | None = None  # None: the target's generation_config, else 1
    top_k: int | None = None  # extension; 0 or -1 = off; None: the target's generation_config, else off
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    speculate: bool = True  # extension: false decodes this request without the heads
    ignore_eos: bool = False  # extension (vLLM's): keep generating past the EOS token
    presence_penalty: float = 0.0  # accepted only at 0 (not implemented)
    frequency_penalty: float = 0.0  # accepted only at 0 (not implemented)

    @field_validator("max_tokens")
    @classmethod
    def _max_tokens(cls, value, info):
        return _at_least_one(value, info)

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, value):
        if value is not None and (not math.isfinite(value) or value < 0):
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {value}")
        return value

    @field_validator("top_p")
    @classmethod
    def _top_p(cls, value):
        if value is not None and not (math.isfinite(value) and 0 < value <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {value}")
        return value

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, value):
        if value is None:
            return None
        if value < -1:
            raise ValueError(f"top_k must be -1 or 0 (off) or a positive integer, got {value}")
        return max(value, 0)

    @field_validator("seed")
    @classmethod
    def _seed(cls, value):
        if value is not None and not 0 <= value <= MAX_SEED:
            raise ValueError(f"seed must be an integer in [0, 2**64 - 1], got {value}")
        return value

    @field_validator("stop")
    @classmethod
    def _stop(cls, value):
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(stops)}")
        if any(s == "" for s in stops):
            raise ValueError("stop strings must not be empty")
        return stops

    @field_validator("n")
    @classmethod
    def _n(cls, value):
        if not 1 <= value <= MAX_CHOICES:
            raise ValueError(f"n must be in [1, {MAX_CHOICES}], got {value}")
        return value

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _penalty(cls, value, info):
        if value != 0:
            raise ValueError(f"{info.field_name} is not supported by this server; leave it unset or 0")
        return value

    @model_validator(mode="after")
    def _stream_options(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    @property
    def stop_strings(self) -> list[str]:
        return list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


def _at_least_one(value, info):
    """A token count that is None (the default) or >= 1."""
    if value is not None and value < 1:
        raise ValueError(f"{info.field_name} must be at least 1, got {value}")
    return value


def _refuse_unsupported(value, info):
    """A field the server accepts in the schema but does not implement: only its "off" value
    (unset, false or empty) passes."""
    if value is not None and value is not False and value != "":
        raise ValueError(f"{info.field_name} is not supported by this server; leave it unset")
    return value


PromptType = Union[str, list[str], list[int], list[list[int]]]


def _num_logprobs(value, info):
    """A count of top logprobs: None (off) or 0..MAX_LOGPROBS."""
    if value is not None and not 0 <= value <= MAX_LOGPROBS:
        raise ValueError(f"{info.field_name} must be in [0, {MAX_LOGPROBS}], got {value}")
    return value


class CompletionRequest(_Sampling):
    prompt: PromptType
    echo: bool = False  # the prompt's text (and, with logprobs, its tokens' logprobs) before the completion
    logprobs: int | None = None  # the top tokens to report per position (0: the chosen token's alone)
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("suffix")
    @classmethod
    def _unsupported(cls, value, info):
        return _refuse_unsupported(value, info)

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, value, info):
        return _num_logprobs(value, info)

    @model_validator(mode="after")
    def _prompt_and_best_of(self):
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of must equal n ({self.n}) if given, got {self.best_of}")
        prompts = self.prompts
        if not prompts:
            raise ValueError("prompt must not be an empty list")
        for prompt in prompts:
            if len(prompt) == 0:
                raise ValueError("prompt must not be empty (give at least one character or token)")
        if len(prompts) * self.n > MAX_CHOICES:
            raise ValueError(f"n x number of prompts must be at most {MAX_CHOICES}, got {len(prompts)} x {self.n}")
        return self

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompt as a list of prompts, each text or token ids."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if prompt and all(isinstance(p, int) for p in prompt):
            return [list(prompt)]
        return list(prompt)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str | None = None  # a JSON object, as text (OpenAI's shape)


class ToolCall(_Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool's reply: the call it answers
    reasoning_content: str | None = None  # an earlier reply's reasoning (SGLang's, vLLM's older name)
    reasoning: str | None = None  # the same (vLLM's newer name)

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def for_template(self, index: int) -> dict:
        """The message as chat templates read it (vLLM's shape): tool calls' arguments parsed
        into objects, as HF templates expect; fields the message did not set left out."""
        message = {"role": self.role, "content": self.text()}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        reasoning = self.reasoning_content if self.reasoning_content is not None else self.reasoning
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        if self.tool_calls:
            message["tool_calls"] = [_template_call(call, f"messages[{index}].tool_calls[{j}]")
                                     for j, call in enumerate(self.tool_calls)]
        return message


def _template_call(call: ToolCall, where: str) -> dict:
    arguments = call.function.arguments
    try:
        parsed = json.loads(arguments) if arguments else {}
    except ValueError as err:
        raise APIError(400, f"{where}.function.arguments is not JSON ({err}); send the arguments object as JSON "
                            "text", param=f"{where}.function.arguments", code="invalid_value") from err
    out = {"type": call.type, "function": {"name": call.function.name, "arguments": parsed}}
    return out if call.id is None else {"id": call.id, **out}


# apply_chat_template's own arguments: a request's chat_template_kwargs may not set them
RESERVED_TEMPLATE_KWARGS = ("add_generation_prompt", "continue_final_message", "conversation", "messages",
                            "return_dict", "tokenize")


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    # variables for the chat template (vLLM's field), e.g. {"enable_thinking": false} for Qwen3
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True  # end the prompt with the assistant's turn opening
    continue_final_message: bool = False  # continue the last (assistant) message instead
    chat_template: str | None = None  # a Jinja template for this request instead of the server's

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, value):
        reserved = sorted(set(value or {}) & set(RESERVED_TEMPLATE_KWARGS))
        if reserved:
            raise ValueError(f"{', '.join(reserved)} cannot be set here: the server renders the prompt itself "
                             f"(chat_template_kwargs may set the template's own variables)")
        return value

    @field_validator("max_completion_tokens")
    @classmethod
    def _max_completion_tokens(cls, value, info):
        return _at_least_one(value, info)

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, value, info):
        if value and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs set to true")
        return _num_logprobs(value, info)

    @model_validator(mode="after")
    def _template_flags(self):
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message continues the last message, so it needs add_generation_prompt "
                             "set to false")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise ValueError(f"continue_final_message continues an assistant message, but the last message is the "
                             f"{self.messages[-1].role}'s")
        return self

    @model_validator(mode="after")
    def _one_max(self):
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise ValueError("give max_tokens or max_completion_tokens, not two different values")
        if self.max_tokens is None:
            self.max_tokens = self.max_completion_tokens
        return self


def _loc(loc: tuple) -> str:
    """pydantic's error location -> a dotted field name (union-branch tags dropped)."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in _BRANCH_TAGS or "[" in str(part) or "-" in str(part):
            continue
        else:
            out += ("." if out else "") + str(part)
    return out


_BRANCH_TAGS = {"str", "int", "float", "bool", "none", "TextPart", "StreamOptions", "ChatMessage"}


# OpenAI and vLLM request fields this engine does not implement -> the values that change
# nothing (null always passes). Clients that always send them work; any other value is a 400,
# since ignoring it would change the output unseen.
UNSUPPORTED: dict[str, tuple] = {
    "logit_bias": ({},), "response_format": ({"type": "text"},), "tools": ([],), "functions": ([],),
    "tool_choice": ("none", "auto"), "function_call": ("none", "auto"), "repetition_penalty": (1.0,),
    "min_p": (0.0,), "min_tokens": (0,), "stop_token_ids": ([],), "bad_words": ([],), "use_beam_search": (False,),
    "prompt_logprobs": (), "include_stop_str_in_output": (False,), "skip_special_tokens": (True,),
    "guided_json": (), "guided_regex": (), "guided_choice": (), "guided_grammar": (), "structured_outputs": (),
    "truncate_prompt_tokens": (), "allowed_token_ids": (),
}


def _refuse_unsupported_fields(body: dict) -> None:
    """A 400 for an UNSUPPORTED field at a value that would change the output; the others are
    dropped (they change nothing)."""
    for name in [name for name in body if name in UNSUPPORTED]:
        value, neutral = body.pop(name), UNSUPPORTED[name]
        if value is not None and not any(_same(value, n) for n in neutral):
            allowed = " or ".join(["unset", *(json.dumps(n) for n in neutral)])
            raise APIError(400, f"{name} is not supported by this server; leave it {allowed}", param=name,
                           code="unsupported_field")


def _same(value, neutral) -> bool:
    """JSON equality: 1 and 1.0 are one number, true is not 1."""
    if isinstance(value, bool) or isinstance(neutral, bool):
        return value is neutral
    if isinstance(value, (int, float)) and isinstance(neutral, (int, float)):
        return value == neutral
    return type(value) is type(neutral) and value == neutral


def _drop(body: dict, loc: tuple) -> bool:
    """Delete the field at pydantic's error location loc (union-branch tags skipped) -> whether it was there."""
    node: object = body
    for part in loc[:-1]:
        if isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            node = node[part]
        elif isinstance(node, dict) and part in node:
            node = node[part]
    if isinstance(node, dict) and loc and loc[-1] in node:
        del node[loc[-1]]
        return True
    return False


def validate_request(model: type[_Sampling], body: dict) -> _Sampling:
    """A parsed JSON object -> a request, or a 400 naming the first bad field. Unknown fields
    are dropped and logged in one warning line; null is unset (module doc)."""
    _refuse_unsupported_fields(body)
    for name in [name for name, value in body.items() if value is None]:
        field = model.model_fields.get(name)
        if field is not None and not field.is_required():
            del body[name]
    ignored = []
    while True:
        try:
            request = model.model_validate(body)
            break
        except ValidationError as err:
            errors = err.errors(include_url=False)
            extra = [tuple(e["loc"]) for e in errors if e["type"] == "extra_forbidden"]
            dropped = [loc for loc in extra if _drop(body, loc)]
            if not dropped:  # a real error (pydantic lists every union branch's; the first names the field)
                raise _invalid(errors[0]) from err
            ignored += [_loc(loc) for loc in dropped]
    if ignored:
        log.warning("ignored unknown request fields: %s", ", ".join(dict.fromkeys(ignored)))
    return request


def _invalid(error: dict) -> APIError:
    param = _loc(tuple(error["loc"])) or None
    message = error["msg"].removeprefix("Value error, ")
    if error["type"] == "missing":
        message = f"field {param!r} is required"
    elif param and not message.startswith(param):
        message = f"{param}: {message}"
    return APIError(400, message, param=param, code="invalid_value")
