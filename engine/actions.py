"""The registry of actions: every engine operation a runner may call through a gateway.

How it works
- An engine operation becomes an action by decorating it where it is defined:

      @action("receipts.claim", params={"run": RUN_REF, "key": STR, ...}, result=CLAIM)
      async def claim(port, run, key, *, reclaim_running=False): ...

  The decorator records an `Action` (name, the undecorated function, its signature, one codec
  per parameter and one for the result, its server-side deadline) and returns a thin wrapper:
  called with a `RemotePort` (an `engine.gateway.Gateway`; its settings say `remote`) the
  wrapper hands the call to it,
  which sends the action over HTTP; called with any other port it runs the function. So one
  definition is both sides: the gateway server dispatches from this registry and the client
  sends from it, and an operation cannot exist on one side only.
- `local` names parameters that never travel (a callback such as `on_diagnostics`); the
  client's handling of the action deals with them. `context` names parameters that never
  travel either but that the server fills from the request: `minting` (the verified token's
  claims and the DSN a database session's URL is built on, `sessions.minting.MintContext`) and
  `only_runs` (the token's `runs` claim: an action that finds or lists runs by something else
  than their ids keeps to these); a direct call leaves them None. Every other parameter after the port must have a
  codec (checked at import).
- `actions()` imports the modules that define actions (`ACTION_MODULES`) and returns the
  registry, filled once at import time and never changed afterwards.
- `routes_remote(remote)` routes a port-taking function that is no action of its own the same
  way: through a `RemotePort` the call goes to `remote` (a form made of actions, or the answer
  of a direct-port shortcut a remote port goes without), through any other port to the
  function. So no domain function asks which kind of port it was given.
- A new operation: decorate it, and add its module to `ACTION_MODULES` if it is a new one;
  the registry walk in the tests fails for a public port-taking operation that is not an action.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from typing import Any, Awaitable, Callable, Mapping, TypeVar

import attrs

from .values.codecs import Codec
from .errors import InvalidInputError
from .ports import Port, PortSettings

F = TypeVar("F", bound=Callable[..., Awaitable[Any]])
G = TypeVar("G", bound=Callable[..., Any])

DEFAULT_DEADLINE_S = 30.0
ACTION_MODULES = (
    "runplane.engine.runs.registry",
    "runplane.engine.receipts",
    "runplane.engine.array_input",
    "runplane.engine.sheets",
    "runplane.engine.runs.outbox",
    "runplane.engine.limits.rates",
    "runplane.engine.sessions.minting",
    "runplane.engine.runs.history",
    "runplane.engine.runs.outages",
    "runplane.engine.runs.row_calls",
    "runplane.engine.runs.cancel",
    "runplane.engine.runs.retry_spec",
    "runplane.engine.shared.maps",
    "runplane.engine.shared.leases",
    "runplane.engine.shared.units",
)

_REGISTRY: dict[str, "Action"] = {}


class RemotePort:
    """Base of ports that run engine operations elsewhere (a gateway client): their settings
    say `remote=True`, which is what the action layer routes by.

    A subclass implements `send_action(action, args, kwargs)`: `args` and `kwargs` are the
    call's arguments after the port, exactly as the caller passed them.
    """

    org_id: str
    # A subclass's own settings replace these (a gateway's carry its token's plays).
    settings: PortSettings = PortSettings("remote", remote=True)

    async def send_action(self, action: "Action", args: tuple, kwargs: dict) -> Any:
        raise NotImplementedError


@attrs.frozen
class Action:
    """One registered operation: what travels, what comes back, and how long a server lets it run."""

    name: str
    function: Callable[..., Awaitable[Any]] = attrs.field(repr=False)
    signature: inspect.Signature = attrs.field(repr=False)
    params: Mapping[str, Codec] = attrs.field(repr=False)
    result: Codec = attrs.field(repr=False)
    local: tuple[str, ...] = ()
    deadline_s: float = DEFAULT_DEADLINE_S
    writes: bool = True
    context: tuple[str, ...] = ()

    def bind(self, args: tuple, kwargs: dict) -> dict[str, Any]:
        """The call's arguments by name (the port excluded), as the caller passed them."""
        try:
            bound = self.signature.bind(None, *args, **kwargs)
        except TypeError as exc:
            raise InvalidInputError(f"{self.name}: {exc}") from None
        arguments = dict(bound.arguments)
        arguments.pop(next(iter(self.signature.parameters)))
        return arguments

    def encode_input(self, arguments: Mapping[str, Any]) -> dict[str, Any]:
        """The JSON object of an action's input (omitted arguments stay omitted)."""
        return {name: self.params[name].encode(value, name)
                for name, value in arguments.items() if name in self.params}

    def decode_input(self, body: Any) -> dict[str, Any]:
        """Keyword arguments for `function` from a JSON object; `InvalidInputError` if malformed."""
        if type(body) is not dict:
            raise InvalidInputError(f"{self.name}: the input must be a JSON object")
        unknown = body.keys() - self.params.keys()
        if unknown:
            raise InvalidInputError(f"{self.name}: unknown input fields {sorted(unknown)}")
        kwargs = {name: self.params[name].decode(value, name) for name, value in body.items()}
        missing = [name for name, parameter in self.signature.parameters.items()
                   if name in self.params and parameter.default is inspect.Parameter.empty
                   and name not in kwargs]
        if missing:
            raise InvalidInputError(f"{self.name}: missing input fields {missing}")
        return kwargs


