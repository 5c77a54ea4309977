"""``import megatron_ext.auto`` applies every runtime patch the installed megatron-core needs.

One line per patch goes to stderr saying what was done (``MEGATRON_EXT_QUIET=1`` silences
applied / not-needed lines; refusals are always printed). A refusal does not raise: the job goes
on with megatron-core unpatched and the line says why; use ``megatron_ext.apply(strict=True)`` to
fail instead. An unsupported megatron-core release is one such line, and nothing is applied. A
``MEGATRON_EXT_SKIP`` that names no patch does raise (``MegatronExtError``): a typo must not leave
in a patch the job meant to leave out.
"""

from .announce import announce, apply_announced

RESULTS = apply_announced()
announce(RESULTS)
