"""``jagg_lightning.strategies``: the public path of the distributed strategies (they live in
:mod:`jagg_lightning.distributed.strategies`).

It stays because configs name it (``trainer.strategy.class_path: jagg_lightning.strategies.FSDP2Strategy`` in
configs/*.yaml, the docs and users' own YAML files) and checkpoints' saved configs record it. Nothing inside the
package imports it (``tests/unit/test_architecture.py``).
"""

from jagg_lightning.distributed.strategies import DDPStrategy, FSDP2Strategy  # noqa: F401

__all__ = ["DDPStrategy", "FSDP2Strategy"]
