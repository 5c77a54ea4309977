import functools, megatron_ext
from megatron_ext import patching
from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext as C

orig = C.__dict__["add_request"]
@functools.wraps(orig)
def traced(*args, **kwargs):  # e.g. a profiler's / nvtx range decorator
    return orig(*args, **kwargs)
C.add_request = traced
try:
    results = megatron_ext.apply()
    print([(r.patch, r.state.value, r.reason[:80]) for r in results if "add_request" in " ".join(r.targets)])
except Exception as exc:
    print("apply raised", type(exc).__name__, exc)
print("installed on add_request:", patching.installed_patches(patching.Target("megatron.core.inference.contexts.dynamic_context", "DynamicInferenceContext.add_request")))
from megatron_ext.patches import ALL_PATCHES
import megatron_ext.api as api
left = sorted({n for p in ALL_PATCHES for t in p.wrappers() for n in patching.installed_patches(t)})
print("left installed after the failed apply:", left)
megatron_ext.revert()
print("after revert, add_request is the foreign wrapper again:", C.__dict__["add_request"] is traced)
