"""The trainer forward replays given MoE routing (``ab --trainer-logprobs`` on a routing-replay model).

``moe_tiny``'s model (2 MoE layers, 4 experts, top-2). Its own routing, recorded over one
sequence, replayed: the log-probs keep every bit. The same routing with every expert ID moved
by one: they change. ``replay_targets`` lays tokens out as megatron-core's routers see them
(position-major) and fills the positions without routing with experts ``0..topk-1``.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron_ext import mcore  # noqa: E402
from megatron_ext.cpu_backend import cpu_backend  # noqa: E402
from megatron_ext.harness.cases import load_case  # noqa: E402
from megatron_ext.harness.engine import build_model, ensure_model_parallel  # noqa: E402
from megatron_ext.harness.routing import replay_targets, router_replays  # noqa: E402
from megatron_ext.harness.trainer_logprobs import TrainerForward, trainer_log_probs  # noqa: E402

PROMPT, GENERATED = list(range(40, 60)), [61, 62, 63, 64]


def test_replay_targets_are_position_major_with_defaults_after_the_recorded_positions():
    routing = [[[[1, 2]], [[3, 0]]],  # sequence 0: positions 0 and 1 recorded (1 layer, top-2)
               [[[2, 3]]]]            # sequence 1: position 0 only
    targets = replay_targets(routing, length=3, layers=1, topk=2)
    assert targets.shape == (1, 6, 2) and targets.dtype == torch.long
    # rows: (position 0, seq 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)
    assert targets[0].tolist() == [[1, 2], [2, 3], [3, 0], [0, 1], [0, 1], [0, 1]]


def _recorded_routing(model) -> list:
    """The model's own routing of PROMPT + GENERATED but the last token, ``[n][layers][topk]``."""
    module = mcore.import_module("megatron.core.transformer.moe.router_replay")
    module.RouterReplay.set_global_router_replay_action(module.RouterReplayAction.RECORD)
    try:
        trainer_log_probs(model, [(PROMPT, GENERATED)])
        recorded = [r.get_recorded_indices() for r in router_replays(model)]  # per layer [L, topk]
    finally:
        module.RouterReplay.clear_global_router_replay_action()
        module.RouterReplay.clear_global_indices()
    length = len(PROMPT) + len(GENERATED) - 1
    return [[layer[p].tolist() for layer in recorded] for p in range(length)]


def test_trainer_forward_takes_the_replayed_experts():
    with cpu_backend(), torch.inference_mode(False):
        ensure_model_parallel()
        model = build_model(load_case("moe_tiny"))
        own = trainer_log_probs(model, [(PROMPT, GENERATED)])[0]
        routing = _recorded_routing(model)
        assert len(routing) == 23 and len(routing[0]) == 2 and len(routing[0][0]) == 2
        replayed = trainer_log_probs(model, [(PROMPT, GENERATED)], TrainerForward(), [routing])[0]
        shifted = [[[(e + 1) % 4 for e in layer] for layer in token] for token in routing]
        moved = trainer_log_probs(model, [(PROMPT, GENERATED)], TrainerForward(), [shifted])[0]
        assert all(r.router_replay_action is None for r in router_replays(model))  # restored
    assert torch.equal(replayed.view(torch.int32), own.view(torch.int32))
    assert not torch.equal(moved, own)
