"""What a plain ``jagg`` run does not print: Lightning's info chatter and warnings known to be harmless here.

Called by the console entry point only (a library user's own warnings and logging stay theirs). Each filter says
why the warning does not apply; ``tests/cli/test_first_hour.py`` runs the main job and allows no other warning line
than ``ALLOWED_STDERR`` (docs/configuration.md, "What a run prints").
"""

from __future__ import annotations

import logging
import re
import sys
import warnings

from jagg_lightning.old_keys import JAGGDeprecationWarning

# warnings that are filtered, each with why it is harmless here
HARMLESS = [
    # The frozen text encoders, VAE and base transformer are kept in eval mode on purpose (no dropout in the
    # rollout, the reference or the update); Lightning warns about any module in eval mode at fit start.
    (r"Found \d+ module\(s\) in eval mode", UserWarning),
    # diffusers >= 0.36 renamed from_pretrained's torch_dtype to dtype; the policies pass torch_dtype so that
    # diffusers 0.35 (setup.cfg's minimum) still loads. The value is honoured either way.
    (r"`torch_dtype` is deprecated", FutureWarning),
    # Lightning 2.6 calls a torch.utils._pytree API that torch 2.14 deprecated; Lightning's own code, no effect.
    (r"`isinstance\(treespec, LeafSpec\)` is deprecated", Warning),
]
# log records that are filtered: (logger, message), each with why it is harmless here
HARMLESS_LOGS = [
    # Flux2Pipeline.encode_prompt (FLUX.2 [dev]) passes padding / truncation / max_length to its processor's
    # apply_chat_template as plain keyword arguments; transformers 5 warns on every prompt batch but applies them (the
    # family tests compare the condition with the pipeline's own, cut at max_sequence_length).
    ("transformers.processing_utils", r"Kwargs passed to `processor.__call__` have to be in `processor_kwargs`"),
]
# loggers whose info lines ("Seed set to 0", "GPU available: False", cloud-service tips) a run does not need
QUIET_LOGGERS = ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero",
                 "lightning.fabric.utilities.seed", "lightning.pytorch.utilities.seed")
# stderr lines a plain run may print (the progress bar goes to stdout): regular expressions
# diffusers' / transformers' loading bars (tqdm: carriage returns and cursor-up escapes), blank lines
ALLOWED_STDERR = [r"^(\x1b\[A)*(Loading (pipeline components|weights|checkpoint shards)|Fetching \d+ files)",
                  r"^(\x1b\[A|\s)*$"]


def quiet_defaults() -> None:
    for message, category in HARMLESS:
        warnings.filterwarnings("ignore", message=message, category=category)
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    for name, message in HARMLESS_LOGS:
        logging.getLogger(name).addFilter(lambda record, pattern=message: not re.search(pattern, record.getMessage()))
    warnings.showwarning = _one_line_deprecations(warnings.showwarning)


def _one_line_deprecations(show):
    """A renamed config key is ONE ``jagg: <old> is deprecated: use <new>`` line (not Python's two with a source
    line); every other warning as before."""

    def showwarning(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, JAGGDeprecationWarning):
            print(f"jagg: {message}", file=file or sys.stderr)
            return
        show(message, category, filename, lineno, file, line)

    return showwarning


def unexpected_lines(stderr: str) -> list[str]:
    """Lines of a run's stderr not on :data:`ALLOWED_STDERR` (progress-bar redraws split on carriage returns)."""
    lines = [part for line in stderr.splitlines() for part in line.split("\r")]
    return [line for line in lines if not any(re.search(p, line) for p in ALLOWED_STDERR)]
