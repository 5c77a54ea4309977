"""Megatron distributed checkpoints for ``megatron-ext ab --load``: resolve, check, load, save.

Everything on disk is megatron-core's own format, written and read by its own API:
``megatron.core.dist_checkpointing.save`` / ``load`` with the ``torch_dist`` backend, applied to
``GPTModel.sharded_state_dict()``. The model's tensors are stored under the ``model`` key of the
state dict, the layout Megatron-LM's training loop uses, so the same code loads

* a distributed checkpoint directory (``metadata.json``, ``.metadata``, ``*.distcp``), e.g. one
  written by :func:`save_checkpoint` / ``megatron-ext save-checkpoint``, or one ``iter_NNNNNNN``
  directory of a Megatron-LM run;
* a Megatron-LM save directory (``--save`` of training): ``latest_checkpointed_iteration.txt``
  names the iteration (or ``release``) and the checkpoint is ``iter_NNNNNNN/`` (or ``release/``).

Tensor-parallel and pipeline-parallel layouts need not match between saving and loading
(resharding is a dist-checkpointing feature); the global tensor shapes must, except for the
padded vocabulary rows of the embedding and output layer, which megatron-core marks
``allow_shape_mismatch`` (rows missing from the checkpoint are zero, extra ones are dropped).

Errors are :class:`CheckpointError` (a :class:`~megatron_ext.errors.MegatronExtError`: the CLI
prints one line and exits 2), raised before the model is changed and before any engine run.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import re
import types
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional, Union

import torch

from .. import mcore
from ..errors import MegatronExtError
from .distributed import all_ranks, is_multi_rank

#: Megatron-LM's tracker file in a training save directory.
TRACKER_FILE = "latest_checkpointed_iteration.txt"
#: The state-dict key the model's tensors are saved under (as Megatron-LM does).
MODEL_KEY = "model"
#: The only sharded backend ``ab --load`` reads.
BACKEND = "torch_dist"

_ITER_DIR = re.compile(r"^iter_(\d+)$")
_DIST_CHECKPOINTING = "megatron.core.dist_checkpointing"

PathLike = Union[str, "os.PathLike[str]"]


class CheckpointError(MegatronExtError):
    """A checkpoint cannot be used: missing, not a checkpoint, wrong format, or a different
    architecture than the model built from the case. The message names the problem and the fix."""


@dataclass(frozen=True)
class CheckpointSource:
    """A resolved checkpoint.

    Attributes:
        requested: the path the user gave (a checkpoint or a Megatron-LM save directory).
        path: the distributed checkpoint directory that is read.
        iteration: the training iteration (from the tracker file or an ``iter_NNNNNNN`` name),
            ``"release"`` for a Megatron-LM release checkpoint, or None when unknown.
        backend: the sharded backend named in the checkpoint's ``metadata.json``.
    """

    requested: str
    path: str
    iteration: Union[int, str, None]
    backend: str = BACKEND

    def describe(self) -> str:
        """One line for the report, e.g. ``/ckpt/iter_0000100 (iteration 100, resolved from
        /ckpt/latest_checkpointed_iteration.txt), torch_dist``."""
        where = self.path
        if self.iteration is not None:
            where += f" (iteration {self.iteration}"
            if self.requested != self.path:
                where += f", resolved from {os.path.join(self.requested, TRACKER_FILE)}"
            where += ")"
        return f"{where}, {self.backend}"

    def as_json(self) -> dict[str, Any]:
        return {"requested": self.requested, "path": self.path, "iteration": self.iteration,
                "backend": self.backend}


def resolve_checkpoint(path: PathLike) -> CheckpointSource:
    """Find the distributed checkpoint that ``path`` names.

    Args:
        path: a distributed checkpoint directory, or a Megatron-LM save directory holding
            ``latest_checkpointed_iteration.txt`` (then ``iter_NNNNNNN/`` or ``release/``).

    Raises:
        CheckpointError: the path does not exist or is not a directory; the tracker file is
            unreadable or names a directory that does not exist; the directory is neither a
            distributed checkpoint nor a Megatron-LM save directory (e.g. empty, or a legacy
            ``mp_rank_*/model_optim_rng.pt`` checkpoint); its backend is not ``torch_dist``.
    """
    requested = Path(path).expanduser()
    shown = str(requested)
    if not requested.exists():
        raise CheckpointError(f"--load {shown}: no such directory; pass the directory "
                              "megatron-core's dist_checkpointing.save wrote (or a Megatron-LM "
                              f"--save directory with {TRACKER_FILE})")
    if not requested.is_dir():
        raise CheckpointError(f"--load {shown}: is a file, not a directory; pass the checkpoint "
                              "directory (the one holding metadata.json)")
    iteration: Union[int, str, None] = None
    directory = requested
    tracker = requested / TRACKER_FILE
    if tracker.is_file() and not _is_dist_checkpoint(requested):
        try:
            text = tracker.read_text().strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"--load {shown}: cannot read {tracker} ({exc}); fix its "
                                  "permissions or contents, or pass the iter_NNNNNNN directory "
                                  "itself") from None
        if text == "release":
            iteration, directory = "release", requested / "release"
        elif text.isdigit():
            iteration, directory = int(text), requested / f"iter_{int(text):07d}"
        else:
            raise CheckpointError(f"--load {shown}: {tracker} holds {text[:40]!r}, not an "
                                  "iteration number or 'release'; fix the file or pass the "
                                  "iter_NNNNNNN directory itself")
        if not directory.is_dir():
            raise CheckpointError(f"--load {shown}: {TRACKER_FILE} names iteration {text}, but "
                                  f"{directory} does not exist (incomplete or moved save); pass "
                                  "an existing iter_NNNNNNN directory or fix the tracker file")
    else:
        match = _ITER_DIR.match(requested.name)
        iteration = int(match.group(1)) if match else None
    config = _checkpoint_config(directory)
    if config is None:
        raise CheckpointError(_not_a_checkpoint(shown, directory))
    backend = getattr(config, "sharded_backend", None)
    if backend != BACKEND:
        raise CheckpointError(f"--load {shown}: {directory} is a {backend!r} distributed "
                              f"checkpoint; ab --load reads the {BACKEND!r} format (convert it, "
                              "e.g. with Megatron-LM's --ckpt-convert-format torch_dist)")
    return CheckpointSource(shown, str(directory), iteration, backend)


def _is_dist_checkpoint(directory: Path) -> bool:
    return _checkpoint_config(directory) is not None


def _checkpoint_config(directory: Path) -> Any:
    """megatron-core's ``CheckpointingConfig`` of ``directory`` (its ``metadata.json``) or None."""
    core = mcore.import_module(f"{_DIST_CHECKPOINTING}.core")
    try:
        return core.maybe_load_config(str(directory))
    except (ValueError, TypeError, AttributeError, OSError) as exc:
        # metadata.json is not the JSON object megatron-core wrote, or not a readable file
        raise CheckpointError(f"--load {directory}: its metadata.json is unreadable ({exc}); the "
                              "save did not finish or the file is damaged: save it again") from None