def action(
    name: str, *, params: Mapping[str, Codec], result: Codec, local: tuple[str, ...] = (),
    deadline_s: float = DEFAULT_DEADLINE_S, writes: bool = True, context: tuple[str, ...] = (),
) -> Callable[[F], F]:
    """Register the decorated `async def op(port, ...)` as action `name` (see the module doc)."""

    def register(function: F) -> F:
        signature = inspect.signature(function)
        rest = list(signature.parameters)[1:]
        uncovered = [p for p in rest if p not in params and p not in local and p not in context]
        if uncovered or set(params) - set(rest):
            raise TypeError(f"action {name}: parameters {rest} vs codecs {sorted(params)}")
        if name in _REGISTRY:
            raise TypeError(f"action {name} is registered twice")
        spec = Action(name, function, signature, dict(params), result, tuple(local),
                      deadline_s, writes, tuple(context))
        _REGISTRY[name] = spec

        @functools.wraps(function)
        async def routed(port: Port, *args: Any, **kwargs: Any) -> Any:
            if port.settings.remote:
                return await port.send_action(spec, args, kwargs)  # type: ignore[attr-defined]
            return await function(port, *args, **kwargs)

        routed.action = spec  # type: ignore[attr-defined]
        return routed  # type: ignore[return-value]

    return register


def routes_remote(remote: Callable[..., Any]) -> Callable[[G], G]:
    """Route the decorated `op(port, ...)` as `action` routes an action: through a `RemotePort`
    the call goes to `remote(port, ...)` with the same arguments, through any other port to
    `op`. For port-taking functions that are no action themselves: an entry point whose
    remote form sends an action (a `SheetWrite`'s admission), or a direct-port shortcut a
    remote port answers without (a recorded list, a `COPY`)."""

    def route(function: G) -> G:
        if inspect.iscoroutinefunction(function):
            @functools.wraps(function)
            async def routed_async(port: Port, *args: Any, **kwargs: Any) -> Any:
                if port.settings.remote:
                    return await remote(port, *args, **kwargs)
                return await function(port, *args, **kwargs)

            return routed_async  # type: ignore[return-value]

        @functools.wraps(function)
        def routed(port: Port, *args: Any, **kwargs: Any) -> Any:
            if port.settings.remote:
                return remote(port, *args, **kwargs)
            return function(port, *args, **kwargs)

        return routed  # type: ignore[return-value]

    return route


def actions() -> Mapping[str, Action]:
    """Every registered action by name (importing the modules that define them)."""
    for module in ACTION_MODULES:
        importlib.import_module(module)
    return dict(_REGISTRY)
