"""What an ``ab`` run reads, resolved and checked before a model or engine is built: the case (a
shipped name, a case YAML or a Megatron ``model_config.yaml``), the model-parallel layout, the
tokenizer, ``--prompts FILE`` in place of the case's requests, and the checkpoints of ``--load`` /
``--update-from``. Bad input fails here with one line (a :class:`~megatron_ext.errors.MegatronExtError`
subclass naming the problem and the fix), not after minutes of engine steps."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Sequence

from ..errors import MegatronExtError
from .cases import Case, CaseFileError, load_case
from .launch import check_layout
from .megatron_case import MegatronCase, is_megatron_case_file, load_megatron_case, megatron_tokenizer
from .tokenizer import Tokenizer

if TYPE_CHECKING:  # checkpoint imports torch: only a run with --load / --update-from pays
    from .checkpoint import CheckpointSource


class RunInputError(MegatronExtError, ValueError):
    """Flags of a run that do not go together (the message names them and the fix)."""


@dataclass
class RunInputs:
    """The inputs of one ``ab`` run.

    Attributes:
        case: the case to run (after :func:`resolve_requests`: with ``--prompts`` and
            ``--top-n-logprobs`` applied).
        tensor_model_parallel_size, pipeline_model_parallel_size: the layout (a Megatron case's
            where it gives one, else the command line's); it fits torchrun's ``WORLD_SIZE``.
        load: the checkpoint path of ``--load``, else the Megatron case's ``--load``, or None.
        tokenizer_path, tokenizer_library: ``--tokenizer`` / ``--tokenizer-library``, else the
            Megatron case's tokenizer, or None (megatron-core's byte-level tokenizer).
        megatron_case: the Megatron ``model_config.yaml`` read, or None for a case YAML.
        tokenizer: the tokenizer loaded by :func:`resolve_requests`; None: the default.
    """

    case: Case
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    load: Optional[str] = None
    tokenizer_path: Optional[str] = None
    tokenizer_library: Optional[str] = None
    megatron_case: Optional[MegatronCase] = None
    tokenizer: Optional[Tokenizer] = None


def read_case(case: str, device: str, tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1,
              load: Optional[str] = None, tokenizer: Optional[str] = None,
              tokenizer_library: Optional[str] = None, allow_unknown_args: bool = False) -> RunInputs:
    """The case of ``ab --case``: a shipped name, a case file, or a Megatron ``model_config.yaml``
    (its tokenizer, ``--load`` and layout hold where the command line gives none: ``ab --tokenizer``
    and ``ab --load`` win, the file's layout wins over the command line's). ``allow_unknown_args``:
    a Megatron case's arguments not known to megatron-ext are left out instead of refused.

    Raises:
        CaseFileError: the case cannot be read (see :func:`~megatron_ext.harness.cases.load_case`,
            :func:`~megatron_ext.harness.megatron_case.load_megatron_case`), or a Megatron case
            asks for ``--use-checkpoint-args`` without a checkpoint.
        LaunchError: the Megatron case's layout does not fit ``WORLD_SIZE``.
    """
    if not is_megatron_case_file(case):
        return RunInputs(load_case(case), tensor_model_parallel_size, pipeline_model_parallel_size, load,
                         tokenizer, tokenizer_library)
    megatron_case = load_megatron_case(Path(case), device, load_given=load is not None, allow_unknown=allow_unknown_args)
    if megatron_case.tokenizer is not None and tokenizer is None:
        tokenizer, tokenizer_library = megatron_tokenizer(megatron_case.tokenizer, case)
    if megatron_case.use_checkpoint_args and not (load or megatron_case.load):
        raise CaseFileError(f"{case}: --use-checkpoint-args without --load: give the checkpoint (ab --load DIR)")
    tp = megatron_case.tensor_model_parallel_size or tensor_model_parallel_size
    pp = megatron_case.pipeline_model_parallel_size or pipeline_model_parallel_size
    check_layout(tp, pp, "ab")
    return RunInputs(megatron_case.case, tp, pp, load or megatron_case.load, tokenizer, tokenizer_library,
                     megatron_case)


def resolve_tokenizer(path: Optional[str], library: Optional[str] = None) -> Optional[Tokenizer]:
    """The tokenizer of ``--tokenizer PATH [--tokenizer-library LIB]``, or None for the default.

    Loaded before any engine is built, so a bad path or a missing library fails at once.

    Raises:
        RunInputError: ``--tokenizer-library`` without ``--tokenizer``.
        TokenizerError: see :func:`megatron_ext.harness.tokenizer.load_tokenizer`.
    """
    if path is None:
        if library is not None:
            raise RunInputError("--tokenizer-library names the library of --tokenizer PATH; pass --tokenizer too")
        return None
    from .tokenizer import load_tokenizer

    return load_tokenizer(path, library)


def resolve_requests(inputs: RunInputs, prompts: Optional[str] = None, samples: Optional[int] = None,
                     num_tokens_to_generate: Optional[int] = None,
                     top_n_logprobs: Optional[int] = None) -> RunInputs:
    """``inputs`` with its tokenizer loaded and the case's requests settled: the prompts of
    ``--prompts FILE`` in place of the case's (``samples`` and ``num_tokens_to_generate`` where a
    line does not say), and ``--top-n-logprobs`` in its sampling.

    Raises:
        TokenizerError: the tokenizer cannot be loaded, or its IDs exceed the case model's
            ``vocab_size`` (checked here without ``--load``; with it the model may come from the
            checkpoint's args, which ``run_ab`` checks).
        RunInputError: ``samples`` or ``num_tokens_to_generate`` without ``prompts``.
        PromptFileError: see :func:`megatron_ext.harness.prompts.prompts_case`.
    """
    case = inputs.case
    tokenizer = resolve_tokenizer(inputs.tokenizer_path, inputs.tokenizer_library)
    if tokenizer is not None and inputs.load is None:
        from .tokenizer import check_vocab_fits

        check_vocab_fits(tokenizer, case.model.vocab_size, f"case {case.name}")
    if prompts is not None:
        from .prompts import prompts_case

        case = prompts_case(case, Path(prompts), samples or 1, num_tokens_to_generate, tokenizer)
    elif samples is not None or num_tokens_to_generate is not None:
        raise RunInputError("--samples and --num-tokens-to-generate apply to --prompts FILE; "
                            "with a case file, set 'samples' and 'num_tokens_to_generate' per request in it")
    if top_n_logprobs is not None:
        case = case.model_copy(update={"sampling": case.sampling.model_copy(
            update={"top_n_logprobs": top_n_logprobs})})
    return dataclasses.replace(inputs, case=case, tokenizer=tokenizer)


def resolve_checkpoints(case: Case, load: Optional[str], update_from: Optional[Sequence[str]] = None
                        ) -> tuple[Optional[CheckpointSource], list[CheckpointSource]]:
    """The checkpoints of ``--load`` (or None) and of ``--update-from`` (empty without it:
    ``run_ab`` then resolves the case's own ``weight_updates.checkpoints``), found before the model
    or any engine is built.

    Raises:
        CheckpointError: a path that is no checkpoint (``--update-from``'s named as such).
        WeightUpdateError: see :func:`megatron_ext.harness.ab.update_checkpoints`.
    """
    from .checkpoint import CheckpointError, resolve_checkpoint

    checkpoint = None if load is None else resolve_checkpoint(load)
    if not update_from:
        return checkpoint, []
    from .ab import update_checkpoints

    try:
        sources = [resolve_checkpoint(path) for path in update_from]
    except CheckpointError as exc:  # its message names --load, the flag it usually checks
        raise CheckpointError(str(exc).replace("--load ", "--update-from ", 1)) from None
    return checkpoint, update_checkpoints(case, sources)