def _not_a_checkpoint(shown: str, directory: Path) -> str:
    entries = sorted(p.name for p in directory.iterdir())
    if not entries:
        what = "is empty"
    elif any(name.startswith("mp_rank_") for name in entries):
        what = ("is a legacy (torch) Megatron-LM checkpoint (mp_rank_*/model_optim_rng.pt), not a "
                "distributed one; convert it to torch_dist (Megatron-LM: --ckpt-convert-format "
                "torch_dist) and pass the converted directory")
        return f"--load {shown}: {directory} {what}"
    else:
        what = f"holds {', '.join(entries[:5])}{', ...' if len(entries) > 5 else ''}"
    return (f"--load {shown}: not a Megatron distributed checkpoint ({directory} {what}; no "
            f"metadata.json) and not a Megatron-LM save directory (no {TRACKER_FILE}); pass the "
            "directory megatron-core's dist_checkpointing.save wrote, e.g. with "
            "'megatron-ext save-checkpoint DIR'")


def _model_sharded_tensors(model: Any) -> tuple[dict, list]:
    """``(sharded_state_dict, [ShardedTensor, ...])`` of ``model``, in state-dict order.

    The ShardedTensors are those of a second ``sharded_state_dict()`` whose factories
    (``ShardedTensorFactory``, e.g. SwiGLU's ``linear_fc1``) megatron-core's ``apply_factories``
    has expanded, so the architecture check sees every stored tensor; the returned state dict
    keeps its factories for ``dist_checkpointing.load``.
    """
    dict_utils = mcore.import_module(f"{_DIST_CHECKPOINTING}.dict_utils")
    mapping = mcore.import_module(f"{_DIST_CHECKPOINTING}.mapping")
    sharded = model.sharded_state_dict()
    expanded = model.sharded_state_dict()
    mapping.apply_factories(expanded)
    tensors = [v for v in dict_utils.nested_values(expanded) if isinstance(v, mapping.ShardedTensor)]
    return sharded, tensors


