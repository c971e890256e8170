"""No noise on every command (issue 58): the pipeline loads without diffusers' or transformers' loading bars once the
CLI's quiet defaults are set (fit, validate and predict all load it so), and the model summary a fit prints has no
FLOPs column (Lightning measures FLOPs only on an ``example_input_array``, so it always read 0)."""

import lightning as L
import torch
from diffusers import StableDiffusion3Pipeline
from diffusers.utils import logging as diffusers_logging
from lightning.pytorch.utilities.model_summary import summarize
from transformers.utils import logging as transformers_logging

from jagg_lightning.callbacks import ParameterSummary
from jagg_lightning.cli.quiet import quiet_loading_bars
from jagg_lightning.policies import FAMILIES


def test_the_pipeline_loads_without_a_progress_bar(tmp_path, capfd):
    FAMILIES["sd3"].policy_class().build_tiny_pipeline(0, torch.float32).save_pretrained(tmp_path / "pipe")
    capfd.readouterr()
    try:
        quiet_loading_bars()  # what the CLI calls once its loggers are built (fit) or on validate / test / predict
        StableDiffusion3Pipeline.from_pretrained(tmp_path / "pipe", text_encoder_3=None, tokenizer_3=None)
        out, err = capfd.readouterr()
    finally:
        diffusers_logging.enable_progress_bar()
        transformers_logging.enable_progress_bar()
    assert "Loading pipeline components" not in err + out and "Loading weights" not in err + out, err


class Small(L.LightningModule):
    def __init__(self, width: int):
        super().__init__()
        self.body = torch.nn.Linear(width, width)
        self.head = torch.nn.Linear(width, 1)
        self.head.requires_grad_(False)


def test_the_model_summary_has_parameters_and_no_flops(capsys, rng_seed):
    width = 2 + rng_seed % 20  # up to 484 parameters: counts print as plain integers
    summary = summarize(Small(width), max_depth=1)
    assert "FLOPs" in dict(summary._get_summary_data())  # Lightning's own has the column
    ParameterSummary.summarize(summary._get_summary_data(), summary.total_parameters, summary.trainable_parameters,
                               summary.model_size, summary.total_training_modes, summary.total_flops)
    printed = capsys.readouterr().out
    assert "FLOPs" not in printed and "body" in printed and "head" in printed
    assert f"Trainable params: {width * width + width}" in printed and f"Total params: {width * width + 2 * width + 1}" in printed
