"""Weight updates between rounds of a case (``weight_updates:``): what an RL loop does to the model.

:class:`WeightSnapshot` keeps the initial weights so every run (A and each B) starts from the same
ones. :class:`WeightUpdater` performs update ``k`` of a run in place on the shared ``GPTModel``:

* ``train_step``: one optimizer step (``torch.optim.SGD`` or ``Adam``, the case's learning rate,
  one optimizer per run so A and B start with the same optimizer state) on the requests of earlier
  rounds that finished in this run since the previous update (a request still running at an update,
  a partial rollout, joins the batch of the first update after it finished): each sequence is its
  prompt + the tokens this run generated,
  forward in training mode with megatron-core's own loss (``labels`` shifted by one, cross-entropy
  per token, averaged over every predicted token of the batch), backward, step, back to eval mode. Dropout
  draws from a CPU generator seeded with ``seed + k`` (the global RNG is restored afterwards).
* ``perturb``: Gaussian noise (standard deviation ``perturb_scale``, a ``torch.Generator`` seeded
  with ``seed + k``, drawn in float32 in parameter order) added to every parameter through
  ``.data``, the way megatron-core's ``swap_model_weights`` writes refitted weights.
* ``checkpoint``: a Megatron distributed checkpoint loaded into the model
  (:func:`megatron_ext.harness.checkpoint.load_checkpoint`).

The engine side (``suspend()`` / ``resume()`` or ``megatron_ext.invalidate_prefix_cache``) is the
step loop's (:mod:`megatron_ext.harness.step_loop`); this module only changes weights.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch

from ..errors import MegatronExtError
from .cases.planning import PlannedRequest
from .cases.schema import WeightUpdateSpec
from .checkpoint import CheckpointSource, load_checkpoint
from .compare import RequestOutput
from .mla import pre_absorption_name, stale_absorbed_layers


class WeightUpdateError(MegatronExtError):
    """A weight update the harness cannot make (e.g. a training step under pipeline parallelism,
    a checkpoint update without a checkpoint); the message names the fix."""


@dataclass
class UpdateRecord:
    """One weight update of one run.

    Attributes:
        index: 1-based: the weight version the update made.
        step: engine step (loop iteration) at which it was made.
        kind: ``train_step``, ``perturb`` or ``checkpoint``.
        suspend_resume: made between ``engine.suspend()`` and ``engine.resume()``.
        in_flight: request IDs live in the engine at the update (they run on across it).
        in_flight_tokens: request ID -> its tokens whose KV the engine held for it at the update
            (prompt tokens prefilled, and the rest of a block obtained by hash match that a chunk
            ended in, + tokens generated; 0 while it waits for admission), for each of
            ``in_flight``. Caching off and on must agree: otherwise the new weights start at another
            token of that request and its outputs cannot be compared.
        trained_on: ``train_step``: request IDs whose prompt + generated tokens were the batch
            (earlier rounds' requests that finished since the previous update).
        loss: ``train_step``: mean cross-entropy (nats per predicted token) before the step.
        weights_sha256: SHA-256 of every parameter's bytes after the update (this rank's shards, in
            ``named_parameters`` order): equal in A and B when both made the same update.
        invalidation: what happened to the prefix cache: ``resume`` (megatron-core's resume;
            the patch invalidates there), ``invalidated`` / ``kept`` (the explicit call),
            ``patch not applied`` (upstream behaviour) or ``caching off``.
        blocks_unreachable, blocks_freed: what ``invalidate_prefix_cache`` reported (else None).
        mla_stale_layers: MLA models: decoder layers (1-based) whose decode-only KV up-projection
            differs from the prefill one after the update (fault M1; empty when every copy has the
            new weights, :func:`~megatron_ext.harness.mla.stale_absorbed_layers`).
    """

    index: int
    step: int
    kind: str
    suspend_resume: bool
    in_flight: list[int] = field(default_factory=list)
    in_flight_tokens: dict[int, int] = field(default_factory=dict)
    trained_on: list[int] = field(default_factory=list)
    loss: Optional[float] = None
    weights_sha256: str = ""
    invalidation: str = ""
    blocks_unreachable: Optional[int] = None
    blocks_freed: Optional[int] = None
    mla_stale_layers: list[int] = field(default_factory=list)


class WeightSnapshot:
    """A copy of a model's parameters and buffers, to start every run from the same weights.

    Restored into the tensors the model had when the snapshot was taken and into those it has
    now: an MLA model's first inference forward renames and copies its KV up-projection
    (``prepare_for_absorption``; :func:`~megatron_ext.harness.mla.pre_absorption_name`), and its
    decode-only steps keep reading the original tensor's storage."""

    def __init__(self, model: Any) -> None:
        self._tensors = {name: (t, t.detach().clone()) for name, t in named_tensors(model)}

    def restore(self, model: Any) -> None:
        """Copy the saved values back into ``model``'s tensors, in place (same storage, so an
        engine built around the model sees them)."""
        with torch.no_grad():
            for tensor, saved in self._tensors.values():
                tensor.data.copy_(saved)
            for name, tensor in named_tensors(model):
                tensor.data.copy_(self._tensors[pre_absorption_name(name)][1])


