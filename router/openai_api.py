"""The OpenAI-compatible request and response shapes the ingress accepts and returns.

Pydantic at the boundary (docs/design.md, Typed config at the boundary): a malformed body is
refused with HTTP 400 and an OpenAI-style error object naming the field, before anything is
queued. Extensions beyond
OpenAI's schema follow vLLM's names where vLLM has them (``ignore_eos``, ``return_token_ids``,
``cache_salt``, ``stop_token_ids``, ``repetition_penalty``, ``top_k``, ``min_p``, ``min_tokens``,
``include_stop_str_in_output``, ``add_special_tokens``, ``truncate_prompt_tokens`` and
``truncation_side``, ``skip_special_tokens``, ``return_tokens_as_token_ids``, ``allowed_token_ids``,
``bad_words``, ``prompt_logprobs``); Fairway's own figures travel in a ``fairway`` object next to
``usage``. The prompt and text options are the ingress's (it tokenizes, hashes the kept tokens and
detokenizes), so they hold on every engine; ``allowed_token_ids``, ``bad_words`` and
``prompt_logprobs`` are the engine's (the sim engine draws from the allowed ids and refuses the
other two).

No parameter is silently ignored: a field the models do not name is a 400 naming it
(``extra="forbid"``), and each documented OpenAI parameter is either honoured or refused with a
400 that names it and says why (``REFUSED``). Honoured: ``stop`` and ``stop_token_ids`` and
``echo`` by the ingress on the detokenized output (so on every engine), as are ``min_tokens``'s
bar on stops in the first tokens and ``include_stop_str_in_output`` (the engine keeps its end of
sequence away before ``min_tokens``); ``seed``, ``top_p`` and the
penalties and ``logit_bias`` by the engine (vLLM natively; the text-less sim engine makes ``seed``
deterministic, its random tokens stand for samples at any ``temperature``, ``top_p``, ``top_k`` or
``min_p``, and it refuses the others unless they are their no-op values); ``user`` and
``prompt_cache_key`` are the session key; ``priority`` is the request class (a class name or an
integer tier, as vLLM's; docs/design.md, Flow control); ``safety_identifier`` changes no output
and is accepted; ``response_format`` (JSON object or schema) becomes the call's
``structured_output``, and ``logprobs`` / ``top_logprobs`` its ``logprobs`` (the top alternatives
per output token; with ``echo``, the prompt's too), which vLLM honours and the sim engine
refuses. ``tools`` reach the chat template; a ``tool_choice`` that forces a call (``required``, or
a named function) constrains the output to the call's JSON (as vLLM's own server does without a
tool-call parser; ``parallel_tool_calls`` false allows one call), which the ingress answers as
``tool_calls`` (router/tool_calls.py); ``auto`` needs the cluster's ``tool_call_parser`` to find
calls in the model's free text, and is refused by name without one. Refused: the deprecated
``functions``, audio, stored completions, ``suffix``, ``best_of`` above 1 (``REFUSED`` has each
reason). ``n`` choices per prompt, and a completion's batch of prompts, are sent as one engine
request per choice (each with ``seed`` + its place among the prompt's choices, as vLLM seeds
them) and answered as one, indexed prompt x n + i.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from annotated_types import Ge
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainValidator,
    StrictBool,
    StrictInt,
    StrictStr,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from router.tool_calls import AUTO, NAMED, REQUIRED

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat's is the rest of the context


#: Most choices per prompt (OpenAI's bound on ``n``); ``limits.max_choices`` bounds the request's.
MAX_N = 128
#: Most stop strings / stop token ids per request (OpenAI allows 4 strings; vLLM any number).
MAX_STOPS = 16
#: Most ``bad_words`` per request: vLLM's engine takes 128 token sequences (``VLLM_MAX_NUM_BAD_WORDS``),
#: and a word can be two (with and without a space before it).
MAX_BAD_WORDS = 64

NO_FUNCTIONS = "the deprecated functions / function_call are not supported; send tools and tool_choice"
NO_AUTO = ("tool_choice 'auto' (the default when tools are sent) is not supported here: this cluster has no "
           "tool_call_parser configured to find tool calls in the model's free text. Send tool_choice 'required' "
           "(the answer is one or more calls of the tools), {\"type\": \"function\", \"function\": {\"name\": "
           "...}} (a call of that function), or 'none' (text only)")
#: The most top alternatives per token a request may ask for (vLLM's default ``max_logprobs``).
MAX_TOP_LOGPROBS = 20
#: A UTF-16 surrogate code point: JSON's "\ud800" escape decodes to one, which is no Unicode text
#: (no tokenizer, hash or UTF-8 encoder takes it).
SURROGATE = re.compile("[\ud800-\udfff]")


@dataclass(frozen=True)
class BodyFacts:
    """What the ingress's request guard (``router/limits.py``) knows of the body it hands on, for
    the request models' validators: set in ``BODY_FACTS`` while the app handles that body."""

    no_surrogate: bool  # no string of it can hold a surrogate (``body_has_no_surrogate``): no text to check
    max_items: int  # ``limits.max_messages``: a longer messages or input list is refused before its items are read


