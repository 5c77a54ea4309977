"""The A/B harness: proves that prefix caching on vs off is bit-identical (``megatron-ext ab`` / ``soak``).

Nothing here is imported by a job that only applies the fixes (``megatron_ext.apply`` /
``megatron_ext.auto``). The parts:

* :mod:`.cases`: the case files (shipped YAMLs and the schema); :mod:`.soak`: generated cases;
* :mod:`.engine`: model, context and engine built from a case; :mod:`.tokenizer`: the byte tokenizer;
* :mod:`.step_loop`: drives the engine step by step, with the audits attached
  (:mod:`.audits`, one module per invariant); :mod:`.compare`: bit-for-bit comparison of two runs;
* :mod:`.ab`: run A (caching off) and B (on, per eviction policy) and judge;
  :mod:`.report`: the A/B tables and plot;
* :mod:`.checkpoint`: ``--load`` / ``save-checkpoint``; :mod:`.distributed`: torchrun ranks.
"""
