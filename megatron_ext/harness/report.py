"""Human output of ``megatron-ext ab``: tables per policy, counters, audits, verdict; optional plot."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from .ab import ABResult, PolicyResult
from .compare import RequestDiff, RequestOutput
from .recorded import RunComparison


def _yes_no(value: bool) -> str:
    return "[green]yes[/]" if value else "[bold red]NO[/]"


def request_table(result: ABResult, policy: PolicyResult, only_divergent: bool = False) -> Table:
    """One row per request (per divergent request with ``only_divergent``): equality, first
    divergence, max |delta log-prob|."""
    title = f"{result.case.name}: caching off (A) vs on (B), eviction policy {policy.policy}"
    return diff_table(title, policy.diffs, only_divergent)


def diff_table(title: str, diffs: Sequence[RequestDiff], only_divergent: bool = False) -> Table:
    """The per-request table of ``ab`` and ``compare`` for any two runs' :class:`RequestDiff` list."""
    shown = [d for d in diffs if not (only_divergent and d.identical)]
    if only_divergent:
        title += f": {len(shown)} of {len(diffs)} requests differ"
    top_n = any(d.top_n_logprobs_equal is not None for d in diffs)  # a column only when recorded
    routing = any(d.routing_equal is not None for d in diffs)
    table = Table(title=title)
    for column in ("request", "id", "tokens equal", "log-probs equal", *(("top-n log-probs equal",) * top_n),
                   *(("routing equal",) * routing),
                   "first divergent step", "first divergent token", "max |Δ log-prob|"):
        table.add_column(column, justify="right" if column != "request" else "left")
    for diff in shown:
        table.add_row(
            diff.label, str(diff.request_id), _yes_no(diff.tokens_equal), _yes_no(diff.log_probs_equal),
            *((_yes_no(diff.top_n_logprobs_equal is not False),) * top_n),
            *((_yes_no(diff.routing_equal is not False),) * routing),
            "-" if diff.first_divergent_step is None else str(diff.first_divergent_step),
            "-" if diff.first_divergent_position is None else str(diff.first_divergent_position),
            f"{diff.max_abs_delta_log_prob:.3g}",
        )
    return table


def summary_table(result: ABResult) -> Table:
    """Per run: steps, time, prefix-cache counters, audit results (stale hits with weight updates)."""
    table = Table(title="runs, prefix-cache counters and audits")
    updates = result.case.weight_updates is not None
    hybrid = result.case.model.is_hybrid
    routing = "routing_replay" in result.case.model.features
    speculative = result.speculative_drafts() is not None
    for column in ("run", "steps", "seconds", "cache hits", "blocks matched", "prefill tokens skipped",
                   "prefill tokens computed", "KV writes checked", "KV write violations",
                   *(("KV writes redirected", "Mamba restores (failed)", "Mamba restore violations") * hybrid),
                   "ref-count violations", "LRU violations", *(("stale hits",) * updates),
                   *(("routing positions checked", "routing replay violations") * routing),
                   *(("drafts proposed", "drafts accepted", "speculative violations") * speculative)):
        table.add_column(column, justify="right" if column != "run" else "left")
    for run in result.runs:
        counters, audit = run.counters, run.audit
        stale = (_count(audit.stale_hits) if run.prefix_caching else "n/a",) * updates
        mamba = (str(audit.kv_writes_redirected), f"{audit.mamba_restores} ({audit.mamba_restores_failed})",
                 _count(audit.mamba_restore_violations) if run.prefix_caching else "n/a") * hybrid
        table.add_row(
            run.label, str(run.steps), f"{run.wall_s:.1f}",
            *(str(n) for n in (counters.cache_hits, counters.blocks_matched, counters.prefill_tokens_skipped,
                               counters.prefill_tokens_computed)),
            str(audit.kv_writes_checked),
            _count(audit.kv_write_violations),
            *mamba,
            _count(audit.refcount_violations) if run.prefix_caching else "n/a",
            _count(audit.lru_violations) if run.prefix_caching else "n/a",
            *stale,
            *((str(audit.routing_tokens_checked), _count(audit.routing_replay_violations)) * routing),
            *((str(audit.drafts.proposed), str(audit.drafts.accepted), _count(audit.speculative_violations))
              * speculative),
        )
    return table


