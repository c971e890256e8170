"""The private APIs of our dependencies that the package still uses, one test each (docs/architecture.md, "Private
APIs we still use"): each fails with a message saying what changed and where we depend on it, so an upgrade of
Lightning, torch or TensorBoard that moves one is caught here, not by a user. (The diffusers pipelines' private
latent helpers, ``QwenImagePipeline._unpack_latents``, ``QwenImageEditPipeline._encode_vae_image`` / ``_pack_latents``
and ``Flux2KleinPipeline._patchify_latents`` / ``_unpatchify_latents`` (``Flux2Pipeline``'s for FLUX.2 [dev]), are
checked where they are used: the family tests compare the policies' sampling with the pipelines' own.)"""

import inspect

import pytest
import torch


def test_lightning_hands_the_cli_config_to_save_hyperparameters_through_a_context_variable():
    """JAGGModule.__init__ (module.py) tells LightningCLI's instantiation from a plain Python one by
    ``hparams_mixin._given_hyperparameters``: the CLI's own config is then what the checkpoint records (re-parseable
    on --ckpt_path). Lightning has no public way to ask."""
    from contextvars import ContextVar

    from lightning.pytorch.core.mixins import hparams_mixin

    given = getattr(hparams_mixin, "_given_hyperparameters", None)
    assert isinstance(given, ContextVar), ("lightning moved hparams_mixin._given_hyperparameters: JAGGModule.__init__ "
                                           "can no longer tell LightningCLI's instantiation (module.py)")
    with hparams_mixin._given_hyperparameters_context(hparams={"a": 1}, instantiator="x"):
        assert given.get()["a"] == 1
    assert given.get() is None


def test_lightning_cli_keeps_its_subcommand_parsers():
    """cli/lightning_cli.py reads ``LightningCLI._subcommand_parsers`` for the keys a typo is matched against ("did you
    mean") and for the model section's defaults on --ckpt_path (what the user said vs. what the checkpoint restores)."""
    from lightning.pytorch.cli import LightningCLI

    source = inspect.getsource(LightningCLI)
    assert "self._subcommand_parsers[" in source, ("LightningCLI no longer keeps _subcommand_parsers: "
                                                    "cli/lightning_cli.py's typo suggestions and resume overrides read it")


def test_rich_progress_bar_still_describes_the_epoch_with_a_private_method():
    """callbacks/progress.py overrides ``RichProgressBar._get_train_description`` (without max_epochs Lightning
    prints "Epoch 19/-2")."""
    from lightning.pytorch.callbacks import RichProgressBar

    method = getattr(RichProgressBar, "_get_train_description", None)
    assert callable(method) and list(inspect.signature(method).parameters) == ["self", "current_epoch"], (
        "RichProgressBar._get_train_description changed: StepProgressBar (callbacks/progress.py) overrides it")


def test_tensorboard_summary_writer_gives_its_file_writer(tmp_path):
    """images.log_video writes an encoded GIF summary through ``SummaryWriter._get_file_writer()`` (``add_video``
    needs moviepy; the public ``file_writer`` attribute is None once the writer was closed)."""
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp_path))
    writer.close()
    file_writer = getattr(writer, "_get_file_writer", lambda: None)()
    assert file_writer is not None and callable(getattr(file_writer, "add_summary", None)), (
        "torch's SummaryWriter._get_file_writer changed: images.log_video writes videos through it")
    writer.close()


def test_lightning_names_the_sharded_checkpoint_metadata_as_we_do():
    """sharded_checkpoint.METADATA_FILE mirrors ``lightning.fabric.utilities.load._METADATA_FILENAME`` (the file
    ModelParallelStrategy writes beside the shards)."""
    from lightning.fabric.utilities import load

    from jagg_lightning.distributed.sharded_checkpoint import METADATA_FILE

    assert getattr(load, "_METADATA_FILENAME", None) == METADATA_FILE, (
        "Lightning renamed the sharded checkpoint's metadata file: update sharded_checkpoint.METADATA_FILE")


def test_torch_lists_the_process_groups_in_pg_map():
    """peer_failure.bound_every_group gives every process group of the process the collective timeout through
    ``torch.distributed.distributed_c10d._pg_map`` (ProcessGroup -> (backend, store)) and the public
    ``dist.set_timeout``."""
    import torch.distributed as dist

    pg_map = getattr(dist.distributed_c10d, "_pg_map", None)
    assert isinstance(pg_map, dict), ("torch.distributed.distributed_c10d._pg_map changed: peer_failure.bound_every_group "
                                      "lists the process groups through it")
    assert list(inspect.signature(dist.set_timeout).parameters) == ["timeout", "group"]


