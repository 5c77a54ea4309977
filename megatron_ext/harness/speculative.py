"""What speculative decoding with MTP layers needs from the release and the CPU backend.

megatron-core drafts ``num_speculative_tokens`` tokens per decode step with the model's MTP layers
and verifies them in the next forward. What each release runs (measured on the CPU backend with
``mtp_speculative_tiny`` and variants):

* 0.19: up to one draft per MTP layer, or any number with ``mtp_use_repeated_layer`` (the
  controller's ``num_mtp_depths`` is ``num_speculative_tokens`` then);
* 0.17 and 0.18: at most one draft per MTP layer. ``mtp_use_repeated_layer`` does not raise the
  limit: 0.18's engine accepts the config but its controller drafts only
  ``min(num_speculative_tokens, mtp_num_layers)`` tokens and forwards the uninitialized rest
  (``IndexError`` in the embedding); 0.17's engine refuses it (``AssertionError``). 0.17 also
  requires ``materialize_only_last_token_logits=False``, which the harness passes there
  (:func:`inference_options`).

The verification and next-step kernels (``verify_speculative_tokens``,
``prepare_next_forward_pass``) are Triton kernels the controller imports from
``mtp_utils_triton`` (0.18, 0.19; no switch selects ``mtp_utils_pytorch``'s versions, of which the
controller imports only ``rewind_kv_cache``); on the CPU they run under Triton's interpreter
(``TRITON_INTERPRET=1``, set before Triton is imported: :mod:`megatron_ext.harness.triton_env`).
0.17 runs them in plain torch inside the controller.
"""

from __future__ import annotations

import os
from typing import Any

from .. import mcore
from ..errors import MegatronExtError


class SpeculativeDecodingError(MegatronExtError):
    """The installed release (or this process) cannot run the case's speculative decoding."""


def is_speculative(case: Any) -> bool:
    """The case drafts tokens (``inference.num_speculative_tokens > 0``)."""
    return case.inference.num_speculative_tokens > 0


def check_supported(case: Any, device: str = "cpu", version: str | None = None) -> None:
    """Refuse, before anything is built, a speculative case this release or process cannot run.

    Args:
        case: the run's :class:`~megatron_ext.harness.cases.Case`.
        device: ``cpu`` (needs ``TRITON_INTERPRET=1`` on 0.18+) or ``cuda``.
        version: megatron-core's version (None: the installed one).

    Raises:
        SpeculativeDecodingError: a model without enough MTP layers for the drafts (a model built
            from a checkpoint's args); more drafts than MTP layers on 0.17 / 0.18; on the CPU with 0.18+,
            Triton's interpreter is off in this process.
    """
    if not is_speculative(case):
        return
    from .cases.schema import speculative_problem

    problem = speculative_problem(case)  # a model from a checkpoint's args was not validated with the case
    if problem:
        raise SpeculativeDecodingError(f"case '{case.name}': {problem}")
    n, spec = case.inference.num_speculative_tokens, case.model
    series = mcore.release_series(version or mcore.installed_version())
    if series in ("0.17", "0.18") and n > spec.mtp_num_layers:
        raise SpeculativeDecodingError(
            f"case '{case.name}': num_speculative_tokens={n} with mtp_num_layers={spec.mtp_num_layers}"
            f"{' (mtp_use_repeated_layer)' if spec.mtp_use_repeated_layer else ''} needs megatron-core 0.19: "
            f"{series} drafts at most one token per MTP layer; use num_speculative_tokens <= "
            f"{spec.mtp_num_layers} or megatron-core 0.19")
    if device == "cpu" and series != "0.17" and os.environ.get("TRITON_INTERPRET") != "1":
        raise SpeculativeDecodingError(
            f"case '{case.name}': speculative decoding on the CPU runs megatron-core's Triton MTP kernels "
            "under Triton's interpreter: set TRITON_INTERPRET=1 in the environment before Python starts "
            "(the megatron-ext command sets it itself)")


def inference_options(case: Any) -> dict[str, Any]:
    """Extra ``InferenceConfig`` fields a speculative case needs on this release: 0.17 requires
    ``materialize_only_last_token_logits=False`` (its engine asserts it); none otherwise."""
    if is_speculative(case) and mcore.release_series(mcore.installed_version()) == "0.17":
        return {"materialize_only_last_token_logits": False}
    return {}