def updates_table(result: ABResult) -> Table:
    """Per run and weight update: the step, what was updated, requests in flight across it, the
    training batch and loss, whether the weights equal caching off's after it, and what happened
    to the prefix cache (see :class:`~megatron_ext.harness.weight_updates.UpdateRecord`)."""
    spec = result.case.weight_updates
    how = (f"suspend/resume ({spec.kv_cache_management_mode})" if spec.suspend_resume
           else "invalidate_prefix_cache")
    table = Table(title=f"weight updates: {spec.rounds} rounds, {spec.kind} at steps "
                        f"{', '.join(map(str, spec.update_at_steps))}, {how}")
    for column in ("run", "update", "step", "in flight", "trained on", "loss", "weights = A's", "prefix cache"):
        table.add_column(column, justify="right" if column != "run" else "left")
    table.caption = spanning_versions(result)
    digests = {u.index: u.weights_sha256 for u in result.baseline.updates}
    for run in result.runs:
        for u in run.updates:
            table.add_row(run.label, str(u.index), str(u.step), _ids(u.in_flight),
                          _ids(u.trained_on) if spec.kind == "train_step" else "-",
                          "-" if u.loss is None else f"{u.loss:.4f}",
                          _yes_no(digests.get(u.index) == u.weights_sha256), _invalidation(u))
    return table


def spanning_versions(result: ABResult) -> str:
    """Per run, the requests whose tokens depend on more than one weight version (logits of one,
    KV of another: in flight across an update), from the per-token weight versions."""
    lines = []
    for run in result.runs:
        spans = [f"{o.label} (v{'-'.join(map(str, o.versions))})" for o in run.outputs.values() if len(o.versions) > 1]
        unknown = sum(o.weight_versions is None and bool(o.tokens) for o in run.outputs.values())
        text = ", ".join(spans[:6]) + (f", ... ({len(spans)})" if len(spans) > 6 else "") if spans else "none"
        lines.append(f"{run.label}: tokens spanning weight versions: {text}"
                     + (f"; {unknown} requests without recorded versions" if unknown else ""))
    return "\n".join(lines)


def trainer_table(result: ABResult) -> Table:
    """Per run: the engine's log-probs vs the training forward's (``--trainer-logprobs``): tokens
    bit-identical (count and fraction), max / mean |Δ log-prob|, k3 KL per request (mean and max
    over requests), the first divergent request and token, the trainer forward's seconds."""
    trainer = result.trainer_logprobs
    table = Table(title=f"trainer vs engine log-probs ({trainer.mode}): the training forward over prompt + "
                        "generated tokens")
    for column in ("run", "tokens bit-identical", "max |Δ log-prob|", "mean |Δ log-prob|",
                   "k3 KL per request (mean / max)", "first divergent token", "trainer forward s"):
        table.add_column(column, justify="right" if column != "run" else "left")
    for run in trainer.runs:
        figures, first = run.as_json(), run.first_divergent
        per_request = [r.k3_kl for r in run.requests if r.tokens]
        k3s = f"{sum(per_request) / len(per_request):.3g} / {max(per_request):.3g}" if per_request else "-"
        share = run.bit_identical_tokens / run.tokens if run.tokens else 1.0
        table.add_row(
            run.label,
            f"{run.bit_identical_tokens}/{run.tokens} ({share:.1%})" if run.bit_identical_tokens == run.tokens
            else f"[bold red]{run.bit_identical_tokens}/{run.tokens} ({share:.1%})[/]",
            f"{figures['max_abs_diff']:.3g}", f"{figures['mean_abs_diff']:.3g}", k3s,
            "-" if first is None else f"{first.label} token {first.first_divergent_token}",
            f"{run.seconds:.2f}")
    return table


def _ids(ids: Sequence[int]) -> str:
    return f"{len(ids)}: {', '.join(map(str, ids[:6]))}{', ...' if len(ids) > 6 else ''}" if ids else "0"


def _invalidation(update) -> str:
    if update.blocks_unreachable is None:
        return update.invalidation
    return f"{update.invalidation}: {update.blocks_unreachable} unreachable, {update.blocks_freed} freed"


