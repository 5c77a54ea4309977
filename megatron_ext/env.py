"""Reading megatron-ext's ``MEGATRON_EXT_*`` environment variables (no torch, no megatron-core).

``MEGATRON_EXT_AUTO``, ``MEGATRON_EXT_FORCE`` and ``MEGATRON_EXT_QUIET`` are flags
(:func:`flag`); ``MEGATRON_EXT_SKIP`` is a comma-separated list (:func:`name_set`);
``MEGATRON_EXT_DIST_TIMEOUT_S`` is a number of seconds (:func:`seconds`);
``MEGATRON_EXT_ON_WEIGHT_UPDATE`` is one of a few words (:func:`choice`). The ``.pth``
start-up line parses ``MEGATRON_EXT_AUTO`` the same way without importing anything.
"""

from __future__ import annotations

import os

#: Values (case-insensitive, surrounding blanks ignored) that turn a flag on; anything else is off.
TRUE_VALUES = ("1", "true", "yes", "on")


def flag(name: str) -> bool:
    """Whether the environment variable ``name`` is set to one of :data:`TRUE_VALUES`."""
    return os.environ.get(name, "").strip().lower() in TRUE_VALUES


def name_set(name: str) -> set[str]:
    """The comma-separated names in the environment variable ``name``, blanks and empty items dropped."""
    return {item.strip() for item in os.environ.get(name, "").split(",") if item.strip()}


#: The longest timeout :func:`seconds` accepts (a week): larger values overflow ``timedelta``.
MAX_SECONDS = 7 * 24 * 3600.0


def seconds(name: str, default: float) -> float:
    """The environment variable ``name`` as seconds in (0, :data:`MAX_SECONDS`], ``default`` when unset.

    Raises:
        MegatronExtError: it is set to something that is not a positive number (named, with the fix).
    """
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value <= MAX_SECONDS:
        from .errors import MegatronExtError

        raise MegatronExtError(f"{name}={text!r} is not a number of seconds in (0, {MAX_SECONDS:.0f}]; set it to "
                               "e.g. 120 or unset it")
    return value


def choice(name: str, choices: tuple[str, ...]) -> str:
    """The environment variable ``name`` (case-insensitive, blanks stripped), one of ``choices``;
    ``choices[0]`` when unset or empty.

    Raises:
        MegatronExtError: it is set to anything else (named, with the accepted values).
    """
    text = os.environ.get(name, "").strip().lower()
    if not text:
        return choices[0]
    if text not in choices:
        from .errors import MegatronExtError

        raise MegatronExtError(f"{name}={os.environ[name]!r} is not one of {', '.join(choices)}; set it to "
                               f"one of those or unset it (default {choices[0]})")
    return text
