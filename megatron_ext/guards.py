"""Guards: a wrapper that runs only on the instances it is for, at no Python layer elsewhere.

A :class:`Guarded` wrapper declares an attribute test; :func:`guarded_function` generates the
function :func:`megatron_ext.patching.wrap_method` installs for it, with the original's own
parameter list (compiled from generated source), so an instance the test rejects goes straight to
the original with its arguments as they are. The admission path (``add_request``) carries several
patched functions per call; most of them have nothing to do for most engines (a Mamba fix on a GPT
context, an LRU fix under REF_ZERO).
"""

from __future__ import annotations

import inspect
import types
from dataclasses import dataclass
from typing import Any, Callable

from . import mcore


@dataclass(frozen=True)
class Guarded:
    """A wrapper with nothing to do unless ``getattr(instance, attribute) == value``.

    :func:`wrap_method` tests the attribute inline and otherwise calls the wrapped function
    itself, so a patch costs no Python layer of its own on the instances it leaves alone (a GPT
    context for a Mamba fix, a REF_ZERO allocator for an LRU fix). The admission path
    (``add_request``) carries several patched functions per call.

    Attributes:
        wrapper: ``wrapper(wrapped, instance, args, kwargs)``, as :meth:`Patch.wrappers` gives it.
        attribute: an attribute every instance of the target's class has (read with ``getattr``).
        value: what it must equal for ``wrapper`` to run.
    """

    wrapper: Callable
    attribute: str
    value: Any = True


def lru_only(wrapper: Callable) -> Guarded:
    """``wrapper`` guarded to run only where ``prefix_caching_eviction_policy`` is LRU (a
    ``DynamicInferenceContext`` or a ``KVBlockAllocator``: both keep the policy). Under REF_ZERO,
    megatron-core's default, the LRU fixes then cost no Python layer of their own.

    Raises:
        MegatronCoreNotFoundError: megatron-core is not importable.
    """
    lru = mcore.import_module("megatron.core.inference.config").PrefixCachingEvictionPolicy.LRU
    return Guarded(wrapper, "prefix_caching_eviction_policy", lru)


#: Set on every installed function: ``((attribute, value), function)`` for a :class:`Guarded`
#: one, the function it calls when the test fails; None for any other.
BYPASS_ATTR = "_self_megatron_ext_bypass"


def guarded_function(original: Any, guarded: Guarded) -> tuple[Callable, tuple]:
    """The function to install for a :class:`Guarded` wrapper, and its bypass (:data:`BYPASS_ATTR`).

    When ``original`` is itself a guarded wrapper with the same test (two Mamba fixes on one
    function), a failed test goes straight to what that one would call: one test per call, not
    one per patch. Safe because patches are reverted outermost first
    (:meth:`megatron_ext.patching.Patch.uninstall`).

    The function is generated with ``original``'s own parameter list (:func:`_same_signature`):
    the bypass then passes the arguments on as they are, without packing them into a tuple and a
    dict, and the test reads the attribute by name. The wrapper gets every argument but ``self``
    in ``args``, in ``original``'s order with its defaults filled in (keyword-only ones in
    ``kwargs``), which is how megatron-ext's wrappers read them anyway.
    """
    if not isinstance(original, types.FunctionType):
        raise TypeError(f"a guarded wrapper needs a plain function to wrap, not {type(original).__name__}")
    test = (guarded.attribute, guarded.value)
    inner = getattr(original, BYPASS_ATTR, None)
    passthrough = inner[1] if inner is not None and inner[0] == test else original
    if not guarded.attribute.isidentifier():
        raise ValueError(f"a guard reads an attribute by name, not {guarded.attribute!r}")
    names = {"passthrough": passthrough, "wrapper": guarded.wrapper, "bind": original.__get__,
             "value": guarded.value}
    params, call, args, kwargs = _same_signature(original, names)
    self_name = call[0] if call else ""
    if not self_name.isidentifier():  # no parameter, or *args first (a transparent decorator's
        # ``functools.wraps`` wrapper): the instance is the first argument given, as before 723e8b6
        return _generic_guard(guarded, passthrough, original.__get__), (test, passthrough)
    source = (f"def patched({', '.join(params)}):\n"
              f"    if {self_name}.{guarded.attribute} != {_NS}value:\n"
              f"        return {_NS}passthrough({', '.join(call)})\n"
              f"    return {_NS}wrapper({_NS}bind({self_name}), {self_name}, ({''.join(a + ', ' for a in args)}), "
              f"{{{', '.join(kwargs)}}})\n")
    namespace = {_NS + key: value for key, value in names.items()}
    exec(compile(source, f"<megatron-ext guard of {original.__qualname__}>", "exec"), namespace)
    return namespace["patched"], (test, passthrough)


def _generic_guard(guarded: Guarded, passthrough: Callable, bind: Callable) -> Callable:
    """The guard for a function whose own parameter list names no instance (``(*args, **kwargs)``):
    the wrapper gets the arguments as they were passed."""
    wrapper, attribute, value = guarded.wrapper, guarded.attribute, guarded.value

    def patched(self, /, *args, **kwargs):
        if getattr(self, attribute) != value:
            return passthrough(self, *args, **kwargs)
        return wrapper(bind(self), self, args, kwargs)

    return patched


#: Prefix of every name a generated function reads from its namespace (none is a parameter name).
_NS = "_megatron_ext_"


def _same_signature(function: types.FunctionType, defaults: dict[str, Any]) -> tuple[list[str], ...]:
    """``function``'s parameter list as source text, and how to pass each parameter on.

    Returns ``(params, call, args, kwargs)``: ``params`` for a ``def``, ``call`` for a call passing
    everything on unchanged, and the items of the ``args`` tuple and ``kwargs`` dict a wrapper gets
    (every parameter after the first). A default value is stored in ``defaults`` as
    ``default<index>``, read by the ``def`` as ``_NS + "default<index>"``.

    Raises:
        ValueError: a parameter name megatron-ext's generated code reserves (:data:`_NS`).
    """
    params: list[str] = []
    call: list[str] = []
    args: list[str] = []
    kwargs: list[str] = []
    star = False
    kinds = inspect.Parameter
    for index, parameter in enumerate(inspect.signature(function, follow_wrapped=False).parameters.values()):
        name = parameter.name
        if name.startswith(_NS):
            raise ValueError(f"parameter {name!r} of {function.__qualname__} starts with {_NS!r}")
        default = ""
        if parameter.default is not parameter.empty:
            defaults[f"default{index}"] = parameter.default
            default = f"={_NS}default{index}"
        if parameter.kind is kinds.VAR_POSITIONAL:
            params.append(f"*{name}")
            call.append(f"*{name}")
            args.append(f"*{name}")
            star = True
        elif parameter.kind is kinds.VAR_KEYWORD:
            params.append(f"**{name}")
            call.append(f"**{name}")
            kwargs.append(f"**{name}")
        elif parameter.kind is kinds.KEYWORD_ONLY:
            if not star:
                params.append("*")
                star = True
            params.append(name + default)
            call.append(f"{name}={name}")
            kwargs.append(f"{name!r}: {name}")
        else:
            params.append(name + default)
            call.append(name)
            if index:
                args.append(name)
            if parameter.kind is kinds.POSITIONAL_ONLY and index + 1 == function.__code__.co_posonlyargcount:
                params.append("/")
    return params, call, args, kwargs
