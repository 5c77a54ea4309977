"""``megatron-ext`` command line. ``python -m megatron_ext`` is the same program."""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, NoReturn, Optional, Sequence

from rich.table import Table

from . import mcore
from .console import CtrlC, LibraryOutput, RunProgress, library_output, log_path, report_console, settle_log
from .errors import MegatronExtError
from .harness.launch import torchrun_world

if TYPE_CHECKING:  # these import wrapt, torch or megatron-core: `megatron-ext --help` and argument errors need none
    from .harness.ab import ABResult
    from .harness.checkpoint import CheckpointSource
    from .harness.megatron_case import MegatronCase
    from .harness.run_inputs import RunInputs
    from .patching import PatchResult

#: The narrowest report: below it rich folds every cell and the verdict into slivers.
MIN_WIDTH = 40

_STATE_STYLE = {
    "applied": "green",
    "applicable": "yellow",
    "not needed": "cyan",
    "refused": "bold red",
}


def _tree_words(version: str, tree: tuple[str, ...]) -> str:
    """``megatron-core 0.20.0 (code of Megatron-LM 2a75ac12c5)``: the installed tree, for titles."""
    from .fingerprints import tree_labels

    code = f"code of {tree_labels(tree)}" if tree else "code no known tree has in full: each patch decided on its own"
    return f"megatron-core {version} ({code})"


def _status_table(version: str, tree: tuple[str, ...], results: list[PatchResult]) -> Table:
    table = Table(title=f"megatron-ext patches for {_tree_words(version, tree)}", show_lines=True)
    for column in ("fault", "patch", "target", "state", "reason", "evidence"):
        table.add_column(column, overflow="fold")
    for result in results:
        style = _STATE_STYLE.get(result.state.value, "")
        table.add_row(
            result.fault,
            result.patch,
            "\n".join(result.targets),
            f"[{style}]{result.state.value}[/]" if style else result.state.value,
            result.reason,
            result.evidence,
        )
    return table


def cmd_status(args: argparse.Namespace) -> int:
    """Print installed megatron-core version and each patch's state. Exit 1 if any is refused."""
    from .api import installed_tree, status  # imports torch and megatron-core: only the commands that need it pay

    version = mcore.installed_version()
    results = status(force=args.force or None)
    tree = installed_tree()
    if args.trees:
        return _print_trees(args, version, tree)
    from .harness.hybrid import MAMBA_STATE_DTYPE_RULE  # after status(): it names a missing megatron-core
    if args.json:
        payload = {"megatron_core_version": version, "known_tree": list(tree),
                   "patches": [r.as_dict() for r in results], "rules": [MAMBA_STATE_DTYPE_RULE]}
        print(json.dumps(payload, indent=2))
    else:
        console = report_console(args.width)
        console.print(_status_table(version, tree, results))
        console.print(f"rule: {MAMBA_STATE_DTYPE_RULE}", markup=False, highlight=False, soft_wrap=True)
    return 1 if any(r.state.value == "refused" for r in results) else 0


def _print_trees(args: argparse.Namespace, version: str, tree: tuple[str, ...]) -> int:
    """``status --trees``: every known tree (fingerprints recorded), the installed one marked."""
    from dataclasses import asdict

    from .fingerprints import known_trees

    trees = known_trees()
    if args.json:
        print(json.dumps({"megatron_core_version": version, "known_tree": list(tree),
                          "known_trees": [asdict(t) for t in trees.values()]}, indent=2))
        return 0
    table = Table(title=f"known trees; installed: {_tree_words(version, tree)}")
    for column in ("tree", "version", "date", "commit", "source", "installed"):
        table.add_column(column, overflow="fold")
    for name, known in trees.items():
        table.add_row(known.label, known.version, known.date, known.commit, known.source, "yes" if name in tree else "")
    report_console(args.width).print(table)
    return 0


