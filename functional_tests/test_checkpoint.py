"""``megatron-ext ab --load``: models saved with megatron-core's own ``dist_checkpointing.save``
and loaded back through ``ab`` (``torch_dist`` format, CPU, gloo).

* TP=1 (in this process): the seed-``S1`` model saved, then loaded into a model built with seed
  ``S2``: every parameter bit-equal to the saved one (and some differed before). ``ab --load`` of
  a Megatron-LM save directory (tracker file -> ``iter_0000007``) exits 0, reports the iteration,
  and generates exactly the tokens and log-probs of a plain run with seed ``S1`` (not ``S2``'s).
* TP=2 (torchrun, in the default suite: about 40 s to save + 40 s to run ab on a loaded 2-core
  machine): saved on 2 ranks, loaded on 2 ranks through ``ab --load`` (exit 0, bit-identical A/B,
  all ranks agree), and loaded at TP=1 (dist-checkpointing reshards): every TP=1 parameter equals
  its slice of the stored global tensor; ``ab --load`` at TP=1 exits 0 and generates the same
  greedy tokens as the TP=2 run (log-probs within 0.05: another summation order in bf16).
* PP=2 (opt-in, ``-m multirank``): the TP=1 checkpoint loaded on 2 pipeline stages.
* Bad input (exit 2, message names the problem, no engine built): missing directory, empty
  directory, a checkpoint of a model with another hidden size; resolving a Megatron-LM save
  directory whose tracker file is broken or names a missing iteration, a legacy checkpoint.

The model is the default case's (rl_rollouts: 2 layers, hidden 64, bf16).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatron_ext import cli
from megatron_ext.harness.ab import run_ab
from megatron_ext.harness.cases import load_case
from megatron_ext.harness.checkpoint import CheckpointError, load_checkpoint, resolve_checkpoint, save_checkpoint
from megatron_ext.cpu_backend import cpu_backend
from megatron_ext.harness.engine import build_model, ensure_model_parallel

CASE = "rl_rollouts"
S1 = 4321  # the saved model's seed
S2 = load_case(CASE).model.seed  # the seed ab builds with before loading (1234)


def seeded_case(seed: int | None = None, **model):
    """The default case with ``model.seed`` / other model fields replaced."""
    case = load_case(CASE)
    update = dict(model, **({} if seed is None else {"seed": seed}))
    return case.model_copy(update={"model": case.model.model_copy(update=update)})


def build(case):
    """The case's model, built as ab builds it (single rank, CPU backend)."""
    with cpu_backend():
        ensure_model_parallel()
        return build_model(case)


