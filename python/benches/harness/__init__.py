"""What every benchmark in python/benches shares, so the scripts only parse arguments.

* :mod:`harness.trace`: the Azure trace loader and the random prompts drawn from it;
* :mod:`harness.stats`: the one percentile and the serving metrics built on it;
* :mod:`harness.table`: the one text-table printer;
* :mod:`harness.models`: the one random-weight model builder and the configs it builds;
* :mod:`harness.engine`: the one runner of transformers' continuous-batching engine;
* :mod:`harness.contenders`: every serving contender, by name, and how to configure it;
* :mod:`harness.check`: teacher-forced logits checks of an engine run;
* the other modules: each script's body (README.md names which).

:mod:`harness.trace` (but :func:`~harness.trace.random_prompts`), :mod:`harness.stats` and
:mod:`harness.table` import neither torch nor transformers: they are tested without them.
Scripts run as ``python3 python/benches/X.py``: the script's own directory is on ``sys.path``,
so ``harness`` is found as a sibling package; tests find it through pytest's ``pythonpath``.
"""