#: The facts of the body being validated (None outside the ingress: everything is checked).
BODY_FACTS: ContextVar[BodyFacts | None] = ContextVar("fairway_body_facts", default=None)
#: The most tools a request may declare (OpenAI allows 128 functions; each reaches the prompt).
MAX_TOOLS = 1024
#: How a surrogate can enter a JSON body's strings: an escape of one (``\ud800``-``\udfff``)
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def at_most(v: Any, cap: int, what: str) -> Any:
    """``v`` unchanged, or ValueError when it is a list longer than ``cap``: a bound checked before
    the list's items are validated (each costs microseconds of the ingress's event loop). O(1)."""
    if isinstance(v, list) and len(v) > cap:
        raise ValueError(f"too many {what}: {len(v)}; the limit is {cap}")
    return v


def at_most_items(v: Any, what: str) -> Any:
    """``at_most`` with ``limits.max_messages`` from ``BODY_FACTS`` (no bound outside the ingress)."""
    facts = BODY_FACTS.get()
    return v if facts is None else at_most(v, facts.max_items, what)


def body_has_no_surrogate(body: bytes) -> bool:
    """Whether no string of the JSON ``body`` can hold an unpaired surrogate: it is ASCII (so no
    UTF-8 bytes of one, which ``json.loads`` lets through) with no escape of one. False is only
    "maybe" (an escaped backslash before ``ud800`` matches too). O(body bytes) at C speed."""
    return body.isascii() and SURROGATE_ESCAPE.search(body) is None


def check_text(v: Any) -> Any:
    """``v`` (a field's value: a string, or lists and dicts of them) unchanged, or ValueError when a
    string in it holds an unpaired surrogate, so the request gets a 400 naming the field instead
    of failing in the tokenizer. Why: JSON lets a client escape half a surrogate pair. O(length of
    its non-ASCII strings) and O(its lists' and dicts' elements); O(1) where ``BODY_FACTS`` says the
    body holds no surrogate."""
    facts = BODY_FACTS.get()
    if facts is not None and facts.no_surrogate:
        return v
    if isinstance(v, str):
        if not v.isascii() and (m := SURROGATE.search(v)):
            raise ValueError(f"contains an unpaired surrogate (U+{ord(m.group()):04X}) at character {m.start()}: "
                             "not Unicode text; send UTF-8 text or token ids")
    elif isinstance(v, list):
        if v and not isinstance(v[0], int):
            for x in v:
                check_text(x)
    elif isinstance(v, dict):  # its keys too: the answers echo some dicts (metadata), JSON schemas name them
        for k, x in v.items():
            check_text(k)
            check_text(x)
    return v


#: Documented OpenAI parameters this server cannot honour: (accepted values, why not otherwise).
#: A value outside the accepted ones is a 400 naming the parameter with the reason.
REFUSED: dict[str, tuple[Any, str]] = {
    "best_of": (lambda v: v in (None, 1), "only best_of=1 is supported"),
    "suffix": (lambda v: not v, "insertion after a suffix is not supported"),
    "functions": (lambda v: not v, NO_FUNCTIONS),
    "function_call": (lambda v: v in (None, "none"), NO_FUNCTIONS),
    "audio": (lambda v: v is None, "audio output is not supported"),
    "modalities": (lambda v: v in (None, ["text"]), "only the text modality is supported"),
    "prediction": (lambda v: v is None, "predicted outputs are not supported"),
    "web_search_options": (lambda v: v is None, "web search is not supported"),
    "moderation": (lambda v: v is None, "moderation is not supported"),
    "reasoning_effort": (lambda v: v is None, "this model does not reason; reasoning_effort is not supported"),
    "verbosity": (lambda v: v is None, "output verbosity control is not supported"),
    "store": (lambda v: not v, "stored completions are not kept by this server"),
    "metadata": (lambda v: not v, "metadata is kept only with stored completions, which this server does not keep"),
    "service_tier": (lambda v: v in (None, "auto", "default"), "only the default service tier exists here"),
    "prompt_cache_retention": (lambda v: v in (None, "in_memory"), "cached prefixes are kept in memory only"),
    "prompt_cache_options": (lambda v: not v, "prompt cache options are not supported"),
    "spaces_between_special_tokens": (lambda v: v is not False, "this server's fast tokenizers decode special tokens "
                                      "as they are, as vLLM's do (true, the default, is accepted); omit it"),
}


def _refuse(v: Any, info: ValidationInfo, table: dict[str, tuple[Any, str]] | None = None) -> Any:
    """A refused parameter (``REFUSED``, or a route's own ``table``): its value if accepted, else
    a ValueError naming why not."""
    ok, why = (REFUSED if table is None else table)[info.field_name]
    if not ok(v):
        raise ValueError(f"{info.field_name} is not supported: {why}")
    return v


def _token_id(v: Any) -> Any:
    """A token id as JSON gives it: a number with no fraction (1.0 is JSON Schema's integer too),
    never a boolean or a string, which pydantic's lax int would turn into one."""
    if isinstance(v, (bool, str)):
        raise ValueError("a token id is an integer")
    return v


#: A token id in a request: an integer >= 0 (``_token_id``)
TokenId = Annotated[int, Ge(0), BeforeValidator(_token_id)]

#: Fields OpenAI's schema lets a client send as null, meaning the default.
NULL_MEANS_DEFAULT = frozenset({"temperature", "top_p", "top_k", "min_p", "n", "stream", "frequency_penalty",
                                "presence_penalty", "repetition_penalty", "ignore_eos", "return_token_ids", "echo",
                                "min_tokens", "include_stop_str_in_output", "skip_special_tokens",
                                "spaces_between_special_tokens", "return_tokens_as_token_ids",
                                "add_special_tokens"})


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = Field(False, description="a last chunk with the whole request's usage")
    continuous_usage_stats: bool = Field(False, description="vLLM's: every chunk carries its choice's usage so far "
                                         "(gateways count tokens as they stream)")


