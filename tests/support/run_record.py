"""A callback a CLI run under test is given (``trainer.callbacks``): every rank writes its trainable weights at the
start and the end of fit and what it logged at each training step and validation, so a test can compare a run of
several processes with one process's."""

import json
from pathlib import Path

import lightning as L
from safetensors.torch import save_file

from jagg_lightning.utils.sharding import full_tensor


class RunRecord(L.Callback):
    def __init__(self, dirpath: str):
        self.dirpath = Path(dirpath)
        self.steps: list[dict] = []
        self.validations: list[dict] = []
        self.tokens = 0  # the longest sequence the first attention layer saw (halved by a context degree of 2)

    def _weights(self, trainer, module, when: str) -> None:
        # full_tensor is a collective under FSDP2: every rank gathers, in the same order
        weights = {n: full_tensor(p).detach().contiguous() for n, p in module.named_parameters() if p.requires_grad}
        self.dirpath.mkdir(parents=True, exist_ok=True)
        save_file(weights, self.dirpath / f"rank{trainer.global_rank}_{when}.safetensors")

    def on_train_start(self, trainer, module) -> None:
        self._weights(trainer, module, "start")
        attention = next(m for m in module.policy.transformer.modules() if hasattr(m, "processor"))

        def seen(_, args, kwargs):
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            self.tokens = max(self.tokens, hidden.shape[1])

        attention.register_forward_pre_hook(seen, with_kwargs=True)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.steps.append({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("train/")}
                          | {"prompts": list(batch["index"].tolist())})

    def on_validation_end(self, trainer, module) -> None:
        if not trainer.sanity_checking:
            self.validations.append({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")})

    def on_train_end(self, trainer, module) -> None:
        self._weights(trainer, module, "end")
        record = {"steps": self.steps, "validations": self.validations, "world": trainer.world_size,
                  "tokens": self.tokens}
        (self.dirpath / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))
