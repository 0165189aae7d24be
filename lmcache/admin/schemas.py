"""Request bodies of the admin API, validated strictly (types, sizes, unknown fields).

A bad field is answered 422 with the field's path in ``error`` (see
:func:`lmcache.admin.server.create_app`); a request naming something that does not
exist (an unknown instance) is answered 404, one that cannot be served as asked 400.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, model_validator

MAX_TOKENS = 1_000_000
MAX_PROMPT_CHARS = 8_000_000
MAX_TTL_S = 24 * 3600.0

TokenId = Annotated[StrictInt, Field(ge=0, lt=2**31)]
Name = Annotated[StrictStr, Field(min_length=1, max_length=512)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class _Prompt(_Body):
    prompt: Annotated[StrictStr, Field(max_length=MAX_PROMPT_CHARS)] | None = None
    """Text, tokenized with each instance's tokenizer (as vLLM's completions API does)."""
    tokens: Annotated[list[TokenId], Field(max_length=MAX_TOKENS)] | None = None
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

    @model_validator(mode="after")
    def _something(self) -> ClearBody:
        if not self.local and not self.remote:
            raise ValueError("local, remote: expected at least one of them true")
        return self


class PinBody(_Prompt):
    instance: Name
    ttl: Annotated[StrictFloat | StrictInt, Field(gt=0, le=MAX_TTL_S)]
    """Seconds the chunks stay pinned in the instance's CPU tier."""
