"""The server's request policy: whose requests it takes (keys), which model a request's
name stands for (aliases, --any-model), and what it says of the fields it does not act
on (named in a header and the log, or a 400 with --strict), the thinking fields among them.
"""

from __future__ import annotations

import logging
from typing import Mapping, Optional

from fastapi import Request

from ..errors import SettingsError
from ..options import registry
from ..prompt.render import thinking_switch
from ..values import EFFORTS
from .catalog import checkpoint, untagged
from .errors import ApiError
from .fields import unused
from .guard import key_accepted

log = logging.getLogger(__name__)
LOGGED_FIELDS = 256  # distinct field names logged, at most (a client could invent any number)


class RequestPolicy:
    """Keys, model names and ignored fields, the same for every API."""

    def __init__(self, *, default_model: Optional[str] = None, api_key: Optional[str] = None,
                 secret: Optional[str] = None, strict: bool = False, aliases: Optional[dict[str, str]] = None,
                 any_model: bool = False) -> None:
        self.default_model = default_model
        self.api_key, self.secret = api_key, secret
        self.strict = strict  # an undeclared field is a 400 (fields.py)
        self.aliases = dict(aliases or {})  # a client's model name -> a model served here
        self.any_model = any_model  # every other unknown name: the default model
        self._logged: set[str] = set()  # fields named in the log already
        self._thinks: dict[str, bool] = {}  # model id -> whether its template has a thinking switch
        self._takes_images: dict[str, bool] = {}  # model id -> whether its checkpoint takes images

    # -- keys -----------------------------------------------------------------------
    async def check_api_key(self, request: Request) -> None:
        """A dependency of every route but /health; async, so no request borrows a worker thread for it."""
        if self.api_key is None:
            return
        if not key_accepted(request.headers, (self.api_key, self.secret)):
            raise ApiError(401, "missing or wrong API key: send Authorization: Bearer KEY (or x-api-key: KEY)",
                           code="invalid_api_key")

    # -- names ----------------------------------------------------------------------
    def model_for(self, name: Optional[str]) -> str:
        """The model id a request's model name stands for (through --model-alias, or with
        --any-model the default model for any name); 404 when none is served. `name:latest`
        is `name`, as in Ollama, whose clients add the tag."""
        default = self.default_model or registry.MODEL_PREFIX
        name = untagged(name)
        name = self.aliases.get(name, name) or default
        try:
            return registry.model_id_for(name)
        except SettingsError:
            if self.any_model:  # the reply names the model that answered
                return registry.model_id_for(registry.default_name() if default == registry.MODEL_PREFIX else default)
            raise ApiError(404, f"the model {name!r} is not served here; see /v1/models (or serve with "
                           "--model-alias NAME=MODEL or --any-model)", code="model_not_found", param="model") from None

    @staticmethod
    def name_of(model_id: str) -> Optional[str]:
        return registry.name_of(model_id)

    def thinks(self, model_id: str) -> bool:
        """Whether the model's chat template has a thinking switch (prompt/render.thinking_switch)."""
        if model_id not in self._thinks:
            found = checkpoint(model_id)
            self._thinks[model_id] = found is not None and thinking_switch(found.template) is not None
        return self._thinks[model_id]

    def takes_images(self, model_id: str) -> bool:
        """Whether the model's checkpoint is a vision-language model's."""
        if model_id not in self._takes_images:
            self._takes_images[model_id] = registry.takes_images(self.name_of(model_id))
        return self._takes_images[model_id]

    # -- fields ---------------------------------------------------------------------
    def accept(self, request: Request, body) -> None:
        """Name the fields of `body` this server does not act on (fields.py); in --strict,
        an undeclared one is a 400."""
        hints, unknown = unused(body)
        if unknown and self.strict:
            raise ApiError(400, f"{unknown[0]}: not a field this server knows (served with --strict; "
                           "docs/server.md lists the fields)", param=unknown[0])
        self.ignore(request, hints + unknown)

    def ignore(self, request: Request, names: list[str]) -> None:
        """`names` were not acted on: the response's header says so, and the log once each."""
        if not names:
            return
        state = request.scope.setdefault("state", {})
        state["ignored"] = [*state.get("ignored", []), *(n for n in names if n not in state.get("ignored", []))]
        for name in names:
            if name not in self._logged and len(self._logged) < LOGGED_FIELDS:
                self._logged.add(name)
                log.warning("mlx-stream: %s %r: accepted, not acted on", request.url.path, name)

    def unswitched(self, request: Request, model_id: str, fields: dict, spelled: Mapping[str, str] = {}) -> None:
        """Whether the request's thinking fields apply, decided here for every API (`spelled`:
        the request's own names for the plugin's, named back so). A thinking switch for a model
        whose template has none is accepted and named, as clients send it to every model, and
        so is a reasoning effort no template reads (the Responses API takes any). A budget
        stays: a model that always reasons (its generation prompt opens the block) is held to
        it, and one that never does has nothing for it to close (reply/build.py)."""
        named = [spelled.get(name, name) for name in ("thinking", "reasoning_effort")]
        if fields.get("reasoning_effort") not in (None, *EFFORTS):
            del fields["reasoning_effort"]
            self.ignore(request, named[1:])
        if not self.thinks(model_id):
            if fields.pop("thinking", None):
                self.ignore(request, named[:1])
            if fields.pop("reasoning_effort", None) not in (None, "none", "minimal"):
                self.ignore(request, named[1:])
