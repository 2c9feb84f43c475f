"""botocore: one data loader for every session the local runtime makes, and one set of client
methods per service model.

Each boto3 session builds its own loader, which reads and parses the service models (JSON,
megabytes for SageMaker) again; the emulated stack makes two sessions (its own, and the
functions' `wiring.deps()`) every time it starts, ~0.2 s of model parsing each. While the
patches are installed, sessions share one loader per data path, as the clients of one
session already share theirs; the models are the same files, read once.

Each client class is built with a method per operation of its service (SageMaker has
hundreds), and botocore builds them again for every client: a third of the time the
emulated stack took to make its clients, which it does each time it starts. The methods
depend only on the service model (each calls `self._make_api_call` with its operation's
name), and with the shared loader every client of a service reads the same model
document; so they are built once per document, and every class gets a copy of that
mapping, which the `creating-client-class` handlers may still extend as they do now. Each
client keeps its own event emitter, configuration and endpoint.

Each client's event emitter also maps every event name it emits through botocore's aliases
(`_alias_event_name`: a split and a search per alias, two dozen of them), remembering the
answers in a cache of its own, which every new client starts empty. The answer depends only
on the aliases, so emitters with botocore's own share one cache.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

import botocore.client
import botocore.hooks
import botocore.session

from ._core import replace

_ORIGINAL_CREATE_LOADER = botocore.session.create_loader
_ORIGINAL_CREATE_METHODS = botocore.client.ClientCreator._create_methods
_ORIGINAL_ALIASER_INIT = botocore.hooks.EventAliaser.__init__
_DEFAULT_ALIASES = dict(botocore.hooks.EVENT_ALIASES)
_DEFAULT_ALIAS_NAMES: dict[str, str] = {}  # event name -> its name under botocore's own aliases

# (service name, id of its model document) -> (that document, its methods)
_METHODS: dict[tuple[str, int], tuple[dict, dict[str, Any]]] = {}
_METHODS_LOCK = threading.Lock()


@functools.lru_cache(maxsize=4)
def _shared_loader(search_path_string: str | None = None):
    return _ORIGINAL_CREATE_LOADER(search_path_string)


def _shared_methods(creator: Any, service_model: Any) -> dict[str, Any]:
    document = service_model._service_description
    key = (service_model.service_name, id(document))
    with _METHODS_LOCK:
        found = _METHODS.get(key)
        if found is None or found[0] is not document:  # the document itself is kept: its id is never reused
            found = _METHODS[key] = (document, _ORIGINAL_CREATE_METHODS(creator, service_model))
    return dict(found[1])


def _aliaser_init(self: Any, event_emitter: Any, event_aliases: dict | None = None) -> None:
    _ORIGINAL_ALIASER_INIT(self, event_emitter, event_aliases)
    if self._event_aliases == _DEFAULT_ALIASES:  # a copy's aliases are a copy of the same
        self._alias_name_cache = _DEFAULT_ALIAS_NAMES


def patch() -> None:
    replace(botocore.session, "create_loader", _shared_loader)
    replace(botocore.client.ClientCreator, "_create_methods", _shared_methods)
    replace(botocore.hooks.EventAliaser, "__init__", _aliaser_init)