def cmd_ab(args: argparse.Namespace) -> int:
    """Run a case with prefix caching off and on; exit 0 only if bit-identical and audit-clean."""
    from .harness.ab import run_ab
    from .harness.cases import shipped_cases

    if args.list_cases:
        print("\n".join(shipped_cases()))
        return 0
    inputs, checkpoint, update_from = _ab_inputs(args)
    rank = torchrun_world()[0]
    log = _library_log(args, "ab")
    try:
        with library_output(log) as output, _progress(args, inputs.case.name, output, rank) as progress:
            result = run_ab(inputs.case, patched=not args.unpatched, device=args.device,
                            on_step=progress.on_step, on_run=progress.on_run,
                            tensor_model_parallel_size=inputs.tensor_model_parallel_size,
                            pipeline_model_parallel_size=inputs.pipeline_model_parallel_size,
                            load=checkpoint, tokenizer=inputs.tokenizer, update_from=update_from,
                            trainer_logprobs=args.trainer_logprobs)
    except BaseException as exc:  # noqa: BLE001 - keep the log; multi-rank: name the rank, exit non-zero
        if _rank_failed(exc, log):
            return 1
        _keep_log_after_error(log, args.keep_log)
        raise
    if inputs.megatron_case is not None:
        result.unknown_args_allowed = inputs.megatron_case.unknown_allowed
    _report_ab(args, result, output, rank)
    return result.exit_code()


def _ab_inputs(args: argparse.Namespace) -> tuple[RunInputs, Optional[CheckpointSource], list[CheckpointSource]]:
    """What ``ab`` runs, checked before the model or any engine is built, cheapest first: the
    ``--trainer-logprobs`` mode, the launch, the output files, the case, tokenizer and prompts,
    Triton's environment for a hybrid case, the checkpoints. Rank 0 prints how a Megatron case mapped.

    Raises:
        MegatronExtError: the subclass of the first check that fails (one line, exit 2).
    """
    from .harness.launch import check_device, check_layout
    from .harness.output_files import check_output_files
    from .harness.run_inputs import read_case, resolve_checkpoints, resolve_requests
    from .harness.triton_env import ensure_hybrid_cpu_environment

    if args.trainer_logprobs is not None:  # a bad mode is refused before anything else
        from .harness.trainer_logprobs import check_mode

        check_mode(args.trainer_logprobs)
    check_layout(args.tensor_model_parallel_size, args.pipeline_model_parallel_size, "ab")
    check_device(args.device)
    check_output_files({"--json": args.json, "--plot": args.plot})
    inputs = read_case(args.case, args.device, args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                       args.load, args.tokenizer, args.tokenizer_library, args.allow_unknown_args)
    if inputs.megatron_case is not None and torchrun_world()[0] == 0:
        _print_megatron_mapping(inputs.megatron_case)
    inputs = resolve_requests(inputs, args.prompts, args.samples, args.num_tokens_to_generate, args.top_n_logprobs)
    ensure_hybrid_cpu_environment(inputs.case, args.device, getattr(args, "program", False))
    return (inputs, *resolve_checkpoints(inputs.case, inputs.load, args.update_from))


def _rank_failed(exc: BaseException, log: Optional[Path]) -> bool:
    """Under several ranks, an exception other than megatron-ext's own (or Ctrl-C) ends this rank:
    print it with the rank named (and where its library log is) and say so; else False (re-raise)."""
    rank, world_size = torchrun_world()
    if world_size == 1 or not isinstance(exc, Exception) or isinstance(exc, MegatronExtError):
        return False
    from .harness.distributed import RankFailedError

    where = f" (megatron-core / torch / gloo output of this rank: {log})" if log else ""
    if isinstance(exc, RankFailedError):  # names the rank already
        print(f"megatron-ext ab: {exc}{where}", file=sys.stderr, flush=True)
    else:
        traceback.print_exc()
        print(f"megatron-ext ab: rank {rank} of {world_size} failed: {type(exc).__name__}: {exc}"
              f"{where}", file=sys.stderr, flush=True)
    return True


def _report_ab(args: argparse.Namespace, result: ABResult, output: LibraryOutput, rank: int) -> None:
    """Rank 0 reports for every rank (and writes ``--json`` / ``--plot``, and keeps its log after a
    failure); the other ranks settle their own logs (a raising rank kept its own)."""
    from .harness.distributed import describe_layout
    from .harness.report import print_report, write_plot

    if rank != 0:
        output.settle(passed=True, keep=args.keep_log)
        return
    console = report_console(args.width)
    if torchrun_world()[1] > 1:
        console.print(describe_layout(result.ranks))
    print_report(result, console, notes=_log_notes(output, result.exit_code() == 0, args.keep_log))
    if args.json:
        Path(args.json).write_text(json.dumps(result.as_json(), indent=2))
    if args.plot:
        write_plot(result, Path(args.plot))


