"""The speculative-decoding audit against deliberately broken variants of megatron-core's engine:
run from the repository root as ``python scripts/probes/speculative_audit.py VARIANT`` under
``TRITON_INTERPRET=1`` (megatron-core's Triton MTP kernels run under Triton's interpreter, which
Triton reads at import); prints one line ``PROBE {json}``.

The case is ``mtp_speculative_tiny`` with one draft per step (``num_speculative_tokens: 1``, no
repeated MTP layer: every release 0.17-0.19 runs it), prefix caching on (REF_ZERO). Variants:

* ``clean``: megatron-core as it is (patched by megatron-ext);
* ``early_register``: after the first engine step at which a decoding request holds a block past
  its accepted tokens (a block the drafts opened), that block is registered with a hash
  (``register_kv_block_hashes``) before its tokens are accepted, as a broken engine would;
* ``wrong_hash``: after the first engine step at which a decoding request holds a complete block of
  accepted tokens, that block is registered again under a hash that is not the chain hash of its
  tokens, as an engine hashing the wrong tokens would;
* ``no_rewind``: ``TextGenerationController._rewind_kv_cache`` does nothing (rejected drafts are
  never rolled back).

The JSON: ``injected`` (``{step, block, request_id}`` of the made-up registration, or null), and the
audit's ``violations`` of kinds ``draft_block`` / ``spec_rewind`` (``[kind, step, block,
request_id, detail]``, the first 3 of each kind) with their counts, and the draft counts.
"""

from __future__ import annotations

import json
import sys
from typing import Any


def first_draft_block(audit: Any) -> Any:
    """``(row, request_id, block)`` of the first decoding request holding a block past its
    accepted tokens, or None."""
    ctx, spec = audit.context, audit.speculative
    for row in range(ctx.paused_request_count, ctx.total_request_count):
        request_id = int(ctx.request_ids[row])
        req = spec._requests.get(request_id)
        if req is None or not req.generated_tokens:
            continue
        accepted = len(spec.accepted_tokens(request_id))
        table = audit.log.block_table(row)
        if table and (len(table) - 1) * ctx.block_size_tokens >= accepted:  # its last block: drafts only
            return row, request_id, table[-1]
    return None


def first_accepted_block(audit: Any) -> Any:
    """``(row, request_id, block)`` of the first decoding request's first block, when it is complete
    with accepted tokens, or None."""
    ctx, spec = audit.context, audit.speculative
    for row in range(ctx.paused_request_count, ctx.total_request_count):
        request_id = int(ctx.request_ids[row])
        req = spec._requests.get(request_id)
        table = audit.log.block_table(row)
        if req is not None and req.generated_tokens and table \
                and len(spec.accepted_tokens(request_id)) >= ctx.block_size_tokens:
            return row, request_id, table[0]
    return None


#: variant -> the block it registers under a made-up hash (``first_*(audit)``).
INJECTIONS = {"early_register": first_draft_block, "wrong_hash": first_accepted_block}


def main(variant: str) -> None:
    import torch

    from megatron_ext.harness import ab
    from megatron_ext.harness.audits.context import ContextAudit
    from megatron_ext.harness.cases import load_case
    from megatron_ext import mcore

    case = load_case("mtp_speculative_tiny")
    case = case.model_copy(update={
        "model": case.model.model_copy(update={"mtp_use_repeated_layer": False}),
        "inference": case.inference.model_copy(update={"num_speculative_tokens": 1}),
        "prefix_caching_eviction_policies": ["ref_zero"]})
    injected: dict = {}
    audits: list = []
    end_step = ContextAudit.end_step

    def broken_end_step(self: ContextAudit) -> None:
        if self not in audits:
            audits.append(self)
        if variant in INJECTIONS and self.check_ref_counts and not injected:
            found = INJECTIONS[variant](self)
            if found is not None:
                row, request_id, block = found
                allocator = self.context.kv_block_allocator
                try:  # 0.19: (block_ids, hashes, parent hashes); 0.17 / 0.18: (block_ids, hashes)
                    allocator.register_kv_block_hashes([block], [987654321], [0])
                except TypeError:
                    allocator.register_kv_block_hashes([block], [987654321])
                injected.update(step=self.log.step, block=block, request_id=request_id)
        end_step(self)

    ContextAudit.end_step = broken_end_step
    if variant == "no_rewind":
        controller = mcore.import_module(mcore.TEXT_GENERATION_CONTROLLER_MODULE).TextGenerationController
        series = mcore.release_series(mcore.installed_version())

        def no_rewind(self, *args, **kwargs):
            if series == "0.17":
                return None  # 0.17's releases the blocks itself
            return torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.bool)

        controller._rewind_kv_cache = no_rewind
    result = ab.run_ab(case)
    runs = {"off": result.baseline, "ref_zero": result.policies[0].run}
    out = {"injected": injected or None, "runs": {}}
    for name, run in runs.items():
        audit = audits[0 if name == "off" else 1]
        violations = [v for v in audit.violations if v.kind in ("draft_block", "spec_rewind")]
        out["runs"][name] = {
            "error": run.error,
            "counts": {k: sum(1 for v in violations if v.kind == k) for k in ("draft_block", "spec_rewind")},
            "first": {k: [[v.kind, v.step, v.block, v.request_id, v.detail] for v in violations if v.kind == k][:3]
                      for k in ("draft_block", "spec_rewind")},
            "drafts": vars(run.audit.drafts),
            "speculative_violations": run.audit.speculative_violations,
        }
    print("PROBE " + json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "clean")