class _Text(BaseModel):
    """A request model: unknown fields refused, and every field's strings checked by ``check_text``
    (what a tokenizer, a hash or a template will read)."""

    model_config = ConfigDict(extra="forbid")

    @field_validator("*")
    @classmethod
    def _text(cls, v: Any) -> Any:
        return check_text(v)


class _Generation(_Text):
    """A generation request (completions, chat, responses): a null sampling field means its
    default, as OpenAI's clients send them; stream options only with a stream."""

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_defaults(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if not (v is None and k in NULL_MEANS_DEFAULT)}
        return data

    @field_validator("stream_options", check_fields=False)
    @classmethod
    def _stream_options(cls, v: BaseModel | None, info: ValidationInfo) -> BaseModel | None:
        # they shape a stream's last events, so without a stream they would do nothing: refused by
        # name, as vLLM refuses them (an empty object sets nothing and passes, as there)
        if v is not None and v.model_fields_set and not info.data.get("stream", False):
            raise ValueError("stream_options can only be set when stream is true")
        return v


class _Sampling(_Generation):
    """What every generation route shares (completions, chat, responses): the model, how to
    sample, the end user and session keys, and the class. ``to_chat`` (router/responses_api.py)
    copies these fields by name. Field order matters only to validators that read ``info.data``;
    these fields come first in every route."""

    model: str
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, description="vLLM's: sample from the k most likely tokens (0 or -1: all)")
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="vLLM's: leave out tokens less likely than min_p times "
                         "the most likely one (0: none)")
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    ignore_eos: bool = Field(False, description="vLLM's: run the answer to its token limit past its end of sequence")
    user: str | None = None
    safety_identifier: str | None = Field(None, description="identifies the end user; changes no output")
    prompt_cache_key: str | None = Field(None, description="the session key when no X-Session-Id header is sent")
    priority: StrictInt | StrictStr | None = Field(None, description="the request class: a class name, or an "
                                                   "integer tier as vLLM's priority (lower first); 0 without classes")


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs`` (its ``StructuredOutputsParams``; vllm-project/vllm,
    ``vllm/sampling_params.py``): exactly one constraint on the answer (a JSON Schema, any JSON
    object, a regular expression, one of some choices, a grammar, or a structural tag), and
    vLLM's options for it. Passed to the vLLM engine as it is; the sim engine refuses it by name."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    json_schema: str | dict[str, Any] | None = Field(None, alias="json", description="a JSON Schema the answer "
                                                     "follows")
    regex: str | None = Field(None, min_length=1)
    choice: list[str] | None = Field(None, min_length=1, description="the answer is one of these")
    grammar: str | None = Field(None, min_length=1, description="an EBNF / Lark grammar")
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    @model_validator(mode="after")
    def _one_kind(self) -> StructuredOutputs:
        kinds = [k for k in ("json_schema", "regex", "choice", "grammar", "json_object", "structural_tag")
                 if getattr(self, k) is not None]
        if len(kinds) != 1:
            names = [k if k != "json_schema" else "json" for k in kinds]
            raise ValueError(f"exactly one kind of constraint (json, regex, choice, grammar, json_object, "
                             f"structural_tag), not {names or 'none'}")
        return self

    def params(self) -> dict[str, Any]:
        """The constraint as vLLM's ``StructuredOutputsParams`` takes it."""
        return self.model_dump(by_alias=True, exclude_defaults=True)


