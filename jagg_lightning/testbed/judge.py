"""An independent judge for the digits test bed: does GRPO teach digits, or only fool its reward?

``DigitReward`` is what GRPO maximises, so a rising held-out score from the same classifier could be
reward hacking: images drifting toward whatever that CNN happens to like. The judge is a second reader
that GRPO never sees and that fails differently: multinomial logistic regression (scikit-learn's
``LogisticRegression``, its defaults: L2, C = 1, lbfgs) on the 64 pixels of the same 8x8 grey grid the
reward reads (:func:`~jagg_lightning.rewards.digits.to_digit_grid`), fitted on the clean train split
only (the reward's CNN saw shifted, contrast-jittered, noised copies). A pattern that moves the CNN's
convolutions without drawing the digit need not move a linear read-out of the pixels.

    p(digit | grid) = softmax(W · vec(grid) + b),   W: 10 x 64, b: 10

``python -m jagg_lightning.testbed.judge`` refits it (scikit-learn, the ``test`` extra; well under a
second) and writes ``digits_judge.safetensors`` (W, b; its test-split accuracy in the metadata). The
shipped file loads without scikit-learn.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
from torch import Tensor, nn

from jagg_lightning.rewards.digits import prompt_digit, to_digit_grid
from jagg_lightning.testbed import JUDGE_PATH
from jagg_lightning.testbed.train import load_split, to_rgb

JUDGE_C = 1.0  # scikit-learn's default regularisation: the judge is not tuned toward anything


class DigitJudge(nn.Module):
    """[B, 3, H, W] images in [0, 1] (H, W multiples of 8) -> [B, 10] logits of a linear model on the 8x8 grid."""

    def __init__(self, weight: Tensor, bias: Tensor):
        super().__init__()
        if weight.shape != (10, 64) or bias.shape != (10,):
            raise ValueError(f"DigitJudge: weight must be 10 x 64 and bias 10, got {tuple(weight.shape)} and "
                             f"{tuple(bias.shape)}")
        self.linear = nn.Linear(64, 10, dtype=weight.dtype)
        with torch.no_grad():
            self.linear.weight.copy_(weight)
            self.linear.bias.copy_(bias)
        self.requires_grad_(False).eval()

    def forward(self, images: Tensor) -> Tensor:
        grid = to_digit_grid(images).flatten(1)
        return self.linear(grid.to(self.linear.weight.device, self.linear.weight.dtype))

    @torch.no_grad()
    def correct(self, images: Tensor, prompts: list[str]) -> Tensor:
        """[B] bool: the judge's most likely digit is the one the prompt names."""
        target = torch.tensor([prompt_digit(p) for p in prompts])
        return self(images).argmax(-1).cpu() == target


def load_judge(path: str | Path = JUDGE_PATH) -> DigitJudge:
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"DigitJudge: judge_path {str(path)!r} does not exist")
    state = load_file(str(path))
    return DigitJudge(state["weight"], state["bias"])


def judge_metadata(path: str | Path = JUDGE_PATH) -> dict[str, str]:
    """What the recipe recorded in the file: the fit's settings and its test-split accuracy."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return dict(f.metadata() or {})


def fit_judge(grids_train: Tensor, labels_train: Tensor, c: float = JUDGE_C) -> DigitJudge:
    """Logistic regression on [N, 1, 8, 8] grids (float64 fit); the returned judge is float32."""
    from sklearn.linear_model import LogisticRegression

    fit = LogisticRegression(C=c, max_iter=1000).fit(grids_train.flatten(1).double().numpy(), labels_train.numpy())
    if fit.n_iter_.max() >= fit.max_iter:
        raise RuntimeError(f"DigitJudge: lbfgs did not converge in {fit.max_iter} iterations")
    return DigitJudge(torch.from_numpy(fit.coef_).float(), torch.from_numpy(fit.intercept_).float())


def main(argv=None) -> dict[str, str]:
    from safetensors.torch import save_file


    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(JUDGE_PATH))
    parser.add_argument("--seed", type=int, default=0, help="the data split's seed (the test bed's: 0)")
    args = parser.parse_args(argv)
    x_train, y_train, x_test, y_test, _ = load_split(args.seed)
    # the grid the reward reads: the 32 px image the pipeline was trained on, pooled back to 8x8
    judge = fit_judge(to_digit_grid(to_rgb(x_train)), y_train)
    accuracy = float((judge(to_rgb(x_test)).argmax(-1) == y_test).float().mean())
    metadata = {"model": "sklearn LogisticRegression", "C": str(JUDGE_C), "input": "to_digit_grid(to_rgb(x))",
                "split_seed": str(args.seed), "train_images": str(len(y_train)), "test_accuracy": f"{accuracy:.6f}"}
    out = Path(args.out)
    tmp = out.with_name(out.name + ".tmp")
    save_file({"weight": judge.linear.weight.contiguous(), "bias": judge.linear.bias.contiguous()}, str(tmp),
              metadata=metadata)
    os.replace(tmp, out)
    print(f"judge test accuracy {accuracy:.4f}; wrote {out}")
    return metadata


if __name__ == "__main__":
    main()