def _print_megatron_mapping(megatron_case: MegatronCase) -> None:
    """The Megatron arguments ab ignored, and the mappings whose meaning differs, once each."""
    for arg, how in megatron_case.notes:
        print(f"megatron case: {arg}: {how}")
    for arg, why in megatron_case.ignored:
        print(f"megatron case: ignored {arg}: {why}")
    for arg in megatron_case.unknown_allowed:
        print(f"megatron case: ran without {arg}: not known to megatron-ext (--allow-unknown-args)")


def _library_log(args: argparse.Namespace, command: str) -> Optional[Path]:
    """Where megatron-core's, torch's and gloo's own output goes: a log file, or inline (``None``)
    with ``--verbose``."""
    return None if args.verbose else log_path(command, torchrun_world()[0])


@contextlib.contextmanager
def _progress(args: argparse.Namespace, case_name: str, output: LibraryOutput,
              rank: int = 0) -> Iterator[RunProgress]:
    """Progress of a command's engine runs: rank 0 only, none with ``--no-progress``."""
    progress = RunProgress(case_name, output, enabled=not args.no_progress and rank == 0)
    try:
        yield progress
    finally:
        progress.close()


def _log_notes(output: LibraryOutput, passed: bool, keep: bool) -> list[str]:
    """The report line naming the library log when it is kept (a failure, ``--keep-log``); a passing
    run's log is removed here (:func:`megatron_ext.console.settle_log`)."""
    line = output.settle(passed, keep)
    return [line] if line else []


def _keep_log_after_error(log: Optional[Path], keep: bool) -> None:
    """An exception or Ctrl-C is leaving a command: keep its library log (megatron-core's own
    messages about what went wrong are there) and name it on stdout, so the one error line on
    stderr stays one line."""
    line = settle_log(log, "error", keep)
    if line:
        print(line, flush=True)


def cmd_save_checkpoint(args: argparse.Namespace) -> int:
    """Save the case's seeded model as a megatron-core distributed checkpoint (torch_dist) in
    Megatron-LM's layout (``DIR/iter_NNNNNNN`` + ``latest_checkpointed_iteration.txt``), with
    Megatron-LM's training arguments of the model in its common state.

    The model is built exactly as ``ab`` builds it (same case model section, same seed unless
    ``--seed``), on CPU ranks; under torchrun each rank writes its TP/PP shards.
    """
    from .cpu_backend import cpu_backend
    from .harness.cases import load_case
    from .harness.checkpoint import save_megatron_lm_checkpoint
    from .harness.checkpoint_args import megatron_lm_args
    from .harness.engine import build_model, ensure_model_parallel, padded_vocab_size
    from .harness.launch import check_layout
    from .harness.triton_env import ensure_hybrid_cpu_environment

    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    check_layout(tp, pp, "save-checkpoint")
    case = load_case(args.case)
    ensure_hybrid_cpu_environment(case, "cpu", getattr(args, "program", False))
    if args.seed is not None:
        case = case.model_copy(update={"model": case.model.model_copy(update={"seed": args.seed})})
    training_args = megatron_lm_args(case.model, padded_vocab_size(case.model.vocab_size, tp), tp, pp)
    log = _library_log(args, "save-checkpoint")
    try:
        with library_output(log) as output, cpu_backend(mamba=case.model.is_hybrid):
            ensure_model_parallel(tp, pp)
            model = build_model(case)
            path = save_megatron_lm_checkpoint(model, args.directory, training_args, args.iteration)
    except BaseException:
        _keep_log_after_error(log, args.keep_log)
        raise
    if torchrun_world()[0] == 0:
        for note in _log_notes(output, True, args.keep_log):
            print(note)
        print(f"saved the model of case '{case.name}' (seed {case.model.seed}, "
              f"{case.model.params_dtype}, TP={tp} PP={pp}) to {path} (torch_dist, iteration "
              f"{args.iteration}, Megatron-LM args in its common state); use it with: "
              f"megatron-ext ab --case {args.case} --load {args.directory} (or a case without a model "
              "section: the model from the checkpoint's args)")
    return 0