def pressure_table(result: ABResult) -> Table:
    """Per run: how hard it pressed on the KV pool (see :class:`~megatron_ext.harness.audits.PoolPressure`)."""
    table = Table(title="KV pool pressure")
    for column in ("run", "pool blocks", "peak held", "peak not free", "peak paused", "requests paused",
                   "requests evicted", "cached blocks evicted (LRU)", "deregistered at ref 0"):
        table.add_column(column, justify="right" if column != "run" else "left")
    for run in result.runs:
        table.add_row(run.label, *(str(getattr(run.pressure, k)) for k in (
            "total_blocks", "peak_blocks_held", "peak_blocks_not_free", "peak_paused_requests",
            "requests_paused", "requests_evicted", "cached_blocks_evicted", "blocks_deregistered_at_ref_zero")))
    return table


def _count(n: int) -> str:
    return "0" if n == 0 else f"[bold red]{n}[/]"


def print_report(result: ABResult, console: Console, only_divergent: bool = False,
                 notes: Sequence[str] = ()) -> None:
    """The whole human report: header, tables, audit examples, ``notes``, and the verdict last.

    Args:
        only_divergent: list only the requests that differ (soaks of thousands of requests).
        notes: plain lines (no rich markup) printed just before the verdict, e.g. soak figures
            and where the libraries' own output went.
    """
    applied = ", ".join(f"{p['patch']}: {p['state']}" for p in result.patches)
    console.print(f"megatron-core {result.megatron_core_version} on {result.device}; patches: {applied}")
    ok, detail = result.invariance
    console.print(result.describe_weights())
    if result.tokenizer is not None and result.tokenizer.path is not None:  # the user's --tokenizer
        console.print(result.tokenizer.describe(), markup=False)
    console.print(f"batch-invariance self-check: {'ok' if ok else '[bold red]FAILED[/]'} ({detail})")
    for warning in result.warnings():
        console.print(f"[yellow]warning[/]: {warning}", soft_wrap=True, highlight=False)
    for policy in result.policies:
        if not (only_divergent and policy.bit_identical):
            console.print(request_table(result, policy, only_divergent))
    console.print(summary_table(result))
    if result.case.weight_updates is not None:
        console.print(updates_table(result))
    console.print(pressure_table(result))
    if result.trainer_logprobs is not None:
        console.print(trainer_table(result))
        for run in result.trainer_logprobs.runs:
            if run.left_out:
                labels = ", ".join(result.baseline.outputs[rid].label for rid in run.left_out[:8])
                console.print(f"trainer log-probs, {run.label}: {len(run.left_out)} requests ({run.left_out_tokens} "
                              "tokens) left out, in flight across a weight update (generated under two weight "
                              f"versions): {labels}"
                              f"{', ...' if len(run.left_out) > 8 else ''}", markup=False, highlight=False, soft_wrap=True)
        trainer_s = sum(r.seconds for r in result.trainer_logprobs.runs)
        engine_s = sum(run.wall_s for run in result.runs)
        console.print(f"trainer forward: {trainer_s:.1f} s, engine runs {engine_s:.1f} s ({trainer_s / max(result.wall_s, 1e-9):.0%} "
                      f"of the whole ab, {result.wall_s:.1f} s)", markup=False, highlight=False)
    for run in result.runs:
        for kind, lines in run.audit.examples.items():
            for line in lines:
                console.print(f"  [red]{kind}[/] ({run.eviction_policy or 'caching off'}): {line}")
    for policy in result.policies:
        left_out = result.left_out(policy)
        if left_out:
            labels = ", ".join(result.baseline.outputs[rid].label for rid in left_out[:8])
            console.print(f"{policy.policy}: {len(left_out)} requests left out of the bit-identity check: a weight "
                          f"update reached them at another token than with caching off (expectations.update_timing: "
                          f"exclude): {labels}{', ...' if len(left_out) > 8 else ''}",
                          markup=False, highlight=False, soft_wrap=True)
    for note in notes:
        console.print(note, markup=False, highlight=False, soft_wrap=True)
    failures = result.failures()
    if failures:
        console.print("[bold red]FAIL[/]:")
        for failure in failures:  # soft_wrap: a verdict line is never split, whatever --width says
            console.print(f"  - {failure}", markup=False, soft_wrap=True)
    else:
        weights = "" if result.checkpoint is None else f" (weights from {result.checkpoint.path})"
        total = len(result.baseline.outputs)
        left_out = max((len(result.left_out(p)) for p in result.policies), default=0)
        counted = f"{total} requests" if not left_out else (
            f"{total - left_out} of {total} requests ({left_out} left out: updated at another token)")
        trained = "" if result.trainer_logprobs is None else f"; {result.trainer_logprobs.pass_clause()}"
        reference = "" if result.post_update_reference is None else f"; {result.post_update_reference.pass_clause()}"
        drafts = result.speculative_drafts()
        drafted = "" if drafts is None else (f"; {drafts.clause()} over {len(result.runs)} runs"
                                             + ("" if drafts.accepted else " (none accepted: see the warning)"))
        unknown = "" if not result.unknown_args_allowed else (
            f"; for the model built without {escape(', '.join(result.unknown_args_allowed))} (not known to megatron-ext, "
            "--allow-unknown-args)")
        console.print(f"[bold green]PASS[/]: {counted} bit-identical with "
                      f"prefix caching on and off{weights}{trained}; every audit holds{drafted}{reference}{unknown} ({result.wall_s:.1f} s)",
                      soft_wrap=True)


