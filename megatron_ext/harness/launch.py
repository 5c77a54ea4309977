"""How a command was launched: torchrun's ``RANK`` / ``WORLD_SIZE``, and whether the model-parallel
layout (``--tensor-model-parallel-size`` x ``--pipeline-model-parallel-size``) and the device fit
them. Reads the environment only (no torch), so a bad launch fails before anything is imported."""

from __future__ import annotations

import os

from ..errors import MegatronExtError


class LaunchError(MegatronExtError):
    """The launch does not fit the command's flags: TP x PP is not the number of ranks, or
    ``--device cuda`` under several ranks. The message names the torchrun line that fits."""


def torchrun_world() -> tuple[int, int]:
    """``(RANK, WORLD_SIZE)`` as torchrun sets them; ``(0, 1)`` without torchrun."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def check_layout(tp: int, pp: int, command: str) -> None:
    """Check that TP x PP equals the number of ranks.

    Raises:
        LaunchError: it does not; the message gives the ``torchrun`` line for ``command``.
    """
    world_size = torchrun_world()[1]
    if tp < 1 or pp < 1 or tp * pp != world_size:
        raise LaunchError(f"--tensor-model-parallel-size {tp} x --pipeline-model-parallel-size {pp} needs "
                          f"{tp * pp} ranks, but WORLD_SIZE is {world_size}; launch with "
                          f"'torchrun --nproc-per-node {max(tp * pp, 1)} -m megatron_ext {command} ...'")


def check_device(device: str) -> None:
    """Check that several ranks run on the CPU backend (multi-rank runs use CPU ranks over gloo).

    Raises:
        LaunchError: ``device`` is not ``"cpu"`` under several ranks.
    """
    if torchrun_world()[1] > 1 and device != "cpu":
        raise LaunchError("multi-rank ab runs CPU ranks over gloo; --device cuda is single-rank only")
