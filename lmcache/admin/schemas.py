"""Request bodies of the admin API, parsed and validated strictly (types, sizes, unknown fields).

A bad field is answered 422 with the field's path in ``error`` (see
:func:`lmcache.admin.server.create_app`); a request naming something that does not
exist (an unknown instance) is answered 404, one that cannot be served as asked 400.

:func:`parse_body` does the parsing and validation and is meant to run on a worker
thread (a body can be up to 16 MB): it never produces more than a bounded number of
errors, whatever the body (a million bad token ids are one error, not a million).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainValidator,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
    model_validator,
)
from pydantic_core import PydanticCustomError

from lmcache.integration.vllm.worker_admin import MAX_ACTIVE_PINS, MAX_PIN_TTL_S, PIN_ID_RE

MAX_TOKENS = 1_000_000
MAX_PROMPT_CHARS = 8_000_000
MAX_TTL_S = MAX_PIN_TTL_S
"""Longest ``/pin`` ttl in seconds (the workers' own bound)."""
MAX_PIN_IDS = 16 * MAX_ACTIVE_PINS
"""Most pin ids in one ``/unpin`` (one per rank and pin)."""
MAX_ERRORS = 20
"""Errors listed in a 422 answer's ``detail``."""
TOKEN_LIMIT = 2**31


def _token_ids(value: Any) -> list[int]:
    """A list of at most :data:`MAX_TOKENS` ints in [0, 2**31): one error for the first bad item."""
    if not isinstance(value, list):
        raise PydanticCustomError("token_ids", "expected a list of token ids, got {kind}",
                                  {"kind": type(value).__name__})
    if len(value) > MAX_TOKENS:
        raise PydanticCustomError("token_ids", "{count} token ids; expected at most {limit}",
                                  {"count": len(value), "limit": MAX_TOKENS})
    for i, tok in enumerate(value):
        if type(tok) is not int or not 0 <= tok < TOKEN_LIMIT:
            raise PydanticCustomError("token_id", "expected an integer token id in [0, 2**31), got {value}",
                                      {"index": i, "value": repr(tok)[:40]})
    return value


TokenIds = Annotated[list[int], PlainValidator(_token_ids)]
Name = Annotated[StrictStr, Field(min_length=1, max_length=512)]
PinId = Annotated[StrictStr, Field(pattern=f"^{PIN_ID_RE.pattern}$", max_length=64)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class _Prompt(_Body):
    prompt: Annotated[StrictStr, Field(max_length=MAX_PROMPT_CHARS)] | None = None
    """Text, tokenized with each instance's tokenizer (as vLLM's completions API does)."""
    tokens: TokenIds | None = None
    """Token ids, used as they are for every instance."""

    @model_validator(mode="after")
    def _one_of(self) -> _Prompt:
        if (self.prompt is None) == (self.tokens is None):
            raise ValueError("prompt, tokens: expected exactly one of them")
        return self


class LookupBody(_Prompt):
    model: Name | None = None
    """Only instances serving this model (the name or path given to vLLM, or the namespace)."""
    instance: Name | None = None
    """Only this instance (its id, as ``GET /instances`` lists it)."""


class ClearBody(_Body):
    instance: Name | None = None
    """The instance to clear (None: every instance this service sees)."""
    local: StrictBool = True
    """Clear the instances' local tiers (CPU, disk) over their lookup sockets."""
    remote: StrictBool = False
    """Delete remote entries: the instance's namespace, or (no instance) every KV entry under the key prefix."""
    unpin: StrictBool = False
    """With ``local``: release the instances' admin pins first, so their entries are cleared too."""

    @model_validator(mode="after")
    def _something(self) -> ClearBody:
        if not self.local and not self.remote:
            raise ValueError("local, remote: expected at least one of them true")
        if self.unpin and not self.local:
            raise ValueError("unpin, local: unpin releases pins of the local tiers; expected local true")
        return self


class PinBody(_Prompt):
    instance: Name
    ttl: Annotated[StrictFloat | StrictInt, Field(gt=0, le=MAX_TTL_S)]
    """Seconds the chunks stay pinned in the instance's CPU tier."""


class UnpinBody(_Body):
    instance: Name
    pin_ids: Annotated[list[PinId], Field(min_length=1, max_length=MAX_PIN_IDS)] | None = None
    """The pins to release (as ``/pin`` returned them); None: every admin pin of the instance."""


class InvalidBody(ValueError):
    """A request body that is not valid JSON or does not fit its schema (422).

    ``details``: at most :data:`MAX_ERRORS` ``{"field": "<path>", "msg": "<why>"}``."""

    def __init__(self, details: list[dict[str, str]]) -> None:
        self.details = details
        super().__init__("; ".join(f"{d['field']}: {d['msg']}" for d in details) or "body: invalid request body")


def _field_path(error: dict[str, Any]) -> str:
    loc = [str(p) for p in error.get("loc", ())]
    ctx = error.get("ctx") or {}
    if error.get("type") == "token_id" and "index" in ctx:
        loc.append(str(ctx["index"]))
    return ".".join(loc) or "body"


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


Body = TypeVar("Body", bound=_Body)


def parse_body(model: type[Body], raw: bytes) -> Body:
    """``raw`` (a JSON object) validated as ``model``; :class:`InvalidBody` otherwise.

    Called on a request thread (not the event loop); blocks for the parse only."""
    try:
        data = json.loads(raw, parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, bad UTF-8, NaN, huge ints, deep nesting
        if isinstance(exc, RecursionError):
            msg = "nested too deeply"
        else:
            msg = exc.msg if isinstance(exc, json.JSONDecodeError) else str(exc)[:200]
        raise InvalidBody([{"field": "body", "msg": f"expected a JSON object ({msg})"}]) from None
    if not isinstance(data, dict):
        raise InvalidBody([{"field": "body", "msg": f"expected a JSON object, got {type(data).__name__}"}])
    unknown = sorted(k for k in data if k not in model.model_fields)
    if unknown:  # checked here: pydantic would report each of up to millions of keys
        allowed = ", ".join(model.model_fields)
        raise InvalidBody([{"field": name[:80], "msg": f"unknown field (expected {allowed})"}
                           for name in unknown[:MAX_ERRORS]])
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors(include_url=False, include_input=False)[:MAX_ERRORS]
        raise InvalidBody([{"field": _field_path(e), "msg": str(e.get("msg", ""))} for e in errors]) from None