#: Globals the restricted reader of a checkpoint's common state rebuilds as themselves; any other
#: global becomes an :class:`UnloadedObject` (nothing named in the file is called).
_COMMON_STATE_GLOBALS = frozenset({
    ("argparse", "Namespace"), ("types", "SimpleNamespace"), ("pathlib", "PosixPath"),
    ("pathlib", "Path"), ("collections", "OrderedDict"), ("builtins", "set"),
    ("builtins", "frozenset"), ("builtins", "slice"), ("builtins", "complex"),
    ("torch._utils", "_rebuild_tensor_v2"), ("torch._utils", "_rebuild_parameter"),
    ("torch.storage", "UntypedStorage"), ("torch", "Size"),
} | {("torch", name) for name in ("float64", "float32", "float16", "bfloat16", "int64", "int32",
                                   "int16", "int8", "uint8", "bool", "FloatStorage", "LongStorage",
                                   "ByteStorage", "BFloat16Storage", "HalfStorage")})


class UnloadedObject:
    """Stands in, in a checkpoint's common state, for an object of a class the restricted reader
    does not rebuild (e.g. an enum of a newer megatron-core): ``name`` is its ``module.qualname``,
    ``args`` what it would have been called with, ``state`` its pickled state (or None)."""

    def __init__(self, name: str, args: tuple = ()):
        self.name, self.args, self.state = name, args, None

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __repr__(self) -> str:
        return f"<not loaded: {self.name}{self.args!r}>"


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _COMMON_STATE_GLOBALS:
            return super().find_class(module, name)
        return lambda *args: UnloadedObject(f"{module}.{name}", args)


def _restricted_load(handle: Any, **kwargs: Any) -> Any:
    return _RestrictedUnpickler(handle, **kwargs).load()


#: ``pickle_module`` for ``torch.load``: the restricted unpickler above, for ``Unpickler`` and
#: ``load`` alike (torch's legacy, non-zip format reads through ``load``).
_restricted_pickle = types.SimpleNamespace(Unpickler=_RestrictedUnpickler, load=_restricted_load,
                                           __name__="megatron_ext_restricted_pickle")