class _Common(_Sampling):

    max_tokens: int | None = Field(None, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_N, description="choices per prompt, each its own engine request (seed + i "
                   "each, with a seed); limits.max_choices bounds prompts x n")
    stop: str | list[str] | None = Field(None, description="stop before any of these strings (not included)")
    min_tokens: int = Field(0, ge=0, description="vLLM's: no end of sequence, stop token or stop string ends the "
                            "answer before this many tokens (at most max_tokens)")
    include_stop_str_in_output: bool = Field(False, description="vLLM's: the stop string that ended the answer is "
                                             "kept at its end")
    stop_token_ids: list[TokenId] | None = Field(None, description="stop at any of these token ids (vLLM's "
                                                 "extension)")
    seed: int | None = Field(None, ge=-(2**63), lt=2**63,
                             description="the same seed, prompt and parameters give the same output (int64)")
    repetition_penalty: float = Field(1.0, gt=0.0, le=2.0, description="vLLM's extension; 1 = none")
    logit_bias: dict[int, float] | None = Field(None, description="token id -> bias added to its logit")
    return_token_ids: bool = False
    cache_salt: str | None = None
    best_of: int | None = None
    logprobs: Any = None
    structured_outputs: StructuredOutputs | None = Field(None, description="vLLM's output constraint: one of "
                                                         "json, regex, choice, grammar, json_object, structural_tag")
    # vLLM's extensions, by its names: the prompt's tokens and the answer's text (the ingress's),
    # and two sampling constraints (the engine's)
    truncate_prompt_tokens: int | None = Field(None, ge=-1, description="vLLM's: keep only this many of the "
                                               "prompt's tokens (-1: the context less one), cut on truncation_side")
    truncation_side: Literal["left", "right"] | None = Field(None, description="vLLM's: left (the default) keeps "
                                                             "the prompt's last tokens, right its first")
    skip_special_tokens: bool = Field(True, description="vLLM's: false keeps special tokens' text in the answer")
    spaces_between_special_tokens: bool = True
    return_tokens_as_token_ids: bool = Field(False, description="vLLM's: log probabilities name each token "
                                             "token_id:<id>")
    allowed_token_ids: list[TokenId] | None = Field(None, min_length=1, description="vLLM's: sample only these "
                                                    "tokens")
    bad_words: list[str] | None = Field(None, description=f"vLLM's: never generate these words (at most "
                                        f"{MAX_BAD_WORDS})")
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description="vLLM's: each prompt token's "
                                        "log probability and rank, with this many alternatives (a whole answer "
                                        "only)")

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> list[str] | None:
        stops = [v] if isinstance(v, str) else v
        if not stops:
            return None
        if len(stops) > MAX_STOPS or not all(stops):
            raise ValueError(f"at most {MAX_STOPS} stop strings, none empty")
        return stops

    @field_validator("stop_token_ids", mode="before")
    @classmethod
    def _stop_ids(cls, v: Any) -> Any:
        if isinstance(v, list) and len(v) > MAX_STOPS:  # before the ids are read; each >= 0: ``TokenId``
            raise ValueError(f"at most {MAX_STOPS} stop token ids, each >= 0")
        return v or None

    @field_validator("prompt_logprobs")
    @classmethod
    def _prompt_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None and info.data.get("stream"):  # as vLLM refuses them
            raise ValueError("prompt_logprobs are not available when stream is true")
        return v

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _truncation(cls, v: int | None) -> int | None:
        if v == 0:
            raise ValueError("truncate_prompt_tokens is the number of the prompt's tokens kept: at least 1, or -1 "
                             "for the context less one")
        return v

    @field_validator("truncation_side")
    @classmethod
    def _side(cls, v: str | None, info: ValidationInfo) -> str | None:
        if v is not None and info.data.get("truncate_prompt_tokens") is None:
            raise ValueError("truncation_side goes with truncate_prompt_tokens, which is not set")
        return v

    @field_validator("bad_words", mode="before")
    @classmethod
    def _bad_words(cls, v: Any) -> Any:
        if isinstance(v, list) and (len(v) > MAX_BAD_WORDS  # before the words are read
                                    or not all(isinstance(w, str) and w.strip() for w in v)):
            raise ValueError(f"at most {MAX_BAD_WORDS} bad words, each with a character other than whitespace")
        return v or None

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: dict[int, float] | None) -> dict[int, float] | None:
        if v and any(k < 0 or not -100 <= b <= 100 for k, b in v.items()):
            raise ValueError("logit_bias maps token ids >= 0 to biases in [-100, 100]")
        return v or None

    @field_validator(*REFUSED, check_fields=False)  # each model has its own subset of them
    @classmethod
    def _refused(cls, v: Any, info: ValidationInfo) -> Any:
        return _refuse(v, info)

    def stop_strings(self) -> list[str]:
        return self.stop or []  # type: ignore[return-value]  # ``_stops`` made it a list

    # What the engine is asked for beyond sampling (``GenerateCall``); each request kind says its own
    def logprob_count(self) -> int | None:
        """The top alternatives per output token the answer lists (None: no logprobs)."""
        return None

    def prompt_logprob_count(self) -> int | None:
        """The prompt tokens' log probabilities, with this many alternatives (None: none):
        vLLM's ``prompt_logprobs``."""
        return self.prompt_logprobs

    def output_constraint(self) -> tuple[dict[str, Any] | None, str]:
        """The engine's output constraint (``GenerateCall.structured_output``; None: free text) and
        the request parameter it came from (what an engine's refusal names)."""
        own = self.structured_outputs
        return (own.params(), "structured_outputs") if own is not None else (None, "response_format")


#: ``CompletionRequest.prompt`` as ``_prompts`` accepts it: non-empty text or token ids (>= 0), or
#: a batch of either (each prompt's choices in turn: ``index`` = prompt x n + i). (Token ids
#: inside the vocabulary, each prompt plus ``max_tokens`` within the context, and prompts x ``n``
#: within ``limits.max_choices`` are checked at the ingress: 400.)
_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
PROMPT_SCHEMA = {
    "title": "Prompt",
    "description": "a prompt (text or token ids), or a batch of prompts of one kind",
    "anyOf": [{"type": "string", "minLength": 1}, _IDS,
              {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1},
              {"type": "array", "items": _IDS, "minItems": 1}],
}


#: The most prompts one batch may hold (each is ``n`` engine requests, which ``limits.max_choices``
#: bounds far lower; this bound is checked before the prompts are).
MAX_PROMPTS = 4096
_AS_IDS, _AS_TEXTS, _AS_ID_LISTS = TypeAdapter(list[int]), TypeAdapter(list[str]), TypeAdapter(list[list[int]])


