"""megatron-core's MoE router replay (``transformer/moe/router_replay.py``, 0.17+) for the harness.

With ``moe_enable_routing_replay`` every MoE router of a model owns a ``RouterReplay``; megatron-core
keeps all of them in one class-level list (``RouterReplay.global_router_replay_instances``), records
from them in the engine (``RECORD``) and, in a training forward, can make each router take given
expert IDs instead of its own top-k (``REPLAY_FORWARD``): rollout routing replay, which RL
trainers use so the trainer's forward routes every token as the rollout did.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

import torch

from .. import mcore

_MODULE = "megatron.core.transformer.moe.router_replay"


def router_replays(model: Any) -> list[Any]:
    """The ``RouterReplay`` objects of ``model``'s decoder MoE routers, in layer order ([] for a
    model without routing replay).

    The routers of an MTP block (``model.mtp``, layers built over the same MoE layer spec) are left
    out: the dynamic engine runs them only in its draft forwards, over other tokens than the step's
    (one per request and depth), so their recordings cannot be stacked with the decoder's. With them
    in megatron-core's list, 0.19.2's ``RoutingMetadata.get_routing_indices`` stacks the MTP router's
    ``None`` (step 0) or a draft forward's ``[requests, topk]`` with the decoder's ``[tokens, topk]``
    and raises (Megatron-LM PR #7404, open). Left out of the list, MTP routers are never set to
    record or replay and route by their own top-k, as NeMo-RL's router replay treats them."""
    mtp = getattr(model, "mtp", None)
    in_mtp = set() if mtp is None else {id(module) for module in mtp.modules()}
    found = []
    for module in model.modules():
        replay = getattr(module, "router_replay", None)
        if replay is not None and replay not in found and id(module) not in in_mtp:
            found.append(replay)
    return found


def use_router_replays(model: Any) -> None:
    """Make ``model``'s routers the only ones megatron-core records from.

    The inference controller stacks the recordings of every instance in the class-level list, so
    a second model built in the same process (a test, a trainer copy) would add its layers to the
    first model's routing (or a shape error). The harness sets that list to ``model``'s decoder
    routers (:func:`router_replays`: no MTP routers) before each run; a model without routing replay
    leaves it alone.
    """
    replays = router_replays(model)
    if replays:
        mcore.import_module(_MODULE).RouterReplay.global_router_replay_instances[:] = replays


def replay_targets(routing: Sequence[Sequence[Sequence[Sequence[int]]]], length: int, layers: int,
                   topk: int) -> torch.Tensor:
    """Per layer, the expert IDs a training forward over ``[B, length]`` tokens must take.

    Args:
        routing: per sequence (``B`` of them) its recorded routing ``[n][layers][topk]``,
            ``n <= length`` (the engine records ``prompt + generated - 1`` positions).
        length, layers, topk: the forward's sequence length, the MoE layers, experts per token.

    Returns:
        ``[layers, length * B, topk]`` int64, tokens in the order a router sees them (megatron-core
        runs ``[sequence, batch]``: position-major). Positions without recorded routing (the last
        token, padding) get experts ``0..topk-1``: no logit before them depends on them (causal
        attention, per-token experts).
    """
    target = torch.arange(topk, dtype=torch.long).expand(length, len(routing), layers, topk).clone()
    for column, rows in enumerate(routing):
        if rows:
            recorded = torch.tensor(rows, dtype=torch.long)  # [n, layers, topk]
            target[: recorded.shape[0], column] = recorded
    return target.reshape(length * len(routing), layers, topk).permute(1, 0, 2).contiguous()


@contextlib.contextmanager
def replaying(model: Any, targets: torch.Tensor) -> Iterator[None]:
    """``model``'s routers take ``targets`` (:func:`replay_targets`) in the forward run inside;
    their replay actions are restored and their indices cleared after.

    Raises:
        ValueError: ``targets`` has another number of layers than ``model`` has MoE routers.
    """
    replays = router_replays(model)
    if len(replays) != targets.shape[0]:
        raise ValueError(f"routing of {targets.shape[0]} MoE layers for a model with {len(replays)}")
    action = mcore.import_module(_MODULE).RouterReplayAction.REPLAY_FORWARD
    saved = [replay.router_replay_action for replay in replays]
    try:
        for replay, layer in zip(replays, targets):
            replay.set_target_indices(layer)
            replay.set_router_replay_action(action)
        yield
    finally:
        for replay, previous in zip(replays, saved):
            replay.clear_indices()
            replay.router_replay_action = previous