def _torch_load_common(buffer: io.BytesIO, where: str) -> Any:
    """``torch.load`` of common-state bytes: ``weights_only=True`` (megatron-core's safe globals)
    first; if the file holds a global outside that list (a class the installed release lacks),
    the restricted unpickler, which calls nothing named in the file."""
    damaged = f"cannot read the common state of {where}: the save did not finish or the file is damaged"
    if not zipfile.is_zipfile(buffer):  # torch's zip format only: the legacy one unpickles first
        raise CheckpointError(f"{damaged} (not a torch zip archive)")
    buffer.seek(0)
    try:
        return torch.load(buffer, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        buffer.seek(0)
    except Exception as exc:  # noqa: BLE001 - a damaged or foreign file
        raise CheckpointError(f"{damaged} ({type(exc).__name__}: {exc})") from None
    try:
        return torch.load(buffer, map_location="cpu", weights_only=False, pickle_module=_restricted_pickle)
    except Exception as exc:  # noqa: BLE001 - a damaged or foreign file
        raise CheckpointError(f"{damaged} ({type(exc).__name__}: {exc})") from None


def read_common_state(path: PathLike) -> dict:
    """The common (non-sharded) state of a distributed checkpoint directory, e.g. Megatron-LM's
    ``{"args": Namespace, "iteration": int, "checkpoint_version": float, ...}``, read on CPU
    without a model or a process group.

    Both layouts are read under every supported release: ``common.pt`` (megatron-core 0.17 and
    0.18 write it) and the ``common_state`` object inside the ``*.distcp`` files (0.19 writes
    that; 0.17 and 0.18's own reader cannot read it), the latter through
    ``torch.distributed.checkpoint``. Objects are rebuilt with ``torch.load(weights_only=True)``;
    objects of classes outside megatron-core's safe globals (e.g. enums of a newer release)
    come back as :class:`UnloadedObject`, and nothing the common state names is called. (The
    ``.metadata`` index is read by torch's own unpickler: load only checkpoints you trust.)

    Args:
        path: the distributed checkpoint directory (holding ``metadata.json``).

    Raises:
        CheckpointError: neither layout is present, or the state cannot be unpickled.
    """
    mcore.import_module("megatron.core")  # registers megatron-core's safe globals for weights_only
    mapping = mcore.import_module(f"{_DIST_CHECKPOINTING}.mapping")
    directory = str(path)
    legacy = os.path.join(directory, "common.pt")
    if os.path.isfile(legacy):
        with open(legacy, "rb") as handle:
            return _torch_load_common(io.BytesIO(handle.read()), legacy)
    dcp = torch.distributed.checkpoint
    key = mapping.ShardedObject("common_state", None, (1,), (0,)).unique_key
    try:
        reader = dcp.FileSystemReader(directory)
        present = key in reader.read_metadata().state_dict_metadata
    except Exception as exc:  # noqa: BLE001 - no or damaged .metadata
        raise CheckpointError(f"cannot read the index (.metadata) of {directory} "
                              f"({type(exc).__name__}: {exc}); save it again") from None
    if not present:
        raise CheckpointError(f"{directory} holds no common state (no common.pt and no '{key}' "
                              "object in its .distcp files); save it again with megatron-core")
    buffer = {key: io.BytesIO()}
    try:
        dcp.load(buffer, storage_reader=reader, no_dist=True)
    except Exception as exc:  # noqa: BLE001 - a damaged .distcp file
        raise CheckpointError(f"cannot read '{key}' from the .distcp files of {directory} "
                              f"({type(exc).__name__}: {exc}); save it again") from None
    loaded = buffer[key]
    if isinstance(loaded, io.BytesIO):
        loaded.seek(0)
        loaded = _torch_load_common(loaded, f"{directory} ('{key}')")
    if not isinstance(loaded, (list, tuple)) or not loaded or not isinstance(loaded[0], dict):
        raise CheckpointError(f"{directory}: '{key}' is not megatron-core's common state (a dict); save it again")
    return loaded[0]


@contextlib.contextmanager
def _common_state_through_megatron_ext(serialization: Any) -> Iterator[None]:
    """While loading: the common-state reader(s) ``dist_checkpointing.load`` calls by module name
    (``load_common`` in 0.17/0.18, ``load_common_state_dict`` in 0.19) read through
    :func:`read_common_state`, so a checkpoint of another release's layout, or whose args hold
    classes the installed release lacks, loads."""
    names = [n for n in ("load_common", "load_common_state_dict")
             if n in serialization.load.__code__.co_names and hasattr(serialization, n)]
    originals = {n: getattr(serialization, n) for n in names}
    for name in names:
        setattr(serialization, name, read_common_state)
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(serialization, name, original)


def _shape_problem(tensors: list, stored: dict, path: str, built: str) -> Optional[str]:
    """This rank's first architecture problem, or None.

    Checked per ShardedTensor of the model's ``sharded_state_dict()`` (global shapes: the layer
    axis of the stacked ``decoder.layers.*`` tensors counts the layers): present in the
    checkpoint (``stored``: key -> ShardedTensor from ``load_tensors_metadata``), same global
    shape (padded-vocabulary tensors, ``allow_shape_mismatch``, may differ in axis 0 only).
    """
    fix = ("build the model the checkpoint was saved from: pass a --case whose model section "
           f"matches it{_suggest(stored)}, or one without a model section when the checkpoint stores "
           "Megatron-LM args")
    for tensor in tensors:
        saved = stored.get(tensor.key)
        if saved is None:
            return (f"checkpoint {path} has no tensor '{tensor.key}' that {built} needs "
                    f"(global shape {tuple(tensor.global_shape)}); {fix}")
        want, have = tuple(tensor.global_shape), tuple(saved.global_shape)
        if want == have or (tensor.allow_shape_mismatch and len(want) == len(have) and want[1:] == have[1:]):
            continue
        return (f"tensor '{tensor.key}' has global shape {have} in checkpoint {path}, but {built} "
                f"has {want}; {fix}")
    return None


def _unexpected_tensors(stored_keys: set[str], model_keys: set[str]) -> list[str]:
    return sorted(k for k in stored_keys - model_keys if not k.startswith("optimizer."))


#: Well-known tensors whose global shapes name a model flag: (key, flag, dim, ndim or None).
#: Layer-stacked tensors (ndim 3) carry the number of layers in dim 0.
_SHAPE_HINTS = (
    ("decoder.layers.self_attention.linear_proj.weight", "num_layers", 0, 3),
    ("decoder.final_layernorm.weight", "hidden_size", 0, None),
    ("decoder.layers.mlp.linear_fc2.weight", "ffn_hidden_size", 2, 3),
    ("embedding.position_embeddings.weight", "max_position_embeddings", 0, None),
    ("embedding.word_embeddings.weight", "vocabulary rows (padded)", 0, None),
)


def _suggest(stored: dict) -> str:
    """`` (its shapes suggest num_layers=2, hidden_size=32, ...)`` from well-known tensors."""
    hints = []
    for key, flag, dim, ndim in _SHAPE_HINTS:
        tensor = stored.get(key)
        if tensor is not None and (ndim is None or len(tensor.global_shape) == ndim):
            hints.append(f"{flag}={tensor.global_shape[dim]}")
    return f" (its shapes suggest {', '.join(hints)})" if hints else ""


def _first_on_any_rank(problem: Optional[str]) -> Optional[str]:
    """The first non-None ``problem`` over all ranks (lowest rank wins), the same on every rank,
    so that every rank raises together instead of some waiting in a collective (gloo world)."""
    if not is_multi_rank():
        return problem
    return next((f"rank {rank}: {found}" for rank, found in enumerate(all_ranks(problem)) if found is not None), None)


def _all_model_keys(keys: set[str]) -> set[str]:
    """The union of every rank's model tensor keys (pipeline stages own different tensors)."""
    if not is_multi_rank():
        return keys
    return set().union(*map(set, all_ranks(sorted(keys))))


def load_checkpoint(model: Any, checkpoint: Union[PathLike, CheckpointSource], case_name: str = "") -> CheckpointSource:
    """Load a distributed checkpoint into ``model`` (in place), through megatron-core's API.

    Resolves ``checkpoint`` (:func:`resolve_checkpoint`); checks the architecture against the
    checkpoint's tensor index on every rank (every model tensor present with the same global
    shape, no checkpoint tensor outside the model except ``optimizer.*``; all ranks raise together
    if any rank finds a problem); then calls
    ``dist_checkpointing.load({"model": model.sharded_state_dict()}, path)`` and
    ``model.load_state_dict(...)`` (strict). Every rank of a torchrun job must call it (it runs
    collectives over the world group); each rank reads the slices of its TP/PP layout.

    Args:
        model: a megatron-core ``GPTModel`` (any dtype; stored tensors are copied into the
            model's parameters, converting their dtype if it differs).
        checkpoint: a path or a :class:`CheckpointSource`.
        case_name: named in architecture errors.

    Returns:
        The resolved :class:`CheckpointSource`.

    Raises:
        CheckpointError: see :func:`resolve_checkpoint`; architecture mismatch (first
            mismatching tensor, both shapes, the fix); megatron-core failed to read the files.
    """
    source = checkpoint if isinstance(checkpoint, CheckpointSource) else resolve_checkpoint(checkpoint)
    serialization = mcore.import_module(f"{_DIST_CHECKPOINTING}.serialization")
    built = f"the model built from case '{case_name}'" if case_name else "the model"
    try:
        stored = serialization.load_tensors_metadata(source.path)
        problem = None
    except Exception as exc:  # noqa: BLE001 - damaged .metadata: every rank fails alike
        stored, problem = {}, (f"megatron-core could not read the tensor index of {source.path} "
                               f"({type(exc).__name__}: {exc}); the save did not finish or the "
                               "files are damaged: save it again")
    sharded, tensors = _model_sharded_tensors(model)
    if problem is None:
        problem = _shape_problem(tensors, stored, source.path, built)
        problem = problem and f"architecture mismatch: {problem}"
    extra = _unexpected_tensors(set(stored), _all_model_keys({t.key for t in tensors}))
    if problem is None and extra:
        problem = (f"architecture mismatch: checkpoint {source.path} has {len(extra)} tensor(s) "
                   f"that {built} lacks, first '{extra[0]}' (another layer spec or architecture); build the model "
                   "the checkpoint was saved from: pass a --case whose model section matches it, or one "
                   "without a model section when the checkpoint stores Megatron-LM args")
    problem = _first_on_any_rank(problem)
    if problem is not None:
        raise CheckpointError(f"--load {source.requested}: {problem}")
    try:
        with _common_state_through_megatron_ext(serialization):
            loaded = serialization.load({MODEL_KEY: sharded}, source.path)
    except Exception as exc:  # noqa: BLE001 - megatron-core / torch.distributed.checkpoint
        raise CheckpointError(f"--load {source.requested}: megatron-core could not read "
                              f"{source.path}: {type(exc).__name__}: {exc}") from exc
    state = loaded[MODEL_KEY]
    wanted = model.state_dict().keys()
    try:
        model.load_state_dict({k: v for k, v in state.items() if k in wanted}, strict=True)
    except RuntimeError as exc:  # after the shape check this means missing/unexpected keys
        raise CheckpointError(f"--load {source.requested}: the model's weights were only partly "
                              f"loaded ({exc}); the model is unusable: pass a --case whose model "
                              "section matches the checkpoint") from exc
    return source


def save_checkpoint(model: Any, directory: PathLike, common: Optional[dict] = None) -> Path:
    """Save ``model`` as a megatron-core distributed checkpoint (``torch_dist``).

    Calls ``dist_checkpointing.save({"model": model.sharded_state_dict(), **common}, directory)``: each
    tensor is stored once with its global shape (TP shards and pipeline stages written by the
    ranks that own them), so it loads at any TP/PP layout. Every rank of a torchrun job must call
    it. megatron-core's writer needs ``psutil`` and starts a ``multiprocessing`` manager
    (spawn): call it from a program whose main module is import-safe (``python -m``, pytest, a
    script with an ``if __name__ == "__main__"`` guard).

    Args:
        model: a megatron-core ``GPTModel`` (e.g. :func:`megatron_ext.harness.engine.build_model`).
        directory: created if missing; must be empty.
        common: non-tensor entries stored in the checkpoint's common state, e.g. Megatron-LM's
            ``{"args": Namespace, "iteration": int, "checkpoint_version": 3.0}`` (None: none).

    Returns:
        ``directory`` as a Path (it then holds ``metadata.json``, ``.metadata``, ``*.distcp``).

    Raises:
        CheckpointError: ``directory`` is a file or not empty; ``psutil`` is missing.
    """
    target = Path(directory).expanduser()
    try:
        import psutil  # noqa: F401  megatron-core's torch_dist writer needs it (undeclared there)
    except ImportError:
        raise CheckpointError("saving a checkpoint needs psutil (megatron-core's torch_dist writer "
                              "imports it): pip install psutil") from None
    if target.exists() and not target.is_dir():
        raise CheckpointError(f"{target} is a file; pass a new or empty directory to save into")
    problem = None
    if target.is_dir() and any(target.iterdir()):
        problem = f"{target} is not empty; pass a new or empty directory to save into"
    problem = _first_on_any_rank(problem)  # checked on every rank before any rank writes
    if problem:
        raise CheckpointError(problem)
    target.mkdir(parents=True, exist_ok=True)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    serialization = mcore.import_module(f"{_DIST_CHECKPOINTING}.serialization")
    serialization.save({MODEL_KEY: model.sharded_state_dict(), **(common or {})}, str(target))
    return target


def save_megatron_lm_checkpoint(model: Any, directory: PathLike, args: Any, iteration: int) -> Path:
    """Save ``model`` the way Megatron-LM's training loop saves: ``directory/iter_NNNNNNN/`` (a
    :func:`save_checkpoint` with ``args``, ``iteration`` and ``checkpoint_version`` 3.0 in the
    common state) and ``directory/latest_checkpointed_iteration.txt`` naming it, so ``ab --load
    directory`` and Megatron-LM's ``--load directory`` both read it. Every rank must call it.

    Args:
        model: a megatron-core ``GPTModel``.
        directory: the save directory; created if missing, must be empty.
        args: Megatron-LM's training arguments (e.g.
            :func:`megatron_ext.harness.checkpoint_args.megatron_lm_args`).
        iteration: the training iteration, >= 1 (Megatron-LM refuses a tracker naming 0).

    Returns:
        The ``iter_NNNNNNN`` directory.

    Raises:
        CheckpointError: ``iteration`` < 1; ``directory`` is a file or not empty; see
            :func:`save_checkpoint`.
    """
    if iteration < 1:
        raise CheckpointError(f"--iteration {iteration}: Megatron-LM reads only iterations >= 1 from "
                              f"{TRACKER_FILE}; pass 1 or more")
    root = Path(directory).expanduser()
    if root.exists() and not root.is_dir():
        raise CheckpointError(f"{root} is a file; pass a new or empty directory to save into")
    problem = _first_on_any_rank(f"{root} is not empty; pass a new or empty directory to save into"
                                 if root.is_dir() and any(root.iterdir()) else None)
    if problem:
        raise CheckpointError(problem)
    target = save_checkpoint(model, root / f"iter_{iteration:07d}",
                             {"args": args, "iteration": iteration, "checkpoint_version": 3.0})
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        (root / TRACKER_FILE).write_text(f"{iteration}\n")
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    return target