def prompt_value(v: Any) -> str | list[int] | list[str] | list[list[int]]:
    """``CompletionRequest.prompt`` validated as the union it is (``PROMPT_SCHEMA``): a string, or
    a list whose first element says which kind (a text: texts; a list: lists of token ids;
    otherwise token ids), every element then validated as that kind. The same values as
    pydantic's union of the four. Why not that union: it tries each kind in turn and builds an
    error for every element that fails one, 0.8 s for a batch of 500,000 one-token prompts, on the
    ingress's event loop. O(elements), at C speed; a batch's length is bounded first."""
    if isinstance(v, str):
        return v
    if not isinstance(v, list):
        raise ValueError("prompt must be a string, a list of token ids, or a list (a batch) of either")
    if not v:
        return v  # refused by ``_prompts``, with its message
    first = v[0]
    batch = isinstance(first, (str, list))
    if batch and len(v) > MAX_PROMPTS:
        raise ValueError(f"a batch holds at most {MAX_PROMPTS} prompts, not {len(v)}")
    adapter = _AS_TEXTS if isinstance(first, str) else _AS_ID_LISTS if batch else _AS_IDS
    try:
        return adapter.validate_python(v)  # type: ignore[no-any-return]
    except ValidationError as e:
        err = e.errors()[0]
        at = "".join(f"[{i}]" for i in err["loc"])
        kind = "texts" if isinstance(first, str) else "lists of token ids" if batch else "token ids"
        raise ValueError(f"a prompt of {kind} (as its first element says): element {at}: {err['msg']}") from None


class CompletionRequest(_Common):
    """``POST /v1/completions``: ``prompt`` is a string or a list of token ids, or a batch (a list)
    of either; each prompt has ``n`` choices."""

    prompt: Annotated[str | list[int] | list[str] | list[list[int]], PlainValidator(prompt_value),
                      WithJsonSchema(PROMPT_SCHEMA)]
    echo: bool = Field(False, description="the prompt's text before the completion's")
    add_special_tokens: bool = Field(True, description="vLLM's: the tokenizer's special tokens around a text "
                                     "prompt (a BOS for Llama's)")
    suffix: str | None = None
    logprobs: Annotated[Any, WithJsonSchema({
        "anyOf": [{"type": "integer", "minimum": 0, "maximum": MAX_TOP_LOGPROBS}, {"enum": [False, None]}],
        "description": "the top alternatives listed per token (0 to 20); null or false: none"})] = None

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, v: Any) -> int | None:
        if v is None or v is False:
            return None
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs is the number of top alternatives per token, 0 to {MAX_TOP_LOGPROBS}")
        return v

    def logprob_count(self) -> int | None:
        """The top alternatives per output token the answer lists (None: no logprobs)."""
        return self.logprobs  # type: ignore[no-any-return]  # ``_logprobs`` made it an int or None

    def prompt_logprob_count(self) -> int | None:
        """vLLM's ``prompt_logprobs``; else, with ``echo``, the prompt's log probabilities too
        (scoring a text, as evaluation harnesses do, with ``logprobs`` alternatives); None
        otherwise."""
        if self.prompt_logprobs is not None:
            return self.prompt_logprobs
        return self.logprobs if self.echo else None  # type: ignore[no-any-return]

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, v: Any) -> str | list[int] | list[str] | list[list[int]]:
        batch = v if isinstance(v, list) and v and isinstance(v[0], (str, list)) else [v]
        for p in batch:
            if not p:
                raise ValueError("prompt must not be empty" if len(batch) == 1 else "no prompt may be empty")
            if isinstance(p, list) and min(p) < 0:
                raise ValueError("token ids must be >= 0")
        return v  # type: ignore[no-any-return]

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: one, or a batch's in order."""
        v = self.prompt
        return list(v) if isinstance(v, list) and v and isinstance(v[0], (str, list)) else [v]  # type: ignore


#: OpenAI's rule for a function's name
FUNCTION_NAME = r"^[A-Za-z0-9_-]{1,64}$"


class FunctionDef(_Text):
    """A tool's function: its name, what it does, and its arguments' JSON Schema."""

    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="the arguments' JSON Schema (an object)")
    strict: StrictBool | None = Field(None, description="a forced call's arguments always follow the schema here")


class Tool(_Text):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(_Text):
    name: str


class NamedToolChoice(_Text):
    """``tool_choice`` naming one function: the answer is a call of it."""

    type: Literal["function"]
    function: FunctionName


class CalledFunction(_Text):
    name: str
    arguments: str = Field(description="the arguments as a JSON text")


