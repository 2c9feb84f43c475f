"""botocore, while the patches are installed: one data loader for every session, one set of
client methods per service model, one event-alias cache, requests signed with their scope
only, a User-Agent built once per client and features, and moto's list of each response
class's actions made once. Costs, not gaps: what moto answers is the same.

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

Every request is signed (Signature Version 4: a canonical request, its hash and four HMACs,
through the CRT where awscrt is installed), and moto checks no signature: of the
Authorization header it reads the access key (the account) and the credential scope's
region. While the patches are installed, a request of a service signed with plain SigV4 gets
that header with those parts and a signature of zeros. S3's signers (the payload's hash, and
the chunked uploads moto decodes by their content header) and every other kind sign as
before. A client without credentials still fails as it would (NoCredentialsError).

Every request also builds its User-Agent header anew (each component sanitized character
by character): the same string for a client whose features (its own, and those the
request's context adds, a paginator's say) are the same, so it is kept per client and set
of features. And moto, for every request, lists the functions of the service's response
class (`inspect.getmembers`) to find the action's; the list is kept per class while the
patches are installed (they change those classes only as they are installed).

A client also builds its own view of its service's model (its operations and shapes,
resolved as they are first used) and its own endpoint rules (a tree of objects parsed from
the ruleset document): more than half of what a new client costs. Both are read-only once
built, and the clients of a session already share them across threads; so each is built
once per model document (and, for the rules, the partitions document and the parameters
S3 leaves out), and every client of the service shares it. And every handler registered
on an event emitter is checked to take keyword arguments (`inspect.getfullargspec`); the
answer is kept per function, weakly.
"""

from __future__ import annotations

import datetime
import functools
import threading
import weakref
from typing import Any

import botocore.auth
import botocore.client
import botocore.context
import botocore.exceptions
import botocore.hooks
import botocore.model
import botocore.regions
import botocore.session
import botocore.useragent
import moto.core.responses

from ._core import replace

_ORIGINAL_CREATE_LOADER = botocore.session.create_loader
_ORIGINAL_CREATE_METHODS = botocore.client.ClientCreator._create_methods
_ORIGINAL_ALIASER_INIT = botocore.hooks.EventAliaser.__init__
_DEFAULT_ALIASES = dict(botocore.hooks.EVENT_ALIASES)
_DEFAULT_ALIAS_NAMES: dict[str, str] = {}  # event name -> its name under botocore's own aliases
_ZERO_SIGNATURE = "0" * 64
_ORIGINAL_USER_AGENT = botocore.useragent.UserAgentString.to_string
_ORIGINAL_METHOD_NAMES = moto.core.responses.method_names_from_class
_METHOD_NAMES: dict[type, list[str]] = {}
_ORIGINAL_ACCEPTS_KWARGS = botocore.hooks.accepts_kwargs
_ACCEPTS_KWARGS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_ENDPOINT_PROVIDER = botocore.regions.EndpointProvider
_UNKNOWN = object()

# Read-only views built once per document (kept in the value: an id is never reused while
# its object lives): (service name, id of its model) -> (model, its ServiceModel); (ids of
# the ruleset and partitions, parameters left out) -> (ruleset, partitions, EndpointProvider)
_MODELS: dict[tuple[str, int], tuple[dict, Any]] = {}
_PROVIDERS: dict[tuple[int, int, frozenset], tuple[dict, dict, Any]] = {}

# (service name, id of its model document) -> (that document, its methods)
_METHODS: dict[tuple[str, int], tuple[dict, dict[str, Any]]] = {}
_METHODS_LOCK = threading.Lock()


@functools.lru_cache(maxsize=4)
def shared_loader(search_path_string: str | None = None):
    return _ORIGINAL_CREATE_LOADER(search_path_string)


def _shared_methods(creator: Any, service_model: Any) -> dict[str, Any]:
    document = service_model._service_description
    key = (service_model.service_name, id(document))
    with _METHODS_LOCK:
        found = _METHODS.get(key)
        if found is None or found[0] is not document:  # the document itself is kept: its id is never reused
            found = _METHODS[key] = (document, _ORIGINAL_CREATE_METHODS(creator, service_model))
    return dict(found[1])


def _shared_service_model(creator: Any, service_name: str, api_version: str | None = None) -> Any:
    document = creator._loader.load_service_model(service_name, "service-2", api_version=api_version)
    key = (service_name, id(document))
    with _METHODS_LOCK:
        found = _MODELS.get(key)
        if found is None or found[0] is not document:
            found = _MODELS[key] = (document, botocore.model.ServiceModel(document, service_name=service_name))
    return found[1]