@pytest.mark.parametrize("args,kwargs,expected", [
    (("cpu",), {}, ("cpu", None)),
    ((torch.float64,), {}, (None, torch.float64)),
    (("cpu", torch.float16), {}, ("cpu", torch.float16)),
    ((), {"dtype": torch.bfloat16, "device": "cpu"}, ("cpu", torch.bfloat16)),
    ((torch.zeros(1, dtype=torch.float64),), {}, (torch.device("cpu"), torch.float64)),
    ((0,), {}, (0, None)),
    (("cpu", torch.float32, True), {}, ("cpu", torch.float32)),  # positional non_blocking is not a device
])
def test_module_to_reads_its_arguments_with_public_types_only(args, kwargs, expected):
    """JAGGModule.to parses Module.to's arguments itself (it used torch._C._nn._parse_to): against torch's parser."""
    from jagg_lightning.module import _to_arguments

    assert _to_arguments(args, kwargs) == expected
    device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)  # the reference only, never the package
    got_device, got_dtype = _to_arguments(args, kwargs)
    assert got_dtype == dtype and (got_device is None) == (device is None)


def test_lightning_keeps_what_the_preemption_stop_reads():
    """callbacks/preemption.py writes a SLURM job's checkpoint where Lightning's auto-resume looks
    (``trainer._checkpoint_connector.hpc_save_path``), reads the cluster environment from
    ``trainer._accelerator_connector``; cli/lightning_cli.py's ``--ckpt_path last`` weighs
    ``ModelCheckpoint._find_last_checkpoints`` against the stop's checkpoint."""
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector

    assert callable(getattr(_CheckpointConnector, "hpc_save_path", None)), \
        "lightning moved _CheckpointConnector.hpc_save_path: Preemption's SLURM checkpoint (callbacks/preemption.py)"
    assert callable(getattr(ModelCheckpoint, "_find_last_checkpoints", None)), \
        "lightning moved ModelCheckpoint._find_last_checkpoints: cli/lightning_cli.py's --ckpt_path last"
    trainer = Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False)
    assert hasattr(trainer._accelerator_connector, "cluster_environment"), \
        "lightning moved _AcceleratorConnector.cluster_environment: Preemption's SLURM detection"


def test_uvicorn_server_still_captures_signals_through_overridable_methods():
    """rewards/server.py overrides ``uvicorn.Server.capture_signals`` (so that a stop signal is not raised again inside
    the event loop, where it cancels the open requests with a traceback each) and ``handle_exit`` (to record it);
    ``serve`` must still enter the first and install the second. uvicorn has no public option for either."""
    uvicorn = pytest.importorskip("uvicorn")

    assert "self.capture_signals()" in inspect.getsource(uvicorn.Server.serve), (
        "uvicorn.Server.serve no longer enters capture_signals: serve-reward's Ctrl-C (rewards/server.py)")
    assert list(inspect.signature(uvicorn.Server.handle_exit).parameters) == ["self", "sig", "frame"], (
        "uvicorn.Server.handle_exit changed: serve-reward records its stop signal there (rewards/server.py)")
    assert "self.handle_exit" in inspect.getsource(uvicorn.Server.capture_signals), (
        "uvicorn.Server.capture_signals no longer installs handle_exit: serve-reward's Ctrl-C (rewards/server.py)")


def test_torch_keeps_what_regional_compilation_reads():
    """compiling.py raises ``torch._dynamo.config.recompile_limit`` (every block of a class shares one cache whose
    default of 8 entries the grad / adapter-off / block-shape variants exceed: past it torch runs blocks eagerly),
    reads ``torch._dynamo.utils.counters`` (``compile_counts``: the no-recompilation check and the benchmark) and
    ``nn.Module._compiled_call_impl`` (``is_compiled``: what ``nn.Module.compile`` sets, in place, no ``_orig_mod``)."""
    from torch import nn
    from torch._dynamo.utils import counters

    from jagg_lightning.models.compiling import compile_counts, is_compiled

    assert isinstance(torch._dynamo.config.recompile_limit, int), \
        "torch renamed torch._dynamo.config.recompile_limit: compiling.compile_policy raises it"
    before = compile_counts()
    layer = nn.Linear(2, 2)
    assert not is_compiled(layer)
    layer.compile(backend="eager")  # dynamo alone (no inductor): the counters and the in-place call are what is read
    assert is_compiled(layer), "nn.Module.compile no longer sets _compiled_call_impl: compiling.is_compiled reads it"
    layer(torch.randn(3, 2))
    after = compile_counts()
    assert after["frames"] > before["frames"] and after["compiled"] > before["compiled"], \
        "torch._dynamo.utils.counters changed: compiling.compile_counts reads frames/total, frames/ok, stats/unique_graphs"
    assert after["graphs"] > before["graphs"] and "frames" in counters
    assert [n for n, _ in layer.named_parameters()] == ["weight", "bias"]  # compiled in place: names unchanged