class ToolCall(_Text):
    """A call an assistant message in the history made (the chat template renders it)."""

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(_Text):
    """One chat message; text content only (a content part of another type is a 400). ``name``,
    ``tool_call_id`` and an assistant's ``tool_calls`` go to the chat template, which renders them
    or not as the model's template does."""

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[ToolCall] | None = None
    function_call: dict[str, Any] | None = None
    refusal: str | None = None

    @field_validator("content")
    @classmethod
    def _text_parts(cls, v: str | list[dict[str, Any]] | None) -> str | list[dict[str, Any]] | None:
        if isinstance(v, list):
            for p in v:
                kind = p.get("type", "text")
                if kind != "text" or not isinstance(p.get("text", ""), str):
                    raise ValueError(f"content parts of type {kind!r} are not supported; only text")
        return v

    @field_validator("function_call")
    @classmethod
    def _no_function_call(cls, v: Any) -> Any:
        if v:
            raise ValueError(NO_FUNCTIONS)
        return v

    @field_validator("tool_calls")
    @classmethod
    def _calls_by_assistant(cls, v: list[ToolCall] | None, info: ValidationInfo) -> list[ToolCall] | None:
        if v and info.data.get("role") != "assistant":
            raise ValueError("only an assistant message has tool_calls")
        return v or None

    @field_validator("refusal")
    @classmethod
    def _no_refusal(cls, v: str | None) -> str | None:
        if v:
            raise ValueError("a refusal in the history is not supported; send it as the content")
        return v

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(str(p.get("text", "")) for p in self.content)

    def for_template(self) -> dict[str, Any]:
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name:
            out["name"] = self.name
        if self.tool_call_id:
            out["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        return out


def structured_output(response_format: dict[str, Any] | None) -> dict[str, Any] | None:
    """OpenAI's ``response_format`` as an output constraint, in the names of vLLM's
    ``StructuredOutputsParams`` (as vLLM's own server maps it): None for none or ``text``,
    ``{"json_object": True}``, or ``{"json": <the JSON schema>}`` for ``json_schema``. A
    ``ValueError`` names what is malformed."""
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or not spec["name"]:
            raise ValueError("response_format json_schema needs a json_schema object with a name")
        schema = spec.get("schema", {})
        if not isinstance(schema, dict):
            raise ValueError("response_format json_schema.schema must be a JSON Schema object")
        return {"json": schema}
    raise ValueError(f"response_format type {kind!r} is not supported; use text, json_object or json_schema")


def template_tools(tools: list[Tool] | None) -> list[dict[str, Any]] | None:
    """The tools as a chat template reads them (None without). O(tools)."""
    return [t.model_dump(exclude_none=True) for t in tools] if tools else None


def _params(fn: FunctionDef) -> dict[str, Any]:
    """A function's arguments' schema; none means any JSON object (as vLLM's own server)."""
    return fn.parameters or {"type": "object", "properties": {}}


def calls_schema(tools: list[Tool], parallel: bool | None) -> dict[str, Any]:
    """The JSON Schema of a ``required`` tool choice's answer, as vLLM's own server builds it
    (vllm-project/vllm, vllm/tool_parsers/utils.py): a non-empty list of ``{"name", "parameters"}``
    objects, each one of the tools (its name, its arguments' schema), at most one when
    ``parallel_tool_calls`` is false; the tools' ``$defs`` merged at the top, where their
    references point. A ``ValueError`` when two tools define one name differently. O(tools)."""
    defs: dict[str, Any] = {}
    each = []
    for t in tools:
        params = dict(_params(t.function))
        for name, schema in (params.pop("$defs", None) or {}).items():
            if defs.setdefault(name, schema) != schema:
                raise ValueError(f"tools define $defs {name!r} twice, differently")
        each.append({"properties": {"name": {"type": "string", "enum": [t.function.name]}, "parameters": params},
                     "required": ["name", "parameters"]})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": each}}
    if parallel is False:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


#: Names the chat template's call sets itself: ``chat_template_kwargs`` may not set them.
TEMPLATE_RESERVED = frozenset({"messages", "conversation", "tools", "documents", "add_generation_prompt",
                               "continue_final_message", "tokenize", "return_dict", "chat_template", "padding",
                               "truncation", "max_length", "return_tensors", "return_assistant_tokens_mask",
                               "tokenizer_kwargs"})


class _TemplateOptions(BaseModel):
    """The chat template's options a chat request may set, with vLLM's names: whether the prompt
    ends with the assistant's turn header, whether it instead continues the last (assistant)
    message, and further variables for the template (``enable_thinking`` for Qwen3's, say)."""

    add_generation_prompt: StrictBool = Field(True, description="end with the assistant's turn header")
    continue_final_message: StrictBool = Field(False, description="vLLM's: continue the last message, an "
                                               "assistant's (a prefill), instead of starting a turn")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="vLLM's: more variables for the chat "
                                                        "template, e.g. {\"enable_thinking\": false}")

    @field_validator("chat_template_kwargs")
    @classmethod
    def _own_names(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        taken = sorted(set(v or ()) & TEMPLATE_RESERVED)
        if taken:
            raise ValueError(f"{taken} are set by the server or by their own request fields")
        return v or None

    @model_validator(mode="after")
    def _continue_or_start(self) -> _TemplateOptions:
        messages = getattr(self, "messages", None)
        if self.continue_final_message:
            if self.add_generation_prompt and "add_generation_prompt" in self.model_fields_set:
                raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
            self.add_generation_prompt = False
            if messages and messages[-1].role != "assistant":
                raise ValueError("continue_final_message continues the last message, which must be an assistant's")
        return self

    def template_options(self) -> dict[str, Any]:
        """The chat template's keyword arguments for this request."""
        return {"add_generation_prompt": self.add_generation_prompt,
                "continue_final_message": self.continue_final_message, **(self.chat_template_kwargs or {})}


class ChatCompletionRequest(_Common, _TemplateOptions):
    """``POST /v1/chat/completions``; the tokenizer's chat template renders ``messages``."""

    messages: list[ChatMessage] = Field(min_length=1, description="at least one message (the chat template "
                                        "renders even one without text, as vLLM's server does)")
    max_completion_tokens: int | None = Field(None, ge=1)
    add_special_tokens: bool = Field(False, description="vLLM's: the tokenizer's special tokens around the "
                                     "templated prompt too (the template writes them)")
    logprobs: Annotated[Any, WithJsonSchema({"type": ["boolean", "null"],
                                             "description": "each output token's log probability"})] = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description="with logprobs: this many most "
                                     "likely tokens at each position")
    response_format: dict[str, Any] | None = Field(None, description="{\"type\": \"text\"} (the default), "
                                                   "\"json_object\", or \"json_schema\" with json_schema.name and "
                                                   ".schema: the output constrained to JSON (engines that sample "
                                                   "from logits, as vLLM; the sim engine refuses it)")
    tools: list[Tool] | None = Field(None, description="functions the model may call; they reach the chat template")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, validate_default=True, description="required: the answer is one or more calls of the tools; a named "
        "function: a call of it (both constrain the output to the call's JSON, on engines that sample from logits, "
        "as vLLM); none: text; auto (the default with tools): the model chooses, its calls found by the "
        "cluster's tool_call_parser (a 400 where none is configured)")
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = Field(None, description="false: a required tool choice answers one call")
    audio: dict[str, Any] | None = None
    modalities: list[str] | None = None
    prediction: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    moderation: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, v: Any) -> bool:
        if v is None:
            return False
        if not isinstance(v, bool):
            raise ValueError("logprobs is true or false (top_logprobs says how many alternatives)")
        return v

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return v

    def logprob_count(self) -> int | None:
        """The top alternatives per output token the answer lists (None: no logprobs)."""
        return (self.top_logprobs or 0) if self.logprobs else None

    @field_validator("response_format")
    @classmethod
    def _response_format(cls, v: dict[str, Any] | None, info: ValidationInfo) -> dict[str, Any] | None:
        if structured_output(v) is not None and info.data.get("structured_outputs") is not None:  # raises if bad
            raise ValueError("a JSON response_format and structured_outputs cannot both shape the answer; send one "
                             "of them")
        return v

    @field_validator("messages", mode="before")
    @classmethod
    def _few_messages(cls, v: Any) -> Any:
        return at_most_items(v, "messages")

    @field_validator("tools", mode="before")
    @classmethod
    def _few_tools(cls, v: Any) -> Any:
        return at_most(v, MAX_TOOLS, "tools")

    @field_validator("tools")
    @classmethod
    def _tools(cls, v: list[Tool] | None) -> list[Tool] | None:
        if v is None:
            return v
        if not v:
            raise ValueError("tools must not be empty: send at least one tool, or omit the field")
        names = [t.function.name for t in v]
        if len(set(names)) != len(names):
            raise ValueError(f"tools name a function twice: {sorted(n for n in set(names) if names.count(n) > 1)}")
        return v

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, v: str | NamedToolChoice | None, info: ValidationInfo) -> str | NamedToolChoice:
        tools = info.data.get("tools")
        if v is None:
            v = "auto" if tools else "none"
        if v == "none":
            return v
        if not tools:
            raise ValueError("tool_choice needs tools")
        if structured_output(info.data.get("response_format")) is not None:
            raise ValueError("a tool_choice other than none and a JSON response_format cannot both shape the "
                             "answer; send one of them")
        if info.data.get("structured_outputs") is not None and v != "auto":
            raise ValueError("a tool_choice that forces a call and structured_outputs cannot both shape the "
                             "answer; send one of them")
        if v == "auto":  # the ingress refuses it where no tool_call_parser is configured
            return v
        if isinstance(v, NamedToolChoice) and v.function.name not in (names := [t.function.name for t in tools]):
            raise ValueError(f"tool_choice names function {v.function.name!r}, which is not in tools ({names})")
        calls_schema(tools, info.data.get("parallel_tool_calls"))  # raises naming a clash of $defs
        return v

    def tool_mode(self) -> tuple[str, str] | None:
        """How the answer's tool calls come (router/tool_calls.py): (NAMED, the function) and
        (REQUIRED, "") constrain the output to the call's JSON; (AUTO, "") leaves the model to
        choose and the tool-call parser to find its calls; None (tool_choice none): text."""
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice):
            return NAMED, choice.function.name
        return (choice, "") if choice in (REQUIRED, AUTO) else None

    def output_constraint(self) -> tuple[dict[str, Any] | None, str]:
        """The engine's output constraint and the parameter it came from: a forced tool call's JSON
        Schema (``calls_schema``, or the named function's arguments; ``tool_choice``), else
        ``structured_outputs``, else ``response_format``'s (the validators allow only one)."""
        mode = self.tool_mode()
        if mode is None or mode[0] == AUTO:
            if self.structured_outputs is not None:
                return super().output_constraint()
            return structured_output(self.response_format), "response_format"
        tools = self.tools or []
        if mode[0] == REQUIRED:
            return {"json": calls_schema(tools, self.parallel_tool_calls)}, "tool_choice"
        return {"json": _params(next(t.function for t in tools if t.function.name == mode[1]))}, "tool_choice"