def cmd_soak(args: argparse.Namespace) -> int:
    """``ab`` on a generated workload of ``--requests`` requests (:func:`megatron_ext.harness.soak.soak_case`);
    exit codes as ``ab``."""
    from .harness.ab import run_ab
    from .harness.cases import dump_case
    from .harness.output_files import check_output_files
    from .harness.report import print_report
    from .harness.run_inputs import resolve_tokenizer
    from .harness.soak import SOAK_MODELS, fit_vocab, soak_case, soak_lines, soak_summary
    from .harness.triton_env import ensure_hybrid_cpu_environment

    check_output_files({"--json": args.json, "--dump-case": args.dump_case})
    policies = list(dict.fromkeys(args.policy or ("ref_zero", "lru")))  # a repeated --policy runs once
    tokenizer = resolve_tokenizer(args.tokenizer, args.tokenizer_library)
    case = soak_case(args.requests, args.seed, policies, chunked_prefill=not args.no_chunked_prefill,
                     update_every=args.update_every,
                     model=next((kind for kind in SOAK_MODELS if getattr(args, kind, False)), "gpt"),
                     rope_type=args.rope_type)
    if tokenizer is not None:
        case, grown = fit_vocab(case, tokenizer.vocab_size)
        if grown:
            print(f"soak: {grown} to fit the token IDs of --tokenizer {args.tokenizer}")
    if args.dump_case:
        Path(args.dump_case).write_text(dump_case(case))
    ensure_hybrid_cpu_environment(case, "cpu", getattr(args, "program", False))
    log = _library_log(args, "soak")
    try:
        with library_output(log) as output, _progress(args, case.name, output) as progress:
            result = run_ab(case, patched=not args.unpatched, on_step=progress.on_step, on_run=progress.on_run,
                            tokenizer=tokenizer)
    except BaseException:
        _keep_log_after_error(log, args.keep_log)
        raise
    summary = soak_summary(result)
    print_report(result, report_console(args.width), only_divergent=True,
                 notes=soak_lines(summary) + _log_notes(output, result.exit_code() == 0, args.keep_log))
    if args.json:
        Path(args.json).write_text(json.dumps({"soak": summary, **result.as_json()}, indent=2))
    return result.exit_code()


def cmd_compare(args: argparse.Namespace) -> int:
    """Compare runs recorded in two ab/soak JSON files, request by request, bit for bit.

    Exit 0 if every compared pair is bit-identical, 1 if any request differs, 2 bad input.
    """
    from .harness.recorded import compare_recorded, pair_runs
    from .harness.output_files import check_output_files
    from .harness.report import print_comparison, write_diff_plot

    check_output_files({"--json": args.json, "--plot": args.plot})
    comparisons = [compare_recorded(a, b) for a, b in pair_runs(args.a, args.b)]
    identical = all(c.bit_identical for c in comparisons)
    if args.json:
        Path(args.json).write_text(json.dumps({"verdict": "pass" if identical else "fail",
                                               "pairs": [c.as_json() for c in comparisons]}, indent=2))
    if args.plot:
        write_diff_plot([(f"{c.a.name} vs {c.b.name}", c.diffs, c.b.outputs) for c in comparisons], Path(args.plot))
    print_comparison(comparisons, report_console(args.width), only_divergent=args.only_divergent)
    return 0 if identical else 1


def cmd_patch_source(args: argparse.Namespace) -> int:
    """Apply / check / revert the source patches on a megatron-core tree."""
    from .source_patches import default_tree, patch_source, series_for, tree_version

    tree = Path(args.path) if args.path else default_tree()
    version = tree_version(tree)
    series = series_for(tree)[0]  # the release, or the known Megatron-LM commit whose series applies
    results = patch_source(tree, check=args.check, revert=args.revert)
    print(f"megatron-core {version}{'' if series == version else f' (series of Megatron-LM {series})'} at {tree}:")
    for result in results:
        print(f"  {result.state.value:>15}  {result.patch}")
    return 0


