"""Benchmarks of what megatron-ext's runtime patches cost (``scripts/bench.py``).

Measurement side, run inside one worker process per megatron-core release:

* :mod:`.worker`: ``python -m benchmarks.worker`` with that release's tree first on
  ``PYTHONPATH``; answers JSON-line requests from the orchestrator on stdin/stdout;
* :mod:`.release`, :mod:`.add_request`, :mod:`.e2e`: sections 1, 2 and 3 (and 5);
  :mod:`.weight_update`: section 6 (fault 8's patch, and its flush).

Orchestrator side (these modules import neither torch nor megatron-core, so that the script
starts in a second; ``scripts/bench.py`` loads them without running ``megatron_ext/__init__``):

* :mod:`.trees`: find or fetch an unpacked megatron-core tree per release;
* :mod:`.runner`: starts the workers, interleaves variants and releases, builds the report;
* :mod:`.stats`: medians, quartiles and ratio spreads; :mod:`.report`: the rich tables.

Nothing here is imported by ``megatron_ext`` itself.
"""
