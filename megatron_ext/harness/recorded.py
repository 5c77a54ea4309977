"""Runs recorded in ``ab`` / ``soak`` JSON files (``--json``), read back for ``megatron-ext compare``.

An ``ab`` JSON holds one run with prefix caching off (``off``) and one per eviction policy with it on
(``ref_zero``, ``lru``): every request's generated tokens, log-probs (JSON numbers, which round-trip
a float64 exactly, so bits survive the file) and the engine step of each token. ``compare`` matches
runs made apart (another machine, release, GPU) request by request, bit for bit.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from ..errors import MegatronExtError
from .compare import RequestDiff, RequestOutput, compare_runs

#: The run with prefix caching off; the others are named by their eviction policy.
CACHING_OFF = "off"


class RecordedRunError(MegatronExtError):
    """A file or run given to ``compare`` cannot be used (missing, not an ab/soak JSON, no such
    run, other requests or prompts than the run it is compared with)."""


@dataclass
class RecordedRun:
    """One run read from an ab/soak JSON file.

    Attributes:
        path: the file.
        source: ``FILE:RUN`` as the report names it.
        name: ``off`` or the eviction policy.
        outputs: request ID -> :class:`RequestOutput` (tokens, float64 log-probs, token steps).
        requests: request ID -> ``{"label", "prompt_length", "prompt_sha256"}`` as ``ab`` planned
            them; empty for files written before ``ab`` recorded them.
        context: one line naming the case, megatron-core release and device of the file.
        tokenizer: ``{"library", "path", "vocab_size", "eod", "fingerprint"}`` as ``ab`` recorded it;
            None for files written before ``ab`` recorded it.
    """

    path: Path
    source: str
    name: str
    outputs: dict[int, RequestOutput]
    requests: dict[int, dict[str, Any]]
    context: str
    tokenizer: Optional[dict[str, Any]] = None


@dataclass
class RunComparison:
    """Two recorded runs compared request by request."""

    a: RecordedRun
    b: RecordedRun
    diffs: list[RequestDiff]

    @property
    def bit_identical(self) -> bool:
        return all(d.identical for d in self.diffs)

    def as_json(self) -> dict[str, Any]:
        return {"a": self.a.source, "b": self.b.source, "bit_identical": self.bit_identical,
                "requests": [d.as_dict() for d in self.diffs]}


#: The run names of an ab/soak file.
RUN_NAMES = (CACHING_OFF, "ref_zero", "lru")


def parse_spec(spec: str) -> tuple[Path, Optional[str]]:
    """``FILE`` or ``FILE:RUN`` (RUN: ``off``, ``ref_zero``, ``lru``) -> (path, run or None).

    Raises:
        RecordedRunError: ``FILE:RUN`` where FILE exists and RUN is not a run name.
    """
    path, sep, run = spec.rpartition(":")
    if sep and run in RUN_NAMES:
        return Path(path), run
    if sep and not Path(spec).exists() and Path(path).is_file():
        raise RecordedRunError(f"{spec}: '{run}' is not a run; name one of {', '.join(RUN_NAMES)} "
                               f"(e.g. {path}:{CACHING_OFF})")
    return Path(spec), None


def load_runs(path: Path) -> dict[str, RecordedRun]:
    """Every run of an ab/soak JSON file, by name (``off``, then the policies).

    Raises:
        RecordedRunError: the file is missing, a directory, unreadable, not JSON, or not written by
            ``ab`` / ``soak --json``.
    """
    if path.is_dir():
        raise RecordedRunError(f"{path} is a directory; pass the JSON file 'ab --json' or 'soak --json' wrote")
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise RecordedRunError(f"{path}: no such file; pass the JSON file 'ab --json' or 'soak --json' wrote") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise RecordedRunError(f"cannot read {path}: {exc}") from None
    except json.JSONDecodeError as exc:
        raise RecordedRunError(f"{path}: not JSON ({exc.msg} at line {exc.lineno}); pass the file "
                               "'ab --json' or 'soak --json' wrote") from None
    if not isinstance(data, dict) or "baseline" not in data or "policies" not in data:
        raise RecordedRunError(f"{path}: not an ab/soak result (no 'baseline' and 'policies'); pass the "
                               "file 'ab --json' or 'soak --json' wrote")
    context = (f"case {data.get('case', '?')}, megatron-core {data.get('megatron_core_version', '?')}, "
               f"device {data.get('device', '?')}")
    tokenizer = data.get("tokenizer")
    try:  # an edited or foreign file: any shape error is one line, not a traceback
        requests = {r["request_id"]: r for r in data.get("requests", [])}
        runs = [(CACHING_OFF, data["baseline"])] + [(p["eviction_policy"], p["run"]) for p in data["policies"]]
        return {name: RecordedRun(path, f"{path}:{name}", name, _outputs(run), requests, context,
                                  tokenizer if isinstance(tokenizer, dict) else None)
                for name, run in runs}
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise RecordedRunError(f"{path}: not as 'ab --json' writes it ({type(exc).__name__}: {exc}); "
                               "pass an unedited 'ab --json' or 'soak --json' file") from None


def _outputs(run: dict[str, Any]) -> dict[int, RequestOutput]:
    return {int(rid): RequestOutput(int(rid), o["label"], 0, list(o["tokens"]), [float(x) for x in o["log_probs"]],
                                    list(o["token_steps"]), _top_n(o.get("top_n_logprobs")), o.get("weight_versions"),
                                    o.get("routing"))
            for rid, o in run["outputs"].items()}


def _top_n(entries: Optional[list]) -> Optional[list[list[tuple[str, float]]]]:
    """``[[[text, log-prob], ...], ...]`` as JSON holds it -> lists of ``(text, log-prob)`` pairs."""
    if entries is None:
        return None
    return [[(str(text), float(value)) for text, value in entry] for entry in entries]


def pair_runs(spec_a: str, spec_b: str) -> list[tuple[RecordedRun, RecordedRun]]:
    """The runs to compare. ``FILE:RUN`` on one side only: the same run name on the other side;
    on both: those two runs (e.g. one machine's ``off`` against another's ``lru``); on neither:
    every run the two files both hold, by name (``off`` with ``off``, ``lru`` with ``lru``...).

    Raises:
        RecordedRunError: a file cannot be read, a named run is not in its file, or the files share
            no run.
    """
    (path_a, run_a), (path_b, run_b) = parse_spec(spec_a), parse_spec(spec_b)
    runs_a, runs_b = load_runs(path_a), load_runs(path_b)
    run_a, run_b = run_a or run_b, run_b or run_a
    if run_a is None:
        names = [name for name in runs_a if name in runs_b]
        if not names:
            raise RecordedRunError(f"{path_a} ({', '.join(runs_a)}) and {path_b} ({', '.join(runs_b)}) "
                                   "share no run; name one on each side as FILE:RUN")
        return [(runs_a[name], runs_b[name]) for name in names]
    for path, run, runs in ((path_a, run_a, runs_a), (path_b, run_b, runs_b)):
        if run not in runs:
            raise RecordedRunError(f"{path} holds no run '{run}'; it holds: {', '.join(runs)}")
    return [(runs_a[run_a], runs_b[run_b])]


def compare_recorded(a: RecordedRun, b: RecordedRun) -> RunComparison:
    """Compare two recorded runs of the same requests, bit for bit.

    Raises:
        RecordedRunError: the runs were made with different tokenizers (library, vocabulary size,
            end-of-document ID or the token IDs of a probe text differ; not checked for files
            written before ``ab`` recorded its tokenizer), the runs hold other request IDs, or a
            request's label, prompt length or prompt digest differs (runs of other prompts say
            nothing about each other).
    """
    mismatch = _tokenizer_mismatch(a.tokenizer, b.tokenizer)
    if mismatch:
        raise RecordedRunError(f"{a.source} and {b.source} were made with different tokenizers "
                               f"({mismatch}); compare runs made with the same tokenizer")
    if a.outputs.keys() != b.outputs.keys():
        only_a, only_b = sorted(a.outputs.keys() - b.outputs.keys()), sorted(b.outputs.keys() - a.outputs.keys())
        raise RecordedRunError(f"{a.source} and {b.source} hold other requests: request IDs only in A "
                               f"{only_a[:8]}, only in B {only_b[:8]}; compare runs of the same case")
    recorded = [run.source for run in (a, b) if any(o.top_n_logprobs is not None for o in run.outputs.values())]
    if len(recorded) == 1:
        raise RecordedRunError(f"only {recorded[0]} recorded top-n log-probs; compare runs made with the same "
                               "--top-n-logprobs")
    for rid in sorted(a.outputs):
        mismatch = _prompt_mismatch(a, b, rid)
        if mismatch:
            raise RecordedRunError(f"request {rid}: {mismatch} in {a.source} vs {b.source}; "
                                   "compare runs of the same prompts")
    return RunComparison(a, b, compare_runs(a.outputs, b.outputs))


def _prompt_mismatch(a: RecordedRun, b: RecordedRun, rid: int) -> Optional[str]:
    if a.outputs[rid].label != b.outputs[rid].label:
        return f"label '{a.outputs[rid].label}' vs '{b.outputs[rid].label}'"
    ra, rb = a.requests.get(rid), b.requests.get(rid)
    if ra is None or rb is None:  # a file from before ab recorded its prompts: labels only
        return None
    for key, what in (("prompt_length", "prompt length"), ("prompt_sha256", "prompt (SHA-256 of its tokens)")):
        if ra.get(key) != rb.get(key):
            return f"{what} {ra.get(key)} vs {rb.get(key)}"
    return None


#: What identifies a tokenizer in a recorded run (its path may differ between machines).
_TOKENIZER_KEYS = ("library", "vocab_size", "eod", "fingerprint")


def _tokenizer_mismatch(a: Optional[dict[str, Any]], b: Optional[dict[str, Any]]) -> Optional[str]:
    if a is None or b is None:  # a file from before ab recorded its tokenizer
        return None
    for key in _TOKENIZER_KEYS:
        if a.get(key) != b.get(key):
            return f"A: {_tokenizer_name(a)} vs B: {_tokenizer_name(b)}: {key} {a.get(key)} vs {b.get(key)}"
    return None


def _tokenizer_name(tokenizer: dict[str, Any]) -> str:
    return " ".join(str(part) for part in (tokenizer.get("library"), tokenizer.get("path")) if part)