def _shared_endpoint_provider(ruleset_data: dict, partition_data: dict, excluded_params: Any = None) -> Any:
    left_out = frozenset(excluded_params or ())
    key = (id(ruleset_data), id(partition_data), left_out)
    with _METHODS_LOCK:
        found = _PROVIDERS.get(key)
        if found is None or found[0] is not ruleset_data or found[1] is not partition_data:
            provider = _ENDPOINT_PROVIDER(ruleset_data=ruleset_data, partition_data=partition_data, excluded_params=excluded_params)
            found = _PROVIDERS[key] = (ruleset_data, partition_data, provider)
    return found[2]


def _accepts_kwargs(func: Any) -> Any:
    target = getattr(func, "__func__", func)  # a bound method: its function's signature
    with _METHODS_LOCK:
        try:
            found = _ACCEPTS_KWARGS.get(target, _UNKNOWN)
        except TypeError:  # not weakly referable: asked each time
            found = None
            target = None
    if found is _UNKNOWN or target is None:
        found = _ORIGINAL_ACCEPTS_KWARGS(func)
        if target is not None:
            with _METHODS_LOCK:
                _ACCEPTS_KWARGS[target] = found
    return found


def _aliaser_init(self: Any, event_emitter: Any, event_aliases: dict | None = None) -> None:
    _ORIGINAL_ALIASER_INIT(self, event_emitter, event_aliases)
    if self._event_aliases == _DEFAULT_ALIASES:  # a copy's aliases are a copy of the same
        self._alias_name_cache = _DEFAULT_ALIAS_NAMES


def _header_signers() -> list[type]:
    """The plain SigV4 header signers: botocore's, and the CRT's where awscrt is installed."""
    signers: list[type] = [botocore.auth.SigV4Auth]
    try:
        from botocore.crt.auth import CrtSigV4Auth
    except ImportError:  # no awscrt: botocore signs in Python
        return signers
    return [*signers, CrtSigV4Auth]


def _scope_only(original: Any, signer: type) -> Any:
    def add_auth(self: Any, request: Any) -> None:
        if type(self) is not signer:  # S3's and the others' subclasses sign as before
            return original(self, request)
        if self.credentials is None:
            raise botocore.exceptions.NoCredentialsError()
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        for header in ("Authorization", "X-Amz-Date", "X-Amz-Security-Token"):
            if header in request.headers:
                del request.headers[header]  # a retry's earlier signature
        request.headers["X-Amz-Date"] = stamp
        if self.credentials.token:
            request.headers["X-Amz-Security-Token"] = self.credentials.token
        scope = f"{self.credentials.access_key}/{stamp[:8]}/{self._region_name}/{self._service_name}/aws4_request"
        request.headers["Authorization"] = (
            f"AWS4-HMAC-SHA256 Credential={scope}, SignedHeaders=host;x-amz-date, Signature={_ZERO_SIGNATURE}"
        )

    return add_auth


def _user_agent(self: Any) -> str:
    context = botocore.context.get_context()
    features = frozenset(self._client_features or ()).union(() if context is None else context.features)
    strings = self.__dict__.setdefault("_preemptor_strings", {})
    found = strings.get(features)
    if found is None:
        found = strings[features] = _ORIGINAL_USER_AGENT(self)
    return found


def _method_names(clazz: type) -> list[str]:
    found = _METHOD_NAMES.get(clazz)
    if found is None:
        found = _METHOD_NAMES[clazz] = _ORIGINAL_METHOD_NAMES(clazz)
    return found


def patch() -> None:
    _METHOD_NAMES.clear()  # listed under the patches installed before this one
    replace(botocore.useragent.UserAgentString, "to_string", _user_agent)
    replace(moto.core.responses, "method_names_from_class", _method_names)
    replace(botocore.session, "create_loader", shared_loader)
    replace(botocore.client.ClientCreator, "_create_methods", _shared_methods)
    replace(botocore.client.ClientCreator, "_load_service_model", _shared_service_model)
    replace(botocore.regions, "EndpointProvider", _shared_endpoint_provider)
    replace(botocore.hooks, "accepts_kwargs", _accepts_kwargs)
    replace(botocore.hooks.EventAliaser, "__init__", _aliaser_init)
    for signer in _header_signers():
        replace(signer, "add_auth", _scope_only(signer.__dict__["add_auth"], signer))