class TokenizeRequest(_Text, _TemplateOptions):
    """``POST /tokenize`` (vLLM's route): the token ids this server sends the engine for a
    completion's ``prompt`` (with the tokenizer's special tokens, a BOS for Llama's, as the
    completions route sends it by default), or for a chat's ``messages`` and ``tools`` as the chat
    template renders them (no more special tokens, as chat's default); ``add_special_tokens`` says
    otherwise, as on those routes; ``return_token_strs`` adds each token's text. A text over the
    context is a 400, as on the generation routes."""

    # prompt or messages, never both: absent rather than null, so the schema's oneOf says it
    model_config = ConfigDict(json_schema_extra={"oneOf": [
        {"required": ["prompt"], "not": {"anyOf": [{"required": [k]} for k in (
            "messages", "tools", *_TemplateOptions.model_fields)]}},
        {"required": ["messages"], "not": {"required": ["prompt"]}}]})

    model: str | None = None
    prompt: str = Field(None, min_length=1)  # type: ignore[assignment]
    messages: list[ChatMessage] = Field(None, min_length=1)  # type: ignore[assignment]
    tools: list[Tool] = Field(None)  # type: ignore[assignment]
    return_token_strs: StrictBool = False
    add_special_tokens: StrictBool = Field(None, description="the tokenizer's special tokens around the text "  # type: ignore[assignment]
                                           "(default: true for a prompt, false for messages)")

    def special_tokens(self) -> bool:
        """``add_special_tokens``, or its default for the input's kind (the generation routes')."""
        return self.prompt is not None if self.add_special_tokens is None else self.add_special_tokens

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send a prompt or messages (one of them)")
        template = set(_TemplateOptions.model_fields) & self.model_fields_set
        if self.prompt is not None and (self.tools or template):
            raise ValueError(f"tools and {', '.join(sorted(template)) or 'the template options'} go with messages, "
                             "not a prompt")
        return self