def parameters(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


@pytest.fixture(scope="module")
def saved_s1(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    """The seed-S1 model saved by megatron-core into a Megatron-LM style save directory
    (``save/iter_0000007`` + ``latest_checkpointed_iteration.txt``); (save dir, parameters)."""
    save = tmp_path_factory.mktemp("save")
    model = build(seeded_case(S1))
    with cpu_backend():
        save_checkpoint(model, save / "iter_0000007")
    (save / "latest_checkpointed_iteration.txt").write_text("7\n")
    return save, parameters(model)


@pytest.mark.slow
def test_tp1_load_restores_every_parameter_bit_for_bit(saved_s1):
    save, saved = saved_s1
    model = build(seeded_case(S2))
    before = parameters(model)
    assert before.keys() == saved.keys()
    assert any(not torch.equal(before[k], saved[k]) for k in saved), "seeds S1 and S2 gave equal weights"
    with cpu_backend():
        source = load_checkpoint(model, save / "iter_0000007", CASE)
    assert source.iteration == 7 and source.path == str(save / "iter_0000007")
    after = parameters(model)
    for name, tensor in saved.items():
        assert after[name].dtype == tensor.dtype == torch.bfloat16, name
        assert after[name].shape == tensor.shape, name
        assert torch.equal(after[name].view(torch.int16), tensor.view(torch.int16)), f"{name} differs after loading"


@pytest.mark.slow
def test_tp1_ab_load_generates_the_saved_models_tokens(saved_s1, tmp_path, capfd):
    save, _ = saved_s1
    out = tmp_path / "load.json"
    code = cli.main(["ab", "--case", CASE, "--load", str(save), "--no-progress", "--width", "160",
                     "--json", str(out)])
    printed = capfd.readouterr().out
    assert code == 0, printed[-3000:]
    loaded = json.loads(out.read_text())
    assert loaded["verdict"] == "pass" and loaded["bit_identical"] is True
    assert loaded["weights"] == {"source": "checkpoint", "requested": str(save),
                                 "path": str(save / "iter_0000007"), "iteration": 7, "backend": "torch_dist"}
    assert f"weights: checkpoint {save / 'iter_0000007'} (iteration 7, resolved from " in printed

    with_s1 = run_ab(seeded_case(S1))  # the saved weights, built from the seed
    with_s2 = run_ab(seeded_case(S2))  # what ab had built before loading
    runs = [loaded["baseline"]] + [p["run"] for p in loaded["policies"]]
    references = with_s1.runs
    assert len(runs) == len(references) == 3
    for run, reference in zip(runs, references):
        assert run["eviction_policy"] == reference.eviction_policy
        assert {int(k): v["tokens"] for k, v in run["outputs"].items()} == \
            {k: o.tokens for k, o in reference.outputs.items()}
        assert {int(k): v["log_probs"] for k, v in run["outputs"].items()} == \
            {k: o.log_probs for k, o in reference.outputs.items()}  # floats, exact
    s2_tokens = {k: o.tokens for k, o in with_s2.baseline.outputs.items()}
    differ = [k for k, v in loaded["baseline"]["outputs"].items() if v["tokens"] != s2_tokens[int(k)]]
    assert len(differ) == len(s2_tokens), f"only requests {differ} differ from seed {S2}'s tokens"


@pytest.fixture(scope="module")
def saved_tp2(tmp_path_factory, torchrun) -> Path:
    """The seed-S1 model saved on 2 ranks with TP=2 (torchrun ``save-checkpoint``): a Megatron-LM
    save directory, ``ckpt/iter_0000001`` + ``ckpt/latest_checkpointed_iteration.txt``."""
    path = tmp_path_factory.mktemp("tp2") / "ckpt"
    code, output = torchrun.run(2, ["save-checkpoint", str(path), "--case", CASE, "--seed", str(S1),
                                "--tensor-model-parallel-size", "2"], label="save-checkpoint TP=2")
    assert code == 0, torchrun.tail(output)
    assert "TP=2 PP=1" in output
    assert (path / "latest_checkpointed_iteration.txt").read_text() == "1\n"
    assert (path / "iter_0000001" / "metadata.json").is_file()
    return path


@pytest.fixture(scope="module")
def loaded_at_tp2(saved_tp2, tmp_path_factory, torchrun) -> tuple[int, str, dict | None]:
    """``ab --load`` of the TP=2 checkpoint on 2 ranks: (exit code, output, rank 0's JSON)."""
    return torchrun.ab(tmp_path_factory.mktemp("ab-tp2"), tp=2, pp=1, extra=("--load", str(saved_tp2)))


@pytest.mark.slow
def test_tp2_checkpoint_loads_at_tp2_through_ab(saved_tp2, loaded_at_tp2, torchrun):
    code, output, result = loaded_at_tp2
    torchrun.assert_clean(2, 1, code, output, result)
    assert result["weights"]["path"] == str(saved_tp2 / "iter_0000001")
    assert result["weights"]["iteration"] == 1
    assert (f"weights: checkpoint {saved_tp2 / 'iter_0000001'} (iteration 1, resolved from "
            f"{saved_tp2 / 'latest_checkpointed_iteration.txt'}), torch_dist") in " ".join(output.split())  # rich wraps long lines


@pytest.mark.slow
def test_tp2_checkpoint_loads_at_tp1(saved_tp2, loaded_at_tp2, tmp_path, capfd):
    from megatron.core.dist_checkpointing import load_plain_tensors
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    model = build(seeded_case(S2))
    before = parameters(model)
    with cpu_backend():
        load_checkpoint(model, saved_tp2, CASE)
        stored = load_plain_tensors(str(saved_tp2 / "iter_0000001"))  # the global tensors the 2 ranks wrote
        shards = [t for t in nested_values(model.sharded_state_dict()) if isinstance(t, ShardedTensor)]
    assert stored["embedding.word_embeddings.weight"].shape == (258, 64)  # vocab padded for TP=2
    checked = 0
    for shard in shards:  # every TP=1 tensor equals its slice of the stored global tensor
        prepend = shard.prepend_axis_num
        index = tuple(shard.global_offset[:prepend]) + tuple(
            slice(offset, offset + size) for offset, size in zip(shard.global_offset[prepend:], shard.local_shape))
        expected = stored[shard.key][index]
        assert shard.data.dtype == expected.dtype and shard.data.shape == expected.shape, shard.key
        assert torch.equal(shard.data.view(torch.int16), expected.view(torch.int16)), shard.key
        checked += 1
    assert checked == len(before)
    assert any(not torch.equal(before[n], p) for n, p in parameters(model).items())

    out = tmp_path / "tp1.json"
    code = cli.main(["ab", "--case", CASE, "--load", str(saved_tp2), "--no-progress", "--json", str(out)])
    assert code == 0, capfd.readouterr().out[-3000:]
    at_tp1 = json.loads(out.read_text())
    assert at_tp1["bit_identical"] is True
    # the same weights on both layouts: the same greedy tokens; log-probs only close (the TP=2
    # row-parallel layers sum partial products in another order, in bf16)
    at_tp2 = loaded_at_tp2[2]
    assert at_tp2 is not None, "the TP=2 ab --load run wrote no JSON"
    for request_id, output in at_tp1["baseline"]["outputs"].items():
        other = at_tp2["baseline"]["outputs"][request_id]
        assert output["tokens"] == other["tokens"], f"request {request_id}: TP=1 and TP=2 tokens differ"
        assert max(abs(a - b) for a, b in zip(output["log_probs"], other["log_probs"])) < 0.05


@pytest.mark.slow
@pytest.mark.parametrize("tp, pp", [pytest.param(1, 2, id="pp2", marks=(pytest.mark.multirank, pytest.mark.breadth))])
def test_tp1_checkpoint_loads_pipeline_parallel(saved_s1, tmp_path, torchrun, tp, pp):
    """Opt-in (``-m multirank``): the TP=1 checkpoint on pipeline stages; each stage reads its
    layers, the first the embedding, the last the output layer; same tokens as TP=1."""
    save, _ = saved_s1
    code, output, result = torchrun.ab(tmp_path, tp=tp, pp=pp, extra=("--load", str(save)))
    torchrun.assert_clean(tp, pp, code, output, result)
    assert result["weights"]["iteration"] == 7
    reference = run_ab(seeded_case(S1))
    for request_id, out in result["baseline"]["outputs"].items():
        assert out["tokens"] == reference.baseline.outputs[int(request_id)].tokens, request_id


# ---------------------------------------------------------------------------------- bad input


@pytest.fixture
def no_engine(monkeypatch):
    """Fails the test if ab gets as far as building an engine."""
    import megatron_ext.harness.ab

    def refuse(*args, **kwargs):
        raise AssertionError("an engine was built despite the bad checkpoint")

    monkeypatch.setattr(megatron_ext.harness.ab, "build_engine", refuse)


def ab_load(path, capfd) -> tuple[int, str]:
    code = cli.main(["ab", "--case", CASE, "--load", str(path), "--no-progress"])
    return code, capfd.readouterr().err


def test_missing_directory_exits_2(tmp_path, capfd, no_engine):
    code, err = ab_load(tmp_path / "nope", capfd)
    assert code == 2
    assert f"--load {tmp_path / 'nope'}: no such directory" in err


def test_empty_directory_exits_2(tmp_path, capfd, no_engine):
    code, err = ab_load(tmp_path, capfd)
    assert code == 2
    assert "not a Megatron distributed checkpoint" in err and "is empty" in err and "no metadata.json" in err
    assert "latest_checkpointed_iteration.txt" in err  # the other accepted form


@pytest.mark.slow
def test_other_hidden_size_exits_2_naming_tensor_and_shapes(tmp_path, capfd, no_engine):
    path = tmp_path / "hidden32"
    small = build(seeded_case(hidden_size=32))
    with cpu_backend():
        save_checkpoint(small, path)
    code, err = ab_load(path, capfd)
    assert code == 2
    assert f"--load {path}: architecture mismatch: tensor 'embedding.word_embeddings.weight' has global " \
           f"shape (257, 32) in checkpoint {path}, but the model built from case '{CASE}' has (257, 64)" in err
    assert "pass a --case whose model section matches it" in err and "hidden_size=32" in err


def test_megatron_lm_save_directory_errors(tmp_path):
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("12\n")
    with pytest.raises(CheckpointError, match=r"names iteration 12, but .*iter_0000012 does not exist"):
        resolve_checkpoint(tmp_path)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("last\n")
    with pytest.raises(CheckpointError, match=r"holds 'last', not an iteration number or 'release'"):
        resolve_checkpoint(tmp_path)
    legacy = tmp_path / "iter_0000003"
    (legacy / "mp_rank_00").mkdir(parents=True)
    with pytest.raises(CheckpointError, match=r"legacy \(torch\) Megatron-LM checkpoint .*torch_dist"):
        resolve_checkpoint(legacy)
    (tmp_path / "file").write_text("")
    with pytest.raises(CheckpointError, match="is a file, not a directory"):
        resolve_checkpoint(tmp_path / "file")
    (tmp_path / "latest_checkpointed_iteration.txt").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(CheckpointError, match=r"cannot read .*latest_checkpointed_iteration.txt"):
        resolve_checkpoint(tmp_path)


@pytest.mark.parametrize("metadata", ["[1, 2]", "{not json", None])
def test_damaged_metadata_json_is_refused(tmp_path, metadata):
    if metadata is None:
        (tmp_path / "metadata.json").mkdir()  # a directory where the file should be
    else:
        (tmp_path / "metadata.json").write_text(metadata)
    with pytest.raises(CheckpointError, match=r"metadata.json is unreadable .*save it again"):
        resolve_checkpoint(tmp_path)


def _metadata(directory, backend: str = "torch_dist") -> None:
    """The metadata.json megatron-core's dist_checkpointing.save writes (its CheckpointingConfig)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "metadata.json").write_text(json.dumps({
        "sharded_backend": backend, "sharded_backend_version": 1,
        "common_backend": "torch", "common_backend_version": 1}))


def test_megatron_lm_release_and_iteration_trackers_resolve(tmp_path):
    _metadata(tmp_path / "release")
    _metadata(tmp_path / "iter_0000042")
    tracker = tmp_path / "latest_checkpointed_iteration.txt"
    tracker.write_text("release\n")
    source = resolve_checkpoint(tmp_path)
    assert (source.path, source.iteration, source.backend) == (str(tmp_path / "release"), "release", "torch_dist")
    tracker.write_text("42\n")
    source = resolve_checkpoint(tmp_path)
    assert (source.path, source.iteration) == (str(tmp_path / "iter_0000042"), 42)
    assert source.describe() == (f"{tmp_path / 'iter_0000042'} (iteration 42, resolved from "
                                 f"{tracker}), torch_dist")


def test_other_sharded_backend_is_refused(tmp_path):
    _metadata(tmp_path, backend="zarr")
    with pytest.raises(CheckpointError, match=r"is a 'zarr' distributed"):
        resolve_checkpoint(tmp_path)