def _width(text: str) -> int:
    value = int(text)
    if value < MIN_WIDTH:
        raise argparse.ArgumentTypeError(f"must be >= {MIN_WIDTH} columns (or left out), got {value}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _add_layout_arguments(parser: argparse.ArgumentParser) -> None:
    """Megatron's model-parallel flags (launch T x P ranks with torchrun; CPU ranks over gloo)."""
    parser.add_argument("--tensor-model-parallel-size", type=_positive_int, default=1, metavar="T",
                        help="megatron-core tensor parallel size (launch T x P ranks with torchrun; "
                        "CPU ranks over gloo)")
    parser.add_argument("--pipeline-model-parallel-size", type=_positive_int, default=1, metavar="P",
                        help="megatron-core pipeline parallel size (T x P ranks)")


def _add_tokenizer_arguments(parser: argparse.ArgumentParser, what: str, note: str) -> None:
    """``--tokenizer PATH`` and ``--tokenizer-library LIB`` (ab and soak)."""
    parser.add_argument("--tokenizer", metavar="PATH",
                        help=f"tokenize {what} with this tokenizer, loaded by megatron-core "
                        "(megatron.core.tokenizers): a directory or file with tokenizer_metadata.json "
                        "beside it, or any tokenizer with --tokenizer-library (default: megatron-core's "
                        f"byte-level tokenizer, 257 IDs); {note}")
    parser.add_argument("--tokenizer-library", metavar="LIB",
                        choices=("huggingface", "sentencepiece", "tiktoken", "megatron", "byte-level", "null-text"),
                        help="with --tokenizer: megatron-core's library for it (huggingface, sentencepiece, "
                        "tiktoken, ...), in place of a tokenizer_metadata.json (nothing is written into "
                        "PATH); Hugging Face tokenizers need transformers: pip install 'megatron-ext[hf]'")


#: The output flags subcommands share, each declared once (:func:`_add_output_arguments`); ``{json}``:
#: what the subcommand's ``--json`` writes.
_OUTPUT_FLAGS: dict[str, dict[str, Any]] = {
    "--json": dict(metavar="PATH", help="also write {json} as JSON"),
    "--plot": dict(metavar="PNG", help="also plot |Δ log-prob| per step (matplotlib)"),
    "--no-progress": dict(action="store_true", help="no progress bar"),
    "--width": dict(type=_width, default=None,
                    help="table width in columns (>= 40; default: the terminal's, or unbounded in a log)"),
    "--verbose": dict(action="store_true",
                      help="show megatron-core's, torch's and gloo's own output inline (default: "
                      "gathered into a log file in the temporary directory, removed after a PASS, "
                      "kept and named after a failure or an error)"),
    "--keep-log": dict(action="store_true",
                       help="keep the log file of megatron-core's, torch's and gloo's output after a "
                       "PASS too, and name it"),
}


def _add_output_arguments(parser: argparse.ArgumentParser, *flags: str, json_writes: str = "") -> None:
    """Add the shared output flags ``flags`` (keys of :data:`_OUTPUT_FLAGS`) in that order, the
    order ``--help`` lists them; ``json_writes``: what ``--json PATH`` writes."""
    for flag in flags:
        options = dict(_OUTPUT_FLAGS[flag])
        options["help"] = options["help"].format(json=json_writes)
        parser.add_argument(flag, **options)


class _Parser(argparse.ArgumentParser):
    """argparse's parser (and its subcommands': ``add_subparsers`` builds them of this class) whose
    usage errors are one line on stderr, exit 2: the problem, then where the options are listed
    (argparse prints its usage block first, which a log shows as noise above the error)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}; `{self.prog} --help` lists the options\n")


def build_parser() -> argparse.ArgumentParser:
    """The ``megatron-ext`` argument parser, one subcommand per ``_add_*`` function below."""
    parser = _Parser(
        prog="megatron-ext",
        description="Prefix-caching fixes and bit-identity checks for megatron-core's dynamic inference.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for add_subcommand in (_add_status, _add_ab, _add_save_checkpoint, _add_soak, _add_compare, _add_patch_source):
        add_subcommand(sub)
    return parser


def _add_status(sub: Any) -> None:
    p_status = sub.add_parser("status", help="show what each runtime patch would do here")
    p_status.add_argument("--json", action="store_true", help="machine-readable output")
    p_status.add_argument("--force", action="store_true", help="as MEGATRON_EXT_FORCE=1")
    p_status.add_argument("--trees", action="store_true",
                          help="list the known trees (releases and Megatron-LM commits with recorded fingerprints) "
                               "and which one the installed code is")
    _add_output_arguments(p_status, "--width")
    p_status.set_defaults(func=cmd_status)


def _add_ab(sub: Any) -> None:
    p_ab = sub.add_parser(
        "ab", help="prefix caching off vs on through megatron-core's dynamic engine, bit for bit",
        description="Exit codes: 0 bit-identical and every audit holds; 1 divergence, audit "
        "violation or unmet expectation; 2 bad input (case file, --load checkpoint, --tokenizer, output path, device); 3 platform not batch-invariant; 130 interrupted (Ctrl-C). Multi-rank: "
        "'torchrun --nproc-per-node T*P -m megatron_ext ab --tensor-model-parallel-size T "
        "--pipeline-model-parallel-size P'; every rank runs the audits, rank 0 reports (and writes "
        "--json/--plot), every rank exits non-zero if any rank failed.")
    p_ab.add_argument("--case", default="rl_rollouts",
                      help="shipped case name or path to a case YAML file (default: rl_rollouts)")
    p_ab.add_argument("--unpatched", action="store_true",
                      help="run megatron-core as released, without megatron-ext's runtime patches")
    _add_output_arguments(p_ab, "--json", "--plot", json_writes="the results")
    p_ab.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    _add_layout_arguments(p_ab)
    p_ab.add_argument("--load", metavar="DIR",
                      help="load the weights from a Megatron distributed checkpoint (torch_dist) or a "
                      "Megatron-LM save directory (latest_checkpointed_iteration.txt -> iter_NNNNNNN/) "
                      "after building the case's model; its model section must match the checkpoint. "
                      "A case without a model section builds the model from the checkpoint's Megatron-LM "
                      "args (as Megatron's --use-checkpoint-args); arguments it cannot build exit 2. "
                      "Any TP/PP layout loads any other (dist-checkpointing reshards)")
    p_ab.add_argument("--allow-unknown-args", action="store_true",
                      help="with a Megatron model_config.yaml: run without the arguments megatron-ext does not "
                      "know (default: exit 2 naming them, since they may change the model or the engine); "
                      "the verdict and --json name them")
    p_ab.add_argument("--update-from", metavar="DIR", action="append",
                      help="for a case with weight_updates of kind checkpoint: the checkpoint (same forms as "
                      "--load) loaded into the model at each weight update; once for every update, or "
                      "repeated once per update (in place of the case's weight_updates.checkpoints)")
    p_ab.add_argument("--prompts", metavar="FILE",
                      help="run these prompts instead of the case's requests: JSON Lines (.jsonl: "
                      "{\"prompt\", \"samples\", \"num_tokens_to_generate\", \"arrival_step\"}, only "
                      "prompt required) or plain text, one prompt per line; model, inference config and "
                      "policies still come from --case")
    p_ab.add_argument("--samples", type=_positive_int, metavar="N",
                      help="with --prompts: copies of each prompt where its line does not say (Megatron's "
                      "--inference-repeat-n; default 1)")
    p_ab.add_argument("--num-tokens-to-generate", type=_positive_int, metavar="N",
                      help="with --prompts: tokens to generate where a line does not say (default 8)")
    _add_tokenizer_arguments(p_ab, "the prompts", "its vocabulary must fit the model's vocab_size")
    p_ab.add_argument("--top-n-logprobs", type=_positive_int, metavar="N",
                      help="also record megatron-core's top-n log-probs of every generated token "
                      "(SamplingParams.top_n_logprobs) and compare them bit for bit")
    p_ab.add_argument("--trainer-logprobs", nargs="?", const="matched", default=None, metavar="{matched,megatron}",
                      help="after each run, the same GPTModel's training forward (no KV cache, full sequences) "
                      "computes the log-prob of every generated token as Megatron-LM RL does, compared per token "
                      "with the engine's. matched (the default of the bare flag; CPU backend only): the training "
                      "forward uses the engine's own kernels (batch-invariant products, the reference attention): "
                      "proves the engine's paged / prefix-cached / chunked path computes what a cache-free "
                      "forward computes, bit for bit; a token that differs fails the run; a fault inside the "
                      "shared kernels cannot show. megatron: megatron-core's training forward as released (on "
                      "the CPU: torch's CPU kernels against the CPU backend's engine, not a GPU stack); figures "
                      "for information. GPT "
                      "models (not hybrid); with weight_updates each round is compared with its own weights, "
                      "requests in flight across an update are left out; a run that compares no token fails")
    p_ab.add_argument("--list-cases", action="store_true", help="print the shipped case names")
    _add_output_arguments(p_ab, "--no-progress", "--width", "--verbose", "--keep-log")
    p_ab.set_defaults(func=cmd_ab)


def _add_save_checkpoint(sub: Any) -> None:
    p_save = sub.add_parser(
        "save-checkpoint", help="save the case's seeded model as a Megatron distributed checkpoint",
        description="Builds the model exactly as 'ab' does (the case's model section and seed) and "
        "saves it with megatron-core's dist_checkpointing.save (torch_dist format) in Megatron-LM's "
        "layout: DIR (new or empty)/iter_NNNNNNN with Megatron-LM's training arguments (args, "
        "iteration, checkpoint_version) in its common state, and DIR/latest_checkpointed_iteration.txt; "
        "'ab --load DIR' (with a case without a model section: the model from those args) and "
        "Megatron-LM's --load DIR read it. Multi-rank: 'torchrun --nproc-per-node T*P -m "
        "megatron_ext save-checkpoint DIR --tensor-model-parallel-size T "
        "--pipeline-model-parallel-size P'. Needs psutil (megatron-core's writer).")
    p_save.add_argument("directory", metavar="DIR", help="where to save (created; must be empty)")
    p_save.add_argument("--case", default="rl_rollouts",
                        help="shipped case name or case YAML whose model is saved (default: rl_rollouts)")
    p_save.add_argument("--seed", type=int, default=None, help="weights seed (default: the case's model.seed)")
    p_save.add_argument("--iteration", type=_positive_int, default=1, metavar="N",
                        help="training iteration recorded: DIR/iter_NNNNNNN and the tracker file (default: 1)")
    _add_layout_arguments(p_save)
    _add_output_arguments(p_save, "--verbose", "--keep-log")
    p_save.set_defaults(func=cmd_save_checkpoint)


def _add_soak(sub: Any) -> None:
    p_soak = sub.add_parser(
        "soak", help="ab on a generated workload of many requests sharing prefixes, under KV pressure",
        description="Generates a reproducible workload (megatron_ext/harness/soak.py: RL rollouts, multi-turn "
        "conversations, shared system prompts; Poisson arrivals; without a model option chunked prefill and a 48-block KV pool "
        "that pauses requests and makes LRU evict; each model option says its own) and runs it as 'ab' does: caching off once, on "
        "once per policy. Exit codes as 'ab'. Cost on one CPU core: about 0.3 s per request for the "
        "caching-off run and 0.2 s per caching-on run (2000 requests, both policies: 15-20 minutes).")
    p_soak.add_argument("--requests", type=_positive_int, default=2000, metavar="N",
                        help="engine requests to generate (default: 2000)")
    p_soak.add_argument("--seed", type=int, default=0, help="workload seed (default: 0)")
    p_soak.add_argument("--policy", action="append", choices=("ref_zero", "lru"),
                        help="eviction policy for B, repeatable (default: ref_zero and lru)")
    p_soak.add_argument("--no-chunked-prefill", action="store_true",
                        help="chunked prefill off (max_tokens raised to 256 so every prompt fits a step; "
                             "--mla never chunks)")
    p_soak.add_argument("--update-every", type=_positive_int, default=None, metavar="N",
                        help="a weight update every N engine steps: seeded noise added to every parameter, "
                        "then megatron_ext.invalidate_prefix_cache(engine) (requests arriving after an "
                        "update belong to the next round; the stale-hit audit counts matches of older KV)")
    soak_model = p_soak.add_mutually_exclusive_group()
    soak_model.add_argument("--hybrid", action="store_true",
                        help="a tiny hybrid (Mamba + attention) model with a Mamba prefix cache and shorter requests "
                        "(prompts <= 64 tokens); Mamba restores are audited. On the CPU set TRITON_INTERPRET=1 "
                        "MAMBA_DETERMINISTIC=1 (seconds per engine step: use tens of requests)")
    soak_model.add_argument("--moe", action="store_true",
                        help="a mixture-of-experts model (4 experts, top-2, routing replay): the routing replay "
                        "is audited and the allocator's stored block routing reported at its largest")
    soak_model.add_argument("--mla", action="store_true",
                        help="a multi-latent attention model (mla_tiny's: latent KV cache, blocks of 64 tokens, no "
                        "chunked prefill, a pool sized so no request waits; megatron-core 0.18 / 0.19): latent writes sent to the dummy block are reported")
    p_soak.add_argument("--rope-type", choices=("rope", "yarn"), default=None,
                        help="with --mla: the MLA model's RoPE (Megatron-LM's --rope-type): rope (the default, "
                        "mla_tiny's) or yarn (megatron-core's YaRN with its default parameters, Megatron's MLA default)")
    soak_model.add_argument("--mtp", action="store_true",
                        help="MTP speculative decoding (mtp_speculative_tiny's model, 2 drafts per step, blocks of "
                        "8 tokens; megatron-core 0.19): drafts proposed / accepted and the speculative audit are "
                        "reported (Triton's interpreter on the CPU: the command sets TRITON_INTERPRET=1)")
    p_soak.add_argument("--unpatched", action="store_true",
                        help="run megatron-core as released, without megatron-ext's runtime patches")
    _add_tokenizer_arguments(p_soak, "the generated prompts", "their lengths are then in characters, not "
                             "tokens, and the soak model's vocab_size grows to the tokenizer's when smaller")
    _add_output_arguments(p_soak, "--json", json_writes="the figures and results")
    p_soak.add_argument("--dump-case", metavar="PATH",
                        help="also write the generated case as YAML (runs with 'ab --case PATH')")
    _add_output_arguments(p_soak, "--no-progress", "--width", "--verbose", "--keep-log")
    p_soak.set_defaults(func=cmd_soak)


def _add_compare(sub: Any) -> None:
    p_cmp = sub.add_parser(
        "compare", help="compare runs recorded in two ab/soak JSON files, bit for bit",
        description="Reads two files written by 'ab --json' or 'soak --json' (made apart: other machines, "
        "releases, GPU runs) and compares the same requests bit for bit: tokens, log-probs, first "
        "divergent step and token, max |Δ log-prob|. FILE compares every run both files hold by name "
        "(off = caching off, ref_zero, lru); FILE:RUN picks one run, e.g. 'a.json:off b.json:lru'. "
        "Runs of other requests or prompts are refused. Exit codes: 0 bit-identical; 1 a request "
        "differs; 2 bad input.")
    p_cmp.add_argument("a", metavar="A", help="FILE or FILE:RUN (RUN: off, ref_zero, lru)")
    p_cmp.add_argument("b", metavar="B", help="FILE or FILE:RUN")
    _add_output_arguments(p_cmp, "--json", "--plot", json_writes="the comparison")
    p_cmp.add_argument("--only-divergent", action="store_true", help="list only the requests that differ")
    _add_output_arguments(p_cmp, "--width")
    p_cmp.set_defaults(func=cmd_compare, runs_megatron_core=False)  # reads JSON files only


def _add_patch_source(sub: Any) -> None:
    p_src = sub.add_parser(
        "patch-source", help="apply the source patches (patches/) to a megatron-core tree",
        description="PATH is the directory holding megatron/core (site-packages or a Megatron-LM "
        "checkout); default: the importable megatron-core. Refuses, changing nothing, when a "
        "hunk does not apply or the tree is already patched.")
    p_src.add_argument("path", nargs="?", help="directory holding megatron/core")
    p_src.add_argument("--check", action="store_true", help="report what would be done; change nothing")
    p_src.add_argument("--revert", action="store_true", help="remove the patches")
    p_src.set_defaults(func=cmd_patch_source, runs_megatron_core=False)  # checks its tree's release itself


def _quiet_imports() -> None:
    # megatron-core warns at import about optional packages (TE, Apex, absl) the CLI never needs.
    import logging
    import warnings

    warnings.filterwarnings("ignore", module=r"megatron\.")
    warnings.filterwarnings("ignore", category=SyntaxWarning)
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)


def _require_supported_release(args: argparse.Namespace) -> None:
    """Refuse, before a command runs megatron-core, a release megatron-ext does not support;
    ``MEGATRON_EXT_FORCE=1`` (``status --force``) lets it run, as it lets ``apply()`` patch it.

    Raises:
        UnsupportedReleaseError: naming the installed and the supported releases.
        MegatronCoreNotFoundError: megatron-core is not importable.
    """
    from .env import flag

    if getattr(args, "force", False) or flag("MEGATRON_EXT_FORCE"):
        return
    fix = ", or force with --force after checking the target code yourself" if args.command == "status" else ""
    mcore.require_supported(mcore.installed_version(), fix)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point. Errors of megatron-ext print one line on stderr and exit 2."""
    args = build_parser().parse_args(argv)
    args.program = argv is None  # this process is the megatron-ext program (it may re-execute itself)
    _quiet_imports()
    try:
        if getattr(args, "runs_megatron_core", True):
            _require_supported_release(args)
        with CtrlC.installed():
            code = args.func(args)
            CtrlC.check()  # pressed while megatron-core swallowed it, after the last engine step
        return code
    except MegatronExtError as exc:
        print(f"megatron-ext: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        # a second Ctrl-C during teardown (gloo, atexit) must not turn exit 130 into a traceback
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        print(f"megatron-ext: {args.command} interrupted (Ctrl-C)", file=sys.stderr)
        return 130
    finally:
        if torchrun_world()[1] > 1:  # under torchrun: leave the process group together (not in-process callers)
            from .harness.distributed import shut_down

            shut_down()


if __name__ == "__main__":
    sys.exit(main())