class DetokenizeRequest(_Text):
    """``POST /detokenize`` (vLLM's route): the text of token ids, special tokens included (so
    ``/tokenize``'s chat ids come back as the rendered template)."""

    model: str | None = None
    tokens: list[TokenId]


class ErrorObject(BaseModel):
    """OpenAI's error object: ``error_body`` builds every one from it, and the OpenAPI schema
    documents it."""

    message: str = Field(description="what is wrong, naming the parameter or limit")
    type: str = Field(description="invalid_request_error, authentication_error, not_found_error, rate_limit_error, ...")
    param: str | None = Field(None, description="the request field at fault, when there is one")
    code: str | None = Field(None, description="model_not_found, queue_full, invalid_api_key, or none")


class ErrorResponse(BaseModel):
    """Every answer but a 200 (the body of each status ``documented_errors`` lists)."""

    error: ErrorObject


#: What each error status means on this API (the OpenAPI schema's descriptions).
ERROR_MEANINGS = {
    400: "invalid request: a bad or missing field, a refused parameter, a prompt over the context",
    401: "no API key, or an unknown one (only when API keys are configured)",
    403: "the key's tenant may not use this (only when API keys are configured)",
    404: "the model is not the one this server serves",
    408: "the body did not arrive in time (limits.body_timeout_s)",
    413: "the body is over limits.max_body_bytes",
    429: "the replicas' queues are full, or the request's class waited past its bound: retry after Retry-After",
    431: "the header block is over limits.max_header_bytes",
    500: "an internal error (a bug: the message names it)",
    503: "no replica can take the request now (overloaded, stalled or restarting): retry after Retry-After",
    504: "the engine stalled or the request timed out in the cluster: retry",
}
#: The statuses that carry a Retry-After header (seconds).
RETRY_AFTER_STATUSES = (429, 503)


def documented_errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """FastAPI ``responses=`` for a route that answers ``statuses`` besides 200: OpenAI's error
    body, the status's meaning, and Retry-After where it is sent."""
    out: dict[int | str, dict[str, Any]] = {}
    for status in statuses:
        doc: dict[str, Any] = {"model": ErrorResponse, "description": ERROR_MEANINGS[status]}
        if status in RETRY_AFTER_STATUSES:
            doc["headers"] = {"Retry-After": {"description": "seconds to wait before retrying",
                                              "schema": {"type": "integer", "minimum": 1}}}
        out[status] = doc
    return out


#: ``error_body``'s default: the code that goes with the status (``CODES``).
BY_STATUS = "by status"
KINDS = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
         404: "not_found_error", 408: "timeout_error", 413: "invalid_request_error",
         429: "rate_limit_error", 431: "invalid_request_error", 503: "service_unavailable",
         504: "timeout_error"}
CODES = {401: "invalid_api_key", 404: "model_not_found", 429: "queue_full"}


def error_body(message: str, status: int, param: str | None = None, code: str | None = BY_STATUS) -> dict[str, Any]:
    """OpenAI's error object (``code``: the status's usual code unless given, None for none)."""
    if code == BY_STATUS:
        code = CODES.get(status)
    kind = KINDS.get(status, "invalid_request_error" if 400 <= status < 500 else "server_error")
    return ErrorResponse(error=ErrorObject(message=message, type=kind, param=param, code=code)).model_dump()


async def send_error(send: Any, status: int, message: str, headers: Sequence[tuple[bytes, bytes]] = (),
                     code: str | None = BY_STATUS) -> None:
    """Answer an ASGI request with ``error_body`` (for middleware that refuses before the app
    runs)."""
    body = json.dumps(error_body(message, status, code=code)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})


def new_id(prefix: str, sep: str = "-") -> str:
    """A unique id: ``prefix``, ``sep``, 32 hex digits ("cmpl-...", "req-..."; the Responses API's
    objects take "_": "resp_...", "msg_...", "fc_...")."""
    return f"{prefix}{sep}{uuid.uuid4().hex}"


def error_text(error: dict[str, Any]) -> str:
    """A pydantic error's message as a client reads it (without pydantic's "Value error, ")."""
    return str(error.get("msg", "bad value")).removeprefix("Value error, ")


def now_s() -> int:
    return int(time.time())