def named_tensors(model: Any) -> list[tuple[str, torch.Tensor]]:
    """Every parameter and buffer of ``model`` (buffers named ``buffer:<name>``)."""
    return [*model.named_parameters(), *((f"buffer:{n}", b) for n, b in model.named_buffers())]


def weights_sha256(model: Any) -> str:
    """SHA-256 (hex) of every parameter's raw bytes, in ``named_parameters`` order."""
    digest = hashlib.sha256()
    for name, param in model.named_parameters():
        digest.update(name.encode())
        digest.update(param.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


class WeightUpdater:
    """Makes the weight updates of one run on ``model`` (in place).

    Args:
        model: the megatron-core ``GPTModel`` the engine runs.
        spec: the case's ``weight_updates``.
        planned: the run's requests (prompts and rounds, for ``train_step``).
        checkpoints: ``checkpoint`` updates: one checkpoint for every update, or one per update.
        on_updated: called with the model and its parameters' SHA-256 after each update (the
            post-update reference keeps its weights).

    Raises:
        WeightUpdateError: ``checkpoint`` without checkpoints, or their count fits neither.
    """

    def __init__(self, model: Any, spec: WeightUpdateSpec, planned: Sequence[PlannedRequest],
                 checkpoints: Sequence[CheckpointSource] = (),
                 on_updated: Optional[Callable[[Any, str], None]] = None) -> None:
        self.model, self.spec, self.on_updated = model, spec, on_updated
        self.planned = {p.request_id: p for p in planned}
        if spec.kind == "checkpoint" and len(checkpoints) not in (1, len(spec.update_at_steps)):
            raise WeightUpdateError(
                f"weight_updates kind checkpoint: {len(checkpoints)} checkpoints for "
                f"{len(spec.update_at_steps)} updates; pass --update-from DIR once (loaded at every update) "
                "or once per update, or list them under weight_updates.checkpoints")
        self.checkpoints = list(checkpoints)
        self.optimizer = _optimizer(model, spec) if spec.kind == "train_step" else None
        self.trained: set[int] = set()

    def update(self, record: UpdateRecord, outputs: dict[int, RequestOutput], finished: set[int]) -> None:
        """Make update ``record.index`` and fill ``record`` (``trained_on``, ``loss``, digest).

        Args:
            outputs: this run's outputs so far (request ID -> :class:`RequestOutput`).
            finished: request IDs that finished in this run before the update.

        Raises:
            WeightUpdateError: ``train_step`` with no finished request of the previous round, or
                under pipeline parallelism.
            CheckpointError: the checkpoint does not fit the model.
        """
        k = record.index
        if self.spec.kind == "train_step":
            batch = [rid for rid in sorted(finished - self.trained)
                     if self.planned[rid].round < k and outputs[rid].tokens]
            record.trained_on, record.loss = batch, self._train_step(batch, outputs, self.spec.seed + k)
            self.trained.update(batch)
        elif self.spec.kind == "perturb":
            perturb(self.model, self.spec.perturb_scale, self.spec.seed + k)
        else:
            load_checkpoint(self.model, self.checkpoints[min(k - 1, len(self.checkpoints) - 1)])
        record.weights_sha256 = weights_sha256(self.model)
        record.mla_stale_layers = stale_absorbed_layers(self.model)
        if self.on_updated is not None:
            self.on_updated(self.model, record.weights_sha256)

    def _train_step(self, batch: list[int], outputs: dict[int, RequestOutput], seed: int) -> float:
        if not batch:
            raise WeightUpdateError(
                "weight_updates kind train_step: no request of an earlier round finished since the previous "
                "update, so there is nothing to train on; move that update in update_at_steps later")
        from .engine import model_parallel_sizes

        if model_parallel_sizes()[1] > 1:
            raise WeightUpdateError("weight_updates kind train_step needs megatron-core's pipeline schedule under "
                                    "pipeline parallelism; use kind perturb or checkpoint with PP > 1")
        sequences = [(list(self.planned[rid].prompt_tokens), outputs[rid].tokens) for rid in batch]
        return train_step(self.model, self.optimizer, sequences, seed)


def _optimizer(model: Any, spec: WeightUpdateSpec) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    if spec.optimizer == "adam":
        return torch.optim.Adam(params, lr=spec.learning_rate, foreach=False)
    return torch.optim.SGD(params, lr=spec.learning_rate, foreach=False)


def train_step(model: Any, optimizer: torch.optim.Optimizer, sequences: Sequence[tuple[list[int], list[int]]],
               seed: int) -> float:
    """One optimizer step of ``model`` on ``(prompt tokens, generated tokens)`` pairs.

    Each sequence (prompt + generated, int64 token IDs, batch size 1, no padding) goes through
    ``model(input_ids, position_ids, None, labels=...)`` in training mode, where ``labels`` are the
    inputs shifted by one; megatron-core returns the per-token cross-entropy ``[1, s]`` (float32).
    The loss is the mean over every predicted position of all sequences (a language-model loss;
    prompt positions are not masked). Then backward, ``optimizer.step()``, gradients cleared,
    eval mode. Dropout draws from the CPU generator seeded with ``seed``; the caller's RNG state is
    restored afterwards.

    Returns:
        The loss before the step (nats per predicted token).
    """
    device = next(model.parameters()).device
    total_tokens = sum(len(prompt) + len(generated) - 1 for prompt, generated in sequences)
    optimizer.zero_grad(set_to_none=True)
    model.train()
    total = 0.0
    try:
        with torch.random.fork_rng(devices=[]), torch.enable_grad():
            torch.manual_seed(seed)
            for prompt, generated in sequences:
                tokens = torch.tensor(prompt + generated, dtype=torch.int64, device=device)
                inputs, labels = tokens[:-1].unsqueeze(0), tokens[1:].unsqueeze(0)
                positions = torch.arange(inputs.shape[1], device=device).unsqueeze(0)
                per_token = model(inputs, positions, None, labels=labels)  # [1, s] cross-entropy
                loss = per_token.float().sum() / total_tokens
                loss.backward()
                total += float(loss.detach())
        optimizer.step()
    finally:
        optimizer.zero_grad(set_to_none=True)
        model.eval()
    return total


def perturb(model: Any, scale: float, seed: int) -> None:
    """Add ``scale`` x standard normal noise to every parameter of ``model`` through ``.data``
    (float32 noise from a ``torch.Generator`` seeded with ``seed``, in ``named_parameters``
    order, cast to each parameter's dtype)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32) * scale
            param.data.add_(noise.to(device=param.device, dtype=param.dtype))
