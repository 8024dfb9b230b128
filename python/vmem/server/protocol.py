"""The OpenAI request bodies the server takes, checked strictly (pydantic, strict mode: a string
is never a number, a float never an int, a bool never either), and what they ask of the engine
(:class:`Params`). What is honoured, what is accepted and ignored (``user``, ``metadata``,
``store``, ``service_tier``), and what is refused with a 400 naming the parameter, as
docs/server.md lists: every field OpenAI defines that the server cannot honour is refused unless
it has its neutral value, and a field OpenAI does not define is refused as OpenAI does
("Unrecognized request argument supplied").
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Dict, List, Optional, Tuple, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .errors import ApiError, bad_request

#: Choices one request may ask for (``n`` times the prompts of a completions request).
MAX_CHOICES = 16
#: Stop strings one request may give, and the longest one (characters).
MAX_STOPS = 8
MAX_STOP_CHARS = 256
#: OpenAI's range for ``temperature``.
MAX_TEMPERATURE = 2.0
#: ``max_tokens`` of a completions request that gives none (OpenAI's default).
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
#: A seed is a signed 64-bit integer, as OpenAI's.
SEED_RANGE = (-(2**63), 2**63 - 1)

_UNION_MESSAGES = {
    "prompt": "prompt must be a string, a list of strings, a list of token ids or a list of lists of token ids",
    "stop": "stop must be a string or a list of strings",
    "content": "content must be a string or a list of text parts",
}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False


class TextPart(_Strict):
    model_config = ConfigDict(strict=True, extra="allow")  # other part types are refused by name below
    type: str
    text: Optional[str] = None


class Message(_Strict):
    role: str
    content: Union[str, List[TextPart], None] = None
    name: Optional[str] = None


class _Common(_Strict):
    model: str
    max_tokens: Optional[int] = None
    temperature: Optional[float] = Field(default=None, allow_inf_nan=False)
    top_p: Optional[float] = Field(default=None, allow_inf_nan=False)
    n: Optional[int] = None
    stream: Optional[bool] = None
    stream_options: Optional[StreamOptions] = None
    stop: Union[str, List[str], None] = None
    seed: Optional[int] = None
    presence_penalty: Optional[float] = Field(default=None, allow_inf_nan=False)
    frequency_penalty: Optional[float] = Field(default=None, allow_inf_nan=False)
    logit_bias: Optional[Dict[str, float]] = None
    user: Optional[str] = None
    # vLLM's extension, used by its benchmark to get the trace's output lengths.
    ignore_eos: Optional[bool] = None


class CompletionRequest(_Common):
    prompt: Union[str, List[str], List[int], List[List[int]]]
    echo: Optional[bool] = None
    logprobs: Optional[int] = None
    best_of: Optional[int] = None
    suffix: Optional[str] = None


class ChatRequest(_Common):
    messages: List[Message]
    max_completion_tokens: Optional[int] = None
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = None
    tools: Optional[List[Any]] = None
    tool_choice: Optional[Any] = None
    parallel_tool_calls: Optional[bool] = None
    response_format: Optional[Dict[str, Any]] = None
    store: Optional[bool] = None
    metadata: Optional[Dict[str, Any]] = None
    service_tier: Optional[str] = None


@dataclasses.dataclass(frozen=True)
class Params:
    """What a request asks of each of its choices: ``max_tokens`` (``None``: up to the context),
    ``temperature`` (0: greedy; ``None``: the server's default), ``top_p`` (``None``: the
    default), ``seed``, ``stop`` strings, ``ignore_eos``, and ``n`` choices per prompt."""

    max_tokens: Optional[int]
    temperature: Optional[float]
    top_p: Optional[float]
    seed: Optional[int]
    stop: Tuple[str, ...]
    ignore_eos: bool
    n: int


@dataclasses.dataclass(frozen=True)
class Job:
    """A checked request: ``model``, ``params``, the prompts (completions: text or token ids; chat:
    ``None``, the ``messages`` instead), ``stream`` and ``include_usage``."""

    model: str
    params: Params
    stream: bool
    include_usage: bool
    prompts: Optional[List[Union[str, List[int]]]] = None
    messages: Optional[List[Dict[str, Any]]] = None


def parse_body(raw: bytes) -> Dict[str, Any]:
    """The request's JSON object: 400 for malformed JSON, ``NaN``/``Infinity`` (not JSON), or a
    body that is not an object."""
    def refuse(token: str) -> Any:
        raise ValueError(f"{token} is not valid JSON")

    try:
        body = json.loads(raw, parse_constant=refuse)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise bad_request(f"The request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request(f"The request body must be a JSON object, got a JSON {type(body).__name__}",
                          code="invalid_json")
    return body


def _param(loc: Tuple[Any, ...]) -> str:
    """A pydantic error location as the request's parameter path (``messages.0.content``), union
    member tags (``list[int]``) left out."""
    keep = [str(p) for p in loc if isinstance(p, int) or (isinstance(p, str) and p.replace("_", "").isalpha()
                                                          and p not in ("str", "int", "float", "bool", "list", "dict"))]
    return ".".join(keep)


def _validation_error(e: ValidationError) -> ApiError:
    err = e.errors()[0]
    loc = tuple(err.get("loc", ()))
    param = _param(loc)
    field = next((str(p) for p in reversed(loc) if isinstance(p, str) and p in _UNION_MESSAGES), None)
    kind = err.get("type", "")
    if kind == "extra_forbidden":
        return bad_request(f"Unrecognized request argument supplied: {param}", param=param)
    if kind == "missing":
        return bad_request(f"Missing required parameter: '{param}'", param=param)
    if field is not None and kind not in ("finite_number",):
        return bad_request(f"Invalid type for '{param}': {_UNION_MESSAGES[field]}", param=param)
    return bad_request(f"Invalid value for '{param}': {err.get('msg', 'invalid')}", param=param)


def _validated(model: Any, body: Dict[str, Any]) -> Any:
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise _validation_error(e) from None


def _refuse_unless(cond: bool, param: str, why: str) -> None:
    if not cond:
        raise bad_request(f"'{param}' is not supported by this server: {why}", param=param,
                          code="unsupported_parameter")


def _params(req: _Common, max_tokens: Optional[int], choices_per_n: int, max_tokens_param: str = "max_tokens"
            ) -> Params:
    n = 1 if req.n is None else req.n
    if not 1 <= n <= MAX_CHOICES // max(1, choices_per_n):
        raise bad_request(f"Invalid value for 'n': {n}; it must be from 1 to {MAX_CHOICES // max(1, choices_per_n)} "
                          f"(at most {MAX_CHOICES} choices a request)", param="n")
    if max_tokens is not None and max_tokens < 1:
        raise bad_request(f"Invalid value for '{max_tokens_param}': {max_tokens}; it must be at least 1",
                          param=max_tokens_param)
    temperature, top_p = req.temperature, req.top_p
    if temperature is not None and not 0.0 <= temperature <= MAX_TEMPERATURE:
        raise bad_request(f"Invalid value for 'temperature': {temperature}; it must be from 0 to {MAX_TEMPERATURE}",
                          param="temperature")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise bad_request(f"Invalid value for 'top_p': {top_p}; it must be more than 0 and at most 1", param="top_p")
    if req.seed is not None and not SEED_RANGE[0] <= req.seed <= SEED_RANGE[1]:
        raise bad_request(f"Invalid value for 'seed': {req.seed}; it must be a signed 64-bit integer", param="seed")
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stops) > MAX_STOPS:
        raise bad_request(f"Invalid value for 'stop': at most {MAX_STOPS} stop strings, got {len(stops)}", param="stop")
    if any(not s or len(s) > MAX_STOP_CHARS for s in stops):
        raise bad_request(f"Invalid value for 'stop': each stop string must have 1 to {MAX_STOP_CHARS} characters",
                          param="stop")
    _refuse_unless(not req.presence_penalty, "presence_penalty", "only 0")
    _refuse_unless(not req.frequency_penalty, "frequency_penalty", "only 0")
    _refuse_unless(not req.logit_bias, "logit_bias", "no logit bias")
    if req.stream_options is not None and not req.stream:
        raise bad_request("'stream_options' is only allowed when 'stream' is true", param="stream_options")
    return Params(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=req.seed,
                  stop=tuple(dict.fromkeys(stops)), ignore_eos=bool(req.ignore_eos), n=n)


def completion_job(body: Dict[str, Any]) -> Job:
    """A ``/v1/completions`` body, checked."""
    req = _validated(CompletionRequest, body)
    _refuse_unless(not req.echo, "echo", "the prompt is not echoed")
    _refuse_unless(req.logprobs is None, "logprobs", "no log probabilities")
    _refuse_unless(req.best_of in (None, 1), "best_of", "only 1")
    _refuse_unless(req.suffix is None, "suffix", "no insertion")
    prompts: List[Union[str, List[int]]]
    p: Any = req.prompt
    if isinstance(p, str):
        prompts = [p]
    elif p and all(isinstance(x, int) for x in p):
        prompts = [list(p)]
    else:
        prompts = list(p)
    if not prompts:
        raise bad_request("Invalid value for 'prompt': it is empty", param="prompt")
    if len(prompts) > MAX_CHOICES:
        raise bad_request(f"Invalid value for 'prompt': at most {MAX_CHOICES} prompts a request", param="prompt")
    max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens
    params = _params(req, max_tokens, len(prompts))
    return Job(model=req.model, params=params, stream=bool(req.stream),
               include_usage=bool(req.stream_options and req.stream_options.include_usage), prompts=prompts)


def chat_job(body: Dict[str, Any]) -> Job:
    """A ``/v1/chat/completions`` body, checked; its messages as the chat template takes them."""
    req = _validated(ChatRequest, body)
    if req.max_tokens is not None and req.max_completion_tokens is not None:
        raise bad_request("Give one of 'max_tokens' and 'max_completion_tokens', not both", param="max_tokens")
    _refuse_unless(not req.logprobs, "logprobs", "no log probabilities")
    _refuse_unless(req.top_logprobs in (None, 0), "top_logprobs", "no log probabilities")
    _refuse_unless(not req.tools, "tools", "no tool calls")
    _refuse_unless(req.tool_choice in (None, "none"), "tool_choice", "no tool calls")
    _refuse_unless(req.response_format in (None, {"type": "text"}), "response_format", "text only")
    if not req.messages:
        raise bad_request("Invalid value for 'messages': it is empty", param="messages")
    messages = []
    for i, m in enumerate(req.messages):
        if m.role not in ("system", "developer", "user", "assistant"):
            raise bad_request(f"Invalid value for 'messages.{i}.role': {m.role!r}; one of system, developer, user, "
                              "assistant (no tool messages)", param=f"messages.{i}.role")
        if isinstance(m.content, list):
            for j, part in enumerate(m.content):
                if part.type != "text" or part.text is None:
                    raise bad_request(f"Invalid value for 'messages.{i}.content.{j}': only text parts "
                                      f"({{'type': 'text', 'text': ...}}), got type {part.type!r}",
                                      param=f"messages.{i}.content.{j}")
            content = "".join(part.text or "" for part in m.content)
        elif m.content is None:
            raise bad_request(f"Missing required parameter: 'messages.{i}.content'", param=f"messages.{i}.content")
        else:
            content = m.content
        msg: Dict[str, Any] = {"role": m.role, "content": content}
        if m.name is not None:
            msg["name"] = m.name
        messages.append(msg)
    given = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    params = _params(req, max_tokens, 1, given)
    return Job(model=req.model, params=params, stream=bool(req.stream),
               include_usage=bool(req.stream_options and req.stream_options.include_usage), messages=messages)
