"""The CLI's one error style: ``jagg: error: <field as the user wrote it> ...`` on one line, exit status 2.

- parse errors (an unknown key, a value of the wrong type) become one line, with the closest valid key ("did you
  mean") and, for a key read from a ``--config`` file, that file and line -- no usage dump;
- the module's messages name fields by section (``jagg.window_size``); the user wrote ``model.jagg.window_size``;
- trainer fields are checked here before the Trainer exists (Lightning's own checks raise tracebacks later).
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path

MODEL_SECTIONS = ("policy", "sampling", "grpo", "jagg", "evaluation")
MODEL_FIELDS = ("reward", "reward_workers", "ema_decay", "optimizer", "lr_scheduler")
_SECTION = re.compile(r"(?<![\w./-])(" + "|".join(MODEL_SECTIONS) + r")\.(?=[a-z_])")
_FIELD = re.compile(r"^(" + "|".join(MODEL_FIELDS) + r")\b")


def as_user_field(message: str) -> str:
    """``jagg.window_size must be ...`` -> ``model.jagg.window_size must be ...`` (every mention)."""
    message = _SECTION.sub(r"model.\1.", message)
    return _FIELD.sub(r"model.\1", message)


def one_line(message: str) -> str:
    return re.sub(r"\s*\n\s*", "; ", message.strip())


def flat_keys(namespace, prefix: str = "") -> set[str]:
    """Every dotted key of a (nested) jsonargparse Namespace or dict, branches included."""
    keys: set[str] = set()
    items = namespace.items() if isinstance(namespace, dict) else vars(namespace).items() if hasattr(
        namespace, "__dict__") else ()
    for key, value in items:
        full = f"{prefix}{key}"
        keys.add(full)
        if isinstance(value, dict) or type(value).__name__ == "Namespace":
            keys |= flat_keys(value, full + ".")
    return keys


def config_files(argv: list[str]) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--config"] + [
        a.split("=", 1)[1] for a in argv if a.startswith("--config=")]


def where_in_files(key: str, files: list[str]) -> str | None:
    """"FILE line N" of the first line of a --config file that sets ``key``'s last part."""
    leaf = key.rsplit(".", 1)[-1]
    for file in files:
        try:
            lines = Path(file).read_text().splitlines()
        except OSError:
            continue
        for n, line in enumerate(lines, 1):
            if re.match(rf"\s*-?\s*{re.escape(leaf)}\s*:", line):
                return f"{file} line {n}"
    return None


def strategy_error(message: str) -> str | None:
    """The one fact inside jsonargparse's "Does not validate against any of the Union subtypes" about a
    ``trainer.strategy`` class: the strategy's own check, or the strategy field whose value is refused."""
    message = one_line(message)
    own = re.search(r"(trainer\.strategy\.\w+ must [^;]*)", message)
    if own:
        return own.group(1)
    field = re.search(r"trainer\.strategy: .*?Parser key \"(\w+)\":;?\s*(Expected [^;]*)", message)
    return f"trainer.strategy.{field.group(1)}: {field.group(2)}" if field else None


# an optional module -> what to install for it (docs/callbacks.md "Loggers", docs/rewards.md)
PIP_NAMES = {"tensorboard": "tensorboard", "tensorboardX": "tensorboard", "mlflow": "mlflow-skinny", "wandb": "wandb",
             "comet_ml": "comet-ml", "neptune": "neptune", "rapidocr_onnxruntime": "'jagg_lightning[ocr]'",
             "hpsv2": "'jagg_lightning[rewards]' and pip install --no-deps hpsv2x==1.2.0", "starlette": "'jagg_lightning[serve]'",
             "uvicorn": "'jagg_lightning[serve]'"}
_MISSING = (re.compile(r"Neither `(tensorboard)` nor `tensorboardX` is available"),  # Lightning's TensorBoardLogger
            re.compile(r"Requirement '([\w.-]+?)(?:[<>=!~;\[].*?)?' not met"),  # Lightning's other loggers
            re.compile(r"No module named '([\w]+)"))  # any import: its top-level module


