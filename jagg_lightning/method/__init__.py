"""The method's math, plain torch: JAGG's windows and composite gradients (``jagg.py``), the window scores and the
routing (``routing.py``), the window estimators (``estimators/``, one file each: a new estimator goes there), the
step kinds and their log-probs (``sde.py``, the SDE window's checks in ``sde_window.py``), the rollout's ODE tail
(``ode_solvers.py``) and GRPO's advantages and clipped surrogate with its published variants (``grpo.py``). It may
import only ``utils/``: no Lightning, no model, no config section, nothing of the training step; everything above
it may import it. (This file imports nothing, so importing a part runs no more than that part.)
"""
