"""The A/B harness: proves that prefix caching on vs off is bit-identical (``megatron-ext ab`` / ``soak``).

Nothing here is imported by a job that only applies the fixes (``megatron_ext.apply`` /
``megatron_ext.auto``). The parts:

* :mod:`.cases`: the case files (shipped YAMLs and the schema); :mod:`.soak`: generated cases;
  :mod:`.prompts`: ``--prompts FILE``; :mod:`.megatron_case`: Megatron ``model_config.yaml`` files;
* :mod:`.engine`: model, context and engine built from a case; :mod:`.tokenizer`: megatron-core's
  tokenizers behind one wrapper (byte-level by default, ``--tokenizer PATH``);
* :mod:`.step_loop`: drives the engine step by step, with the audits attached
  (:mod:`.audits`, one module per invariant); :mod:`.compare`: bit-for-bit comparison of two runs;
* :mod:`.ab`: run A (caching off) and B (on, per eviction policy) and judge;
  :mod:`.report`: the tables, plots and verdicts of ``ab`` and ``compare``; :mod:`.recorded`: runs
  read back from ab/soak JSON files (``compare``);
* :mod:`.checkpoint`: ``--load`` / ``save-checkpoint``; :mod:`.checkpoint_args`: the model from and
  to Megatron-LM's checkpoint args; :mod:`.distributed`: torchrun ranks;
* what a run needs, checked before it starts: :mod:`.run_inputs` (the case, tokenizer, prompts and
  checkpoints of ``ab``), :mod:`.launch` (torchrun ranks vs the TP x PP layout),
  :mod:`.output_files` (``--json`` / ``--plot`` / ``--dump-case``), :mod:`.triton_env` (Triton's
  variables for a hybrid case on the CPU);
* :mod:`.factories`: small contexts and requests for tests and benchmarks.
"""