def missing_package(message: str, field: str | None = None) -> str | None:
    """One line for a logger or reward whose optional package is not installed, out of whatever wraps it
    (jsonargparse's "Does not validate against any of the Union subtypes", Lightning's requirement hint, an
    ImportError): ``trainer.logger: lightning.pytorch.loggers.TensorBoardLogger needs tensorboard, which is not
    installed: pip install tensorboard``. None when the message is about something else."""
    text = one_line(message)
    module = next((m.group(1) for pattern in _MISSING for m in [pattern.search(text)] if m), None)
    if module is None:
        return None
    own = re.search(r"(reward \w+) needs", text)  # our rewards say what they need (and whose extra)
    given = re.search(r"Problem with given class_path '([\w.]+)'", text)
    if field is None:
        field = ("trainer.logger" if "loggers.logger.Logger" in text else
                 "model.reward" if "rewards.base.Reward" in text or own else None)
    what = own.group(1) if own else given.group(1) if given else None
    install = PIP_NAMES.get(module) or PIP_NAMES.get(module.replace("-", "_"))
    if install is None and "No module named" in text:  # not an optional package of ours: a user's own module
        return (f"{field}: " if field else "") + (f"{what}: " if what else "") + (
            f"No module named {module!r} (is its folder on PYTHONPATH? docs/rewards.md, 'Your own reward')")
    how = f"pip install {install}" if install else "install the package that provides it"
    needs = f"{what} needs the {module} module" if what else f"the Python module {module!r} is missing"
    return (f"{field}: " if field else "") + f"{needs}, which is not installed: {how}"


def explain_parse_error(message: str, argv: list[str], known: set[str]) -> str:
    """One line for a jsonargparse error: the unknown key with a suggestion and its file, or the bad value."""
    unknown = re.search(r"does not accept option '([\w.]+)'|unrecognized arguments: --([\w.]+)"
                        r"|Key \"([\w.]+)\" is not expected", message)
    if unknown:
        key = next(g for g in unknown.groups() if g)
        close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
        on_command_line = any(a == f"--{key}" or a.startswith(f"--{key}=") for a in argv)
        where = None if on_command_line else where_in_files(key, config_files(argv))
        text = f"{where}: " if where else ""
        text += f"{key} is not a setting"
        return text + (f"; did you mean {close[0]}?" if close else " (jagg fit --print_config lists every setting)")
    strategy = strategy_error(message)
    if strategy:
        return strategy
    bad = re.search(r'Parser key "([\w.]+)":\s*(.*)', message, re.S)
    if bad:
        # a class's own argument (trainer.strategy's context_parallel_kind) is named inside: name it in full
        inner = re.findall(r'Parser key "([\w.]+)"', bad.group(2))
        field = f"{bad.group(1)}.{inner[-1]}" if inner else bad.group(1)
        return f"{field}: " + (not_one_of(bad.group(2)) or
                               re.sub(r"<class '(\w+)'>", r"\1", one_line(bad.group(2))))
    return one_line(message)


def not_one_of(message: str) -> str | None:
    """jsonargparse's ``Expected a typing.Literal['grpo', 'nft', 'awm']. Got value: nfft`` as a user reads it:
    ``'nfft' is not one of grpo, nft, awm; did you mean nft?`` (None for another message)."""
    found = re.search(r"Literal\[([^\]]*)\]\.?\s*Got value:\s*(\S+)", message)
    if found is None:
        return None
    allowed = [a.strip().strip("'\"") for a in found.group(1).split(",") if a.strip()]
    given = found.group(2).strip().strip("'\"")
    close = difflib.get_close_matches(given, allowed, n=1, cutoff=0.5)
    return (f"{given!r} is not one of {', '.join(allowed)}" + (f"; did you mean {close[0]}?" if close else ""))


