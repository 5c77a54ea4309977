"""Does megatron-core's MLA engine see a weight update made after its first inference forward?

Run from the repository root: ``PYTHONPATH=. python scripts/probes/mla_weight_update.py``; prints
one line ``PROBE {json}``. CPU only, ``mla_tiny``'s model in fp32, prefix caching off.

``MultiLatentAttention.prepare_for_absorption`` (first forward with ``cache_mla_latents``) splits
``linear_kv_up_proj`` with ``split_te_layernorm_column_parallel_linear`` into ``kv_layernorm`` and
``linear_kv_up_proj_linear`` (prefill and mixed steps uncompress the latent cache with them), keeps
``up_k_weight`` / ``up_v_weight`` as views of ``linear_kv_up_proj.weight`` (decode-only steps absorb
them into queries and outputs) and deletes ``linear_kv_up_proj``. megatron-ext's CPU stand-in of
TE's ``split_te_layernorm_column_parallel_linear`` copies the weights into the new modules, as TE's
does. Each schedule runs ``released`` (megatron-ext's patches but ``mla-absorbed-weights``: fault M1
as released) and ``patched`` (all of them: ``mla-absorbed-weights`` links the copies).

Schedule, for model A: request 0 (prefill: absorption; one decode step; finished), then a weight
update, then request 1 alone: a prefill-only step (uncompressed path) and a decode-only step
(absorbed path). B: a fresh model holding the updated weights from the start, same schedule. C: the
old weights throughout. Each step's last logits row of request 1 is compared: A == B means the
update reached the engine, A == C that it ran on the old weights (stale).

Updates (``delta``: 0.05 * N(0, 1) per element, seeded by the parameter's pre-absorption name):

* ``handles_before``: ``param.data.add_(delta)`` through the ``named_parameters()`` taken before
  the first forward (what megatron-core's refit does once ``get_refit_tensor_dict`` cached the
  module's tensors, or an optimizer holding the parameters);
* ``handles_after``: the same through ``named_parameters()`` taken after absorption (renamed
  ``linear_kv_up_proj_linear.weight``; a refit whose cache is built then);
* ``load_state_dict``: A.load_state_dict(B's pre-absorption state dict), strict, then non-strict.

``sets``: ``all`` (every parameter) or ``kv_up`` (only ``linear_kv_up_proj.weight``, the absorbed one).
"""

from __future__ import annotations

import json
import os
import zlib
from typing import Any

import torch

import megatron_ext
from megatron_ext import mcore
from megatron_ext.cpu_backend import cpu_backend
from megatron_ext.harness.cases import Case, load_case
from megatron_ext.harness.engine import build_engine, build_model, ensure_model_parallel
from megatron_ext.harness.tokenizer import default_tokenizer

SCALE = 0.05
PROMPTS = ("The kv up-projection is absorbed at the first forward.", "Then the weights change.")


def delta(name: str, like: torch.Tensor) -> torch.Tensor:
    generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return SCALE * torch.randn(like.shape, generator=generator, dtype=torch.float32).to(like.dtype)


def selected(name: str, which: str) -> bool:
    return which == "all" or name.endswith("linear_kv_up_proj.weight")


def pre_name(name: str) -> str:
    """Pre-absorption name of a post-absorption parameter name."""
    return name.replace("linear_kv_up_proj_linear.", "linear_kv_up_proj.")


def perturb(handles: dict[str, torch.nn.Parameter], which: str) -> int:
    count = 0
    with torch.no_grad():
        for name, param in handles.items():
            if selected(pre_name(name), which):
                param.data.add_(delta(pre_name(name), param))
                count += 1
    return count


