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

from jagg_lightning.config.old_keys import JAGGDeprecationWarning

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
    # Context parallelism: diffusers' own gather (hooks/context_parallel.py) calls a torch collective torch has
    # renamed; the call still gathers what it did (the context-parallel tests equal one process to ~1e-15).
    (r"`torch.distributed._functional_collectives.all_gather_tensor` is deprecated", FutureWarning),
    # FSDP2 warns that the sharded transformer returns a view (diffusers' unpatchify reshapes): an in-place op on
    # it would skip FSDP2's pre-backward hook. The policies never write into the transformer's output in place (they
    # compute the velocity out of place); the FSDP2 tests equal one process (tests/distributed/test_fsdp2*.py).
    (r"FSDP2-wrapped module \(\w+\) returned a view tensor", UserWarning),
    # The evaluation's val/* and test/* values are sums and counts all-reduced over the data ranks before they are
    # logged (JAGGModule's evaluation; DigitAccuracy scores the same prompts on every process): every process logs
    # the same number, and Lightning's suggested sync_dist would only average it once more.
    (r"It is recommended to use `self.log\('(val|test)/(reward|digit_|judge_)", UserWarning),
]
# log records that are filtered: (logger, message), each with why it is harmless here
HARMLESS_LOGS = [
    # Flux2Pipeline.encode_prompt (FLUX.2 [dev]) passes padding / truncation / max_length to its processor's
    # apply_chat_template as plain keyword arguments; transformers 5 warns on every prompt batch but applies them (the
    # family tests compare the condition with the pipeline's own, cut at max_sequence_length).
    ("transformers.processing_utils", r"Kwargs passed to `processor.__call__` have to be in `processor_kwargs`"),
    # trainer.strategy.context_parallel_size > 1 runs on diffusers' context-parallel engine, which diffusers calls
    # experimental; the diffusers versions setup.cfg allows are the ones the context-parallel tests pass on
    # (docs/distributed.md says so once, for the user).
    ("diffusers.models.modeling_utils", r"`enable_parallelism` is an experimental feature"),
    # diffusers' pipelines tokenize a prompt once more without truncation, only to name what the truncation cut; the
    # encoding itself is truncated. The pipeline's own line naming the cut words ("The following part of your input
    # was truncated ...": a user can act on it, policy.max_sequence_length) stays.
    ("transformers.tokenization_utils_base", r"Token indices sequence length is longer than the specified maximum"),
    # Wan's context-parallel plan splits a per-token timestep [B, tokens] (Wan2.2 TI2V) along the tokens; Wan2.1
    # passes one timestep per sample [B], which every token shares: not splitting it is right.
    ("diffusers.hooks.context_parallel", r"Expected input tensor to have 2 dimensions, but got 1 dimensions, "
                                         r"split will not be applied"),
    # The offline twins (policy.pretrained null) are built in float32 and cast with .to(dtype) for a float64 / bf16
    # twin; a pretrained model loads with from_pretrained(torch_dtype=...), which keeps those modules as diffusers
    # wants. A twin is a test bed: every module in one dtype is what its tests compare against.
    ("diffusers.models.modeling_utils", r"There are modules in \w+ that should be kept in float32"),
]
# loggers whose info lines ("Seed set to 0", "GPU available: False", cloud-service tips) a run does not need
QUIET_LOGGERS = ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero",
                 "lightning.fabric.utilities.seed", "lightning.pytorch.utilities.seed")
# stderr lines a plain run may print (the progress bar goes to stdout): regular expressions
# diffusers' / transformers' loading bars (tqdm: carriage returns and cursor-up escapes), blank lines
# and, in a job of several processes, Lightning's one line per process saying which it is
ALLOWED_STDERR = [r"^(\x1b\[A)*(Loading (pipeline components|weights|checkpoint shards)|Fetching \d+ files)",
                  r"^(\x1b\[A|\s)*$", r"^Initializing distributed: GLOBAL_RANK: \d+, MEMBER: \d+/\d+$"]


def quiet_defaults() -> None:
    for message, category in HARMLESS:
        warnings.filterwarnings("ignore", message=message, category=category)
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    for name, message in HARMLESS_LOGS:
        logging.getLogger(name).addFilter(lambda record, pattern=message: not re.search(pattern, record.getMessage()))
    warnings.showwarning = _one_line_deprecations(warnings.showwarning)


def quiet_loading_bars() -> None:
    """diffusers' and transformers' loading bars ("Loading pipeline components...", "Loading weights") off: every
    command loads the pipeline (fit, validate, predict), and a bar per component says nothing a run needs. Called
    before the classes are built (``JAGGCLI.before_instantiate_classes``), not at start: ``--help`` imports no
    diffusers."""
    from diffusers.utils import logging as diffusers_logging

    diffusers_logging.disable_progress_bar()
    try:
        from transformers.utils import logging as transformers_logging
    except ImportError:  # transformers is optional for a pipeline without text encoders
        return
    transformers_logging.disable_progress_bar()


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