def _int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# trainer field -> (is the value allowed, the allowed range as the message says it)
TRAINER_CHECKS = {
    "max_steps": (lambda v: _int(v) and v >= -1, "an integer >= 0, or -1 (no limit)"),
    "max_epochs": (lambda v: v is None or (_int(v) and v >= -1), "an integer >= 0, -1 (no limit) or null"),
    "min_steps": (lambda v: v is None or (_int(v) and v >= 0), "an integer >= 0 or null"),
    "log_every_n_steps": (lambda v: v is None or (_int(v) and v >= 1), "an integer >= 1 or null"),
    "check_val_every_n_epoch": (lambda v: v is None or (_int(v) and v >= 1), "an integer >= 1 or null"),
    "num_sanity_val_steps": (lambda v: v is None or (_int(v) and v >= -1), "an integer >= 0, -1 (all) or null"),
    "val_check_interval": (lambda v: v is None or (_int(v) and v >= 1) or (isinstance(v, float) and 0 < v <= 1),
                           "an integer >= 1 (batches), a fraction in (0, 1] of an epoch, or null"),
    "accumulate_grad_batches": (lambda v: v in (None, 1), "1: the update accumulates its own micro-batches "
                                "(model.grpo.micro_batches_per_update)"),
    "gradient_clip_val": (lambda v: v is None, "null: the update clips its own gradient (model.grpo.max_grad_norm)"),
}
for _name in ("limit_train_batches", "limit_val_batches", "limit_test_batches", "limit_predict_batches"):
    TRAINER_CHECKS[_name] = (lambda v: v is None or (_int(v) and v >= 0) or (isinstance(v, float) and 0 <= v <= 1),
                             "an integer >= 0 (batches), a fraction in [0, 1] or null")


def check_trainer(trainer) -> None:
    """ValueError naming the first bad trainer field (``trainer.max_steps must be ..., got -5``)."""
    if trainer is None:
        return
    for name, (ok, allowed) in TRAINER_CHECKS.items():
        value = trainer.get(name) if hasattr(trainer, "get") else None
        if not ok(value):
            raise ValueError(f"trainer.{name} must be {allowed}, got {value!r}")


LIGHTNING_CKPT_NAMES = ("last", "best", "hpc")


def check_checkpoint_file(path) -> None:
    """ValueError naming ``ckpt_path`` unless ``path`` is a readable Lightning checkpoint (or one of Lightning's own
    names: last, best, hpc, registry...). A checkpoint that needs full unpickling (weights_only=False) passes:
    Lightning loads it as the user's ``--weights_only`` says."""
    if path is None or str(path) in LIGHTNING_CKPT_NAMES or str(path).startswith("registry"):
        return
    import pickle

    import torch

    file = Path(path)
    if not file.is_file():
        raise ValueError(f"ckpt_path: no such file {str(path)!r}")
    try:
        checkpoint = torch.load(file, map_location="cpu", weights_only=True, mmap=False)
    except pickle.UnpicklingError as err:
        if "Weights only load failed" in str(err) and "Unsupported global" in str(err):
            return
        raise ValueError(f"ckpt_path: {str(path)!r} is not a checkpoint (unreadable: {one_line(str(err))[:120]})")
    except Exception as err:  # truncated zip, a text file, a directory entry...: name the file, not the reader
        raise ValueError(f"ckpt_path: {str(path)!r} is not a checkpoint, or is truncated "
                         f"({type(err).__name__}: {one_line(str(err))[:120]})") from None
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint or "global_step" not in checkpoint:
        raise ValueError(f"ckpt_path: {str(path)!r} is not a Lightning checkpoint (no state_dict / global_step)")


def command_line_keys(argv: list[str], prefix: str) -> set[str]:
    """Dotted keys given as ``--<prefix>.key`` on the command line (without the prefix)."""
    return {a[2 + len(prefix) + 1:].split("=", 1)[0] for a in argv if a.startswith(f"--{prefix}.")}
