"""Test-case files for ``megatron-ext ab``: model, inference config, requests, expectations.

A case is a YAML file in the style of Megatron's functional test cases. Shipped cases live in
this package (``megatron-ext ab --case rl_rollouts``); users pass their own with
``--case path/to/case.yaml``. Unknown or malformed fields are errors that name the field.

This package loads case files (shipped or given) and re-exports the schema,
:mod:`~megatron_ext.harness.cases.schema` (the models and their validators), and request planning,
:mod:`~megatron_ext.harness.cases.planning` (a case's requests as engine requests).

Example::

    name: my-case
    model: {num_layers: 2, hidden_size: 64, num_attention_heads: 4, params_dtype: bf16}
    inference: {block_size_tokens: 16, buffer_size_gb: 0.002, max_requests: 16, max_tokens: 256}
    prefix_caching_eviction_policies: [ref_zero, lru]
    requests:
      - {prompt: "Explain KV caching in one line.", samples: 4, num_tokens_to_generate: 8}
      - conversation: ["Hi!", "Hello, how can I help?", "Tell me about blocks."]
        turn_interval: 3
    expectations: {bit_identical: true, min_prefill_tokens_skipped: 1}
"""

from __future__ import annotations

import importlib.resources
from pathlib import Path

import yaml
from pydantic import ValidationError

from .planning import (PlannedRequest, WorkloadError, check_top_n_fits, plan_requests, sequence_too_long,
                       validate_planned)
from .schema import (HYBRID_LAYER_SYMBOLS, KV_CACHE_MANAGEMENT_MODES, Case, CaseFileError, Expectations, InferenceSpec,
                     ModelSpec, RequestSpec, SamplingSpec, WeightUpdateSpec, describe_validation_error,
                     turn_prompts)

__all__ = [
    "HYBRID_LAYER_SYMBOLS", "KV_CACHE_MANAGEMENT_MODES", "Case", "CaseFileError", "Expectations", "InferenceSpec",
    "ModelSpec", "PlannedRequest", "RequestSpec", "SamplingSpec", "WeightUpdateSpec", "WorkloadError",
    "check_top_n_fits", "describe_validation_error", "dump_case", "load_case", "parse_case", "plan_requests",
    "sequence_too_long", "shipped_cases", "turn_prompts", "validate_planned",
]


def shipped_cases() -> list[str]:
    """Names of the cases shipped with megatron-ext, sorted."""
    files = importlib.resources.files(__package__).iterdir()
    return sorted(f.name[: -len(".yaml")] for f in files if f.name.endswith(".yaml"))


def load_case(name_or_path: str) -> Case:
    """Load a shipped case by name or a case file by path.

    Raises:
        CaseFileError: unknown name, unreadable file, invalid YAML, or a bad field (named).
    """
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or path.exists():
        try:
            text = path.read_text()
        except OSError as exc:
            raise CaseFileError(f"cannot read case file {path}: {exc}") from None
        source = str(path)
    elif name_or_path in shipped_cases():
        text = importlib.resources.files(__package__).joinpath(f"{name_or_path}.yaml").read_text()
        source = f"shipped case '{name_or_path}'"
    else:
        raise CaseFileError(
            f"no case named '{name_or_path}'; shipped cases: {', '.join(shipped_cases())} "
            "(or pass a path to a .yaml file)"
        )
    return parse_case(text, source)


def dump_case(case: Case) -> str:
    """A case as case-file YAML; :func:`parse_case` of it gives an equal case. ``weight_updates``
    keeps only the fields its author set (the schema refuses fields of another update kind)."""
    data = case.model_dump()
    if case.weight_updates is not None:
        data["weight_updates"] = case.weight_updates.model_dump(exclude_unset=True)
    return yaml.safe_dump(data, sort_keys=False, width=200)


def parse_case(text: str, source: str = "<string>") -> Case:
    """Validate YAML text as a :class:`Case`. Raises CaseFileError naming the bad field."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise CaseFileError(f"{source}: not valid YAML: {_yaml_problem(exc)}") from None
    if not isinstance(data, dict):
        raise CaseFileError(f"{source}: expected a mapping with 'name' and 'requests' at the top level")
    try:
        return Case.model_validate(data)
    except ValidationError as exc:
        raise CaseFileError(f"{source}: {describe_validation_error(exc)}") from None


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """PyYAML's error on one line: the problem and its line and column (1-based)."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return f"{problem}{where}; fix the file (a case is a YAML mapping, see the shipped cases)"
