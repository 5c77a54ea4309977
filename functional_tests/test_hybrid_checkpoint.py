"""Hybrid (Mamba + attention) checkpoints: ``save-checkpoint`` and ``ab --load`` in Megatron-LM's layout.

megatron-core's hybrid stack spec (Transformer Engine) fuses each layer's norm into the next
linear layer, so Megatron-LM hybrid checkpoints store it as ``mixer.in_proj.layer_norm_weight``
(Mamba), ``self_attention.linear_qkv.layer_norm_weight`` (attention) and
``mlp.linear_fc1.layer_norm_weight`` (MLP). megatron-ext's local hybrid spec saves and loads
its separate norms under those keys. Here, in a fresh interpreter with Triton's interpreter on
(as ``test_hybrid``):

* ``megatron-ext save-checkpoint`` of ``hybrid_tiny`` (an ``M*M`` model) at seed ``S1``: the
  checkpoint holds exactly the Transformer Engine key names for the norms (none of the local
  names), and Megatron-LM's args name the pattern and the Mamba sizes;
* loaded into the model built at seed ``S2``: every parameter bit-equal to the seed-``S1``
  model's (and some differed before);
* the model from the checkpoint's args is ``hybrid_tiny``'s, but for the Mamba chunk size
  (Megatron-LM has no argument for it: 128, ``MambaMixer``'s default);
* ``megatron-ext ab --case hybrid_tiny --load DIR``: exit 0, bit-identical, weights from the checkpoint.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CASE = REPO / "functional_tests" / "cases" / "hybrid_tiny.yaml"
S1 = 4321
ENV = {**os.environ, "TRITON_INTERPRET": "1", "MAMBA_DETERMINISTIC": "1"}

#: Runs in the subprocess: load the checkpoint into a seed-S2 model, compare with a seed-S1 one.
_COMPARE = r"""
import json, sys
from megatron_ext import mcore
from megatron_ext.cpu_backend import cpu_backend
from megatron_ext.harness.cases import load_case
from megatron_ext.harness.checkpoint import load_checkpoint, read_common_state, resolve_checkpoint
from megatron_ext.harness.checkpoint_args import checkpoint_model_spec
from megatron_ext.harness.engine import build_model, ensure_model_parallel

case, directory, seed = load_case(sys.argv[1]), sys.argv[2], int(sys.argv[3])
def built(seed):
    return build_model(case.model_copy(update={"model": case.model.model_copy(update={"seed": seed})}))
with cpu_backend(mamba=True):
    ensure_model_parallel()
    saved = {n: p.detach().clone() for n, p in built(seed).named_parameters()}
    model = built(case.model.seed)
    differed = sorted(n for n, p in model.named_parameters() if not p.equal(saved[n]))
    source = resolve_checkpoint(directory)
    load_checkpoint(model, source)
    unequal = sorted(n for n, p in model.named_parameters() if not p.equal(saved[n]))
    keys = sorted(mcore.import_module("megatron.core.dist_checkpointing").load_tensors_metadata(str(source.path)))
    spec = checkpoint_model_spec(source)
args = vars(read_common_state(source.path)["args"])
print("RESULT " + json.dumps({
    "differed": len(differed), "parameters": len(saved), "unequal": unequal,
    "norm_keys": [k for k in keys if "norm" in k],
    "args": {k: args[k] for k in ("hybrid_layer_pattern", "mamba_state_dim", "mamba_head_dim", "mamba_num_groups")},
    "spec_differs": {f: [getattr(case.model, f), getattr(spec, f)] for f in type(spec).model_fields
                     if f not in ("seed", "init_method_std") and getattr(case.model, f) != getattr(spec, f)}}))
"""


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """``megatron-ext save-checkpoint --case hybrid_tiny --seed S1 DIR`` (the CLI, as a user runs it)."""
    directory = tmp_path_factory.mktemp("hybrid") / "save"
    proc = subprocess.run([sys.executable, "-m", "megatron_ext", "save-checkpoint", "--case", str(CASE),
                           "--seed", str(S1), str(directory)],
                          cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"saved the model of case 'hybrid_tiny' (seed {S1}, fp32, TP=1 PP=1)" in proc.stdout
    return directory


@pytest.mark.slow
@pytest.mark.breadth
def test_hybrid_checkpoint_has_megatron_lm_keys_and_loads_bit_for_bit(saved):
    proc = subprocess.run([sys.executable, "-c", _COMPARE, str(CASE), str(saved), str(S1)],
                          cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(lines[-1][len("RESULT "):])
    assert result["differed"] > 0
    assert result["unequal"] == []
    assert result["norm_keys"] == [
        "decoder.final_norm.bias", "decoder.final_norm.weight",
        "decoder.layers.0.mixer.in_proj.layer_norm_bias", "decoder.layers.0.mixer.in_proj.layer_norm_weight",
        "decoder.layers.0.mixer.norm.weight",  # MambaMixer's own gated RMSNorm, the same in both specs
        "decoder.layers.1.self_attention.linear_qkv.layer_norm_bias",
        "decoder.layers.1.self_attention.linear_qkv.layer_norm_weight",
        "decoder.layers.2.mixer.in_proj.layer_norm_bias", "decoder.layers.2.mixer.in_proj.layer_norm_weight",
        "decoder.layers.2.mixer.norm.weight"]
    assert result["args"] == {"hybrid_layer_pattern": "M*M", "mamba_state_dim": 8, "mamba_head_dim": 16,
                              "mamba_num_groups": 1}
    assert result["spec_differs"] == {"mamba_chunk_size": [16, 128]}


@pytest.mark.slow
@pytest.mark.breadth
def test_ab_load_of_a_hybrid_checkpoint_passes(saved):
    proc = subprocess.run([sys.executable, "-m", "megatron_ext", "ab", "--case", str(CASE), "--load", str(saved)],
                          cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    verdict = proc.stdout.strip().splitlines()[-1]
    assert verdict.startswith("PASS: 2 requests bit-identical with prefix caching on and off (weights from ")
    assert "iter_0000001" in verdict
