"""Stop signals sent from inside a run at a chosen moment: during the rollout (the transformer's n-th forward of a
step), while the reward scores (its n-th call) or during the update (the n-th backward of a step). The signal is a
real one (``os.kill`` on this process); the handler under test runs as it would for a scheduler's."""

import os
import signal

import lightning as L

from jagg_lightning.rewards import JpegCompressibility


class SignalingReward(JpegCompressibility):
    """JPEG compressibility that sends ``signum`` to its own process on its ``at_call``-th call (0-based), ``times``
    times in a row (2 x SIGINT: Ctrl-C pressed twice)."""

    def __init__(self, at_call: int = -1, signum: int = int(signal.SIGTERM), times: int = 1):
        super().__init__()
        self.at_call, self.signum, self.times, self.calls = at_call, signum, times, 0

    def score(self, images, prompts):
        if self.calls == self.at_call:
            for _ in range(self.times):
                os.kill(os.getpid(), self.signum)
        self.calls += 1
        return super().score(images, prompts)


class SignalAt(L.Callback):
    """Sends ``signum`` to this process in training step ``step`` (0-based global step): at the transformer's
    ``index``-th forward of that step (``phase="rollout"``) or its ``index``-th backward (``phase="update"``)."""

    def __init__(self, step: int, phase: str, index: int = 0, signum: int = int(signal.SIGTERM)):
        assert phase in ("rollout", "update")
        self.step, self.phase, self.index, self.signum = step, phase, index, signum
        self.count, self.handle = 0, None

    def _fire(self) -> None:
        if self.count == self.index:
            os.kill(os.getpid(), self.signum)
        self.count += 1

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if trainer.global_step == self.step and self.phase == "rollout" and self.handle is None:
            self.handle = module.policy.transformer.register_forward_pre_hook(lambda *_: self._fire())

    def on_before_backward(self, trainer, module, loss):
        if trainer.global_step == self.step and self.phase == "update":
            self._fire()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if self.handle is not None:
            self.handle.remove()
            self.handle = None

    def on_exception(self, trainer, module, exception):
        self.on_train_batch_end(trainer, module, None, None, 0)


class InterruptedWhileLoading(JpegCompressibility):
    """A reward whose construction is cut short by SIGINT (Ctrl-C while a reward model loads)."""

    def __init__(self):
        super().__init__()
        os.kill(os.getpid(), signal.SIGINT)
