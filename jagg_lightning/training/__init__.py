"""One training step, from the plan to the report, in plain torch: the rollout plan and the sampled trajectories
(``rollout.py``), the ``Sampler`` (prompt encoding, guidance, micro-batches, scoring), which steps get a backward
pass (``passes.py``), ``Updater.step`` (``update.py``: GRPO's update, fused or unfused, into a ``StepReport``),
the ``train/*`` values (``metrics.py``), the EMA of the trained weights (``ema.py``), what a checkpoint holds
beyond Lightning's state (``state.py``) and the sample grids and images it logs (``grids.py``, ``images.py``:
these two and ``state.py`` use Lightning's loggers and warnings). It may import ``utils/``, ``faults/``,
``method/``, ``models/``, ``config/``, ``policies/``, ``rewards/`` and ``distributed/``; ``objectives/``,
``memory_plan/``, ``module.py`` and the Lightning side above import it, never the reverse.
"""