def run(case: Case, update: str | None, which: str, update_first: bool = False) -> dict[str, Any]:
    """One model through the schedule; returns request 1's logits rows and what happened."""
    sampling = mcore.import_module("megatron.core.inference.sampling_params")
    tokenizer = default_tokenizer()
    model = build_model(case)
    before = dict(model.named_parameters())
    if update_first:  # B: the new weights before any forward
        perturb(before, which)
    rows: list[torch.Tensor] = []
    model.register_forward_hook(lambda module, args, output: rows.append(output.detach().reshape(-1, output.shape[-1])[-1].clone()))
    engine, _ = build_engine(model, case, False, "ref_zero")
    params = dict(temperature=1.0, top_k=1, return_log_probs=True, skip_prompt_log_probs=True, num_tokens_to_generate=2)
    engine.add_request(0, tokenizer.tokenize(PROMPTS[0]), sampling.SamplingParams(**params))
    kinds = []
    for _ in range(2):
        engine.step_modern()
    attention = model.decoder.layers[0].self_attention
    info: dict[str, Any] = {"absorbed": hasattr(attention, "up_k_weight"),
                            "kv_up_proj_present": hasattr(attention, "linear_kv_up_proj")}
    if update == "handles_before":
        info["perturbed"] = perturb(before, which)
    elif update == "handles_after":
        after = dict(model.named_parameters())
        info["renamed"] = sorted({n.split("layers.0.")[-1] for n in after if n not in before and "layers.0." in n})
        info["inference_tensors"] = sorted({n.split("layers.0.")[-1] for n, p in after.items()
                                            if "layers.0." in n and p.is_inference()})
        info["perturbed"] = perturb(after, which)
    elif update == "load_state_dict":
        fresh = build_model(case)
        perturb(dict(fresh.named_parameters()), which)
        try:
            model.load_state_dict(fresh.state_dict(), strict=True)
            info["strict"] = "loaded"
        except RuntimeError as error:
            info["strict"] = " ".join(line.strip() for line in str(error).splitlines())[:400]
        try:
            result = model.load_state_dict(fresh.state_dict(), strict=False)
            info["non_strict_missing"] = [k for k in result.missing_keys if "layers.0." in k]
            info["non_strict_unexpected"] = [k for k in result.unexpected_keys if "layers.0." in k]
        except RuntimeError as error:
            info["non_strict"] = " ".join(line.strip() for line in str(error).splitlines())[:300]
    rows.clear()
    engine.add_request(1, tokenizer.tokenize(PROMPTS[1]), sampling.SamplingParams(**params))
    for _ in range(2):
        engine.step_modern()
    info["rows"] = rows[:2]  # [prefill-only step, decode-only step]
    return info


def main() -> None:
    data = load_case("mla_tiny").model_dump()
    data["model"]["params_dtype"] = "fp32"
    case = Case.model_validate(data)
    report: dict[str, Any] = {"megatron_core": mcore.installed_version()}
    with cpu_backend():
        ensure_model_parallel()
        for variant in ("released", "patched"):  # the CPU split copies the weights, as TE's does
            # released: every patch but mla-absorbed-weights (mla-decode-flag: the engine's first step raises without it)
            os.environ["MEGATRON_EXT_SKIP"] = "mla-absorbed-weights" if variant == "released" else ""
            megatron_ext.apply()
            try:
                for which in ("all", "kv_up"):
                    old = run(case, None, which)["rows"]
                    new = run(case, None, which, update_first=True)["rows"]
                    for update in ("handles_before", "handles_after", "load_state_dict"):
                        info = run(case, update, which)
                        rows = info.pop("rows")
                        info["prefill_step"] = {"max_abs_vs_new": float((rows[0] - new[0]).abs().max()),
                                                "max_abs_vs_old": float((rows[0] - old[0]).abs().max())}
                        info["decode_step"] = {"max_abs_vs_new": float((rows[1] - new[1]).abs().max()),
                                               "max_abs_vs_old": float((rows[1] - old[1]).abs().max())}
                        report[f"{variant}/{which}/{update}"] = info
                    report[f"{variant}/{which}/old_vs_new"] = [float((o - n).abs().max()) for o, n in zip(old, new)]
            finally:
                megatron_ext.revert()
        megatron_ext.apply()  # the training forward after an engine step, patched
        model = build_model(case)
        engine, _ = build_engine(model, case, False, "ref_zero")
        sampling = mcore.import_module("megatron.core.inference.sampling_params")
        engine.add_request(0, default_tokenizer().tokenize(PROMPTS[0]),
                           sampling.SamplingParams(top_k=1, num_tokens_to_generate=2))
        engine.step_modern()
        model.train()
        try:
            tokens = torch.tensor([default_tokenizer().tokenize(PROMPTS[0])])
            model(tokens, torch.arange(tokens.shape[1])[None], None)
            report["train_forward"] = "ran"
        except Exception as error:  # noqa: BLE001 - the probe reports whatever megatron-core raises
            report["train_forward"] = f"{type(error).__name__}: {error}"
    print("PROBE " + json.dumps(report))


if __name__ == "__main__":
    main()