def print_comparison(comparisons: Sequence[RunComparison], console: Console, only_divergent: bool = False) -> None:
    """The report of ``megatron-ext compare``: the two files, a table per compared run pair, and
    the verdict last (PASS, or FAIL naming the first request that differs, its token and step)."""
    first = comparisons[0]
    console.print(f"A: {first.a.path} ({first.a.context})", markup=False, highlight=False)
    console.print(f"B: {first.b.path} ({first.b.context})", markup=False, highlight=False)
    for comparison in comparisons:
        # short title: rich wraps a title wider than its table, and the file names are above
        console.print(diff_table(f"run {comparison.a.name} of A vs run {comparison.b.name} of B",
                                 comparison.diffs, only_divergent))
    compared = sum(len(c.diffs) for c in comparisons)
    differing = [(c, d) for c in comparisons for d in c.diffs if not d.identical]
    if not differing:
        console.print(f"[bold green]PASS[/]: {len(first.diffs)} requests bit-identical in {len(comparisons)} "
                      "compared run pair(s)", soft_wrap=True)
        return
    comparison, diff = differing[0]
    console.print(f"[bold red]FAIL[/]: {len(differing)} of {compared} compared requests differ; first: "
                  f"{diff.label} (id {diff.request_id}) in {comparison.a.source} vs {comparison.b.source}, "
                  f"at generated token {diff.first_divergent_position} (engine step "
                  f"{'-' if diff.first_divergent_step is None else diff.first_divergent_step} of B), "
                  f"max |Δ log-prob| {diff.max_abs_delta_log_prob:.3g}",
                  highlight=False, soft_wrap=True)


def write_plot(result: ABResult, path: Path) -> None:
    """PNG of |Δ log-prob| per engine step of B, one line per request that diverged (all zero
    if none did), one panel per eviction policy. Needs matplotlib (``pip install .[plot]``)."""
    write_diff_plot([(f"{result.case.name}, {p.policy}", p.diffs, p.run.outputs) for p in result.policies], path)


def write_diff_plot(panels: Sequence[tuple[str, Sequence[RequestDiff], dict[int, RequestOutput]]],
                    path: Path) -> None:
    """PNG of |log-prob(A) - log-prob(B)| (nats) per engine step of B, one panel per
    ``(title, diffs, B's outputs)`` and one line per request. Needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 3 * len(panels)), squeeze=False)
    for ax, (title, diffs, outputs_b) in zip(axes[:, 0], panels):
        for diff in diffs:
            steps = outputs_b[diff.request_id].token_steps[: len(diff.abs_delta_log_prob)]
            ax.plot(steps, diff.abs_delta_log_prob, marker=".", label=diff.label)
        ax.set_title(f"{title}: |log-prob(A) - log-prob(B)| per step")
        ax.set_xlabel("engine step (B)")
        ax.set_ylabel("|Δ log-prob| (nats)")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
