"""Context parallelism through diffusers' engine, through the CLI on CPU processes (gloo, Ulysses): ``jagg fit`` with
``trainer.strategy.context_parallel_size 2`` is the one-process run, float64, on the Wan2.1 and FLUX.1 twins, JAGG
routed (KL on, global std) and fused, under DDP and FSDP2 -- the same LoRA update after two optimizer steps, the same
logged metrics and evaluation, the context ranks identical -- on Wan2.2 TI2V (image-to-video: the first frame's latent
and its zero timesteps split with the video tokens) and FLUX.1 Kontext (editing: the source's tokens split with the
latent's) -- and data 2 x context 2 on 4 processes is one process on twice the prompts. A family without a ``_cp_plan`` (SD3) and ring attention on diffusers' native SDPA are refused
with one line each.

One launch per process count runs every case (``cli_main`` again and again in the same ranks, as ``jagg fit``
would run it); the one-process references run in the test's own process through the same CLI.
"""

import json
import textwrap

import pytest
import torch
import yaml
from safetensors.torch import load_file

from jagg_lightning.cli import cli_main
from jagg_lightning.cli.quiet import unexpected_lines

from launch import TESTS, run_ranks
from helpers import rel_error

pytestmark = [pytest.mark.distributed, pytest.mark.subprocess, pytest.mark.slow]

ROOT = TESTS.parent
DDP, FSDP2 = "jagg_lightning.strategies.DDPStrategy", "jagg_lightning.strategies.FSDP2Strategy"
FLOAT64_REWARD = {"class_path": "helpers.MeanIntensity"}  # continuous: JPEG sizes of tiny samples tie
FAMILIES = {  # preset, the policy and the reward at twin scale in float64
    "wan": ("wan_tiny.yaml", {"dtype": "float64", "resolution": 32, "num_frames": 9},  # 3 x 2 x 2 = 12 tokens
            {"class_path": "jagg_lightning.rewards.FrameReward", "init_args": {"reward": FLOAT64_REWARD, "frames": 3}}),
    "flux": ("flux_tiny.yaml", {"dtype": "float64"}, FLOAT64_REWARD),  # 4 image + 8 text tokens
    "flux2": ("flux2_tiny.yaml", {"dtype": "float64"}, FLOAT64_REWARD),
    # image-to-video on the shipped edits: the first latent frame is the image's; 64 px: 3 x 2 x 2 = 12 tokens, the
    # per-token timesteps (0 on the image's frame) split with them
    "wan22_ti2v": ("wan22_ti2v_tiny.yaml", {"dtype": "float64", "resolution": 64, "num_frames": 9},
                   {"class_path": "jagg_lightning.rewards.FrameReward", "init_args": {"reward": FLOAT64_REWARD, "frames": 3}}),
    # image editing: the source's tokens after the latent's (8 + 8 image tokens), split together with their ids
    "flux_kontext": ("flux_kontext_tiny.yaml", {"dtype": "float64"}, FLOAT64_REWARD),
}
CONDITIONED = {"wan22_ti2v", "flux_kontext"}  # trained on configs/prompts/edits (prompt + source), the rest on PROMPTS
# name -> (family, strategy, model overrides, with evaluation)
CASES_2 = {
    "wan-routed-fsdp2": ("wan", FSDP2, {"jagg": {"jagg_frac": 0.5}}, True),
    "wan-fused-ddp": ("wan", DDP, {"jagg": {"jagg_frac": 1.0, "fused_rollout": True}, "grpo": {"adv_std": "group"}}, False),
    "flux-routed-ddp": ("flux", DDP, {"jagg": {"jagg_frac": 0.5}}, False),
    "flux-fused-ddp": ("flux", DDP, {"jagg": {"jagg_frac": 1.0, "fused_rollout": True}, "grpo": {"adv_std": "group"}}, False),
    "flux2-routed-ddp": ("flux2", DDP, {"jagg": {"jagg_frac": 0.5}}, False),  # our plan: [seq, 4] position ids
    "ti2v-routed-ddp": ("wan22_ti2v", DDP, {"jagg": {"jagg_frac": 0.5}}, False),
    "kontext-routed-ddp": ("flux_kontext", DDP, {"jagg": {"jagg_frac": 0.5}}, False),
}
CASES_4 = {
    "wan-routed-ddp": ("wan", DDP, {"jagg": {"jagg_frac": 0.5}}, False),
    "flux-routed-fsdp2": ("flux", FSDP2, {"jagg": {"jagg_frac": 0.5}}, False),
}
PROMPTS = ["a red cat", "a blue dog"]
STEPS = 2
REFUSED = {  # name -> (arguments, the line expected)
    "sd3": (["fit", "--config", "configs/tiny.yaml", "--trainer.strategy", DDP],
            "the 'sd3' family's SD3Transformer2DModel has no context-parallel plan"),
    "ring-native": (["fit", "--config", "configs/wan_tiny.yaml", "--trainer.strategy", DDP,
                     "--trainer.strategy.context_parallel_kind", "ring"], "context_parallel_kind ring needs an attention"),
}


def case_config(out, name, family, overrides, evaluation, prompts_per_rank, seed):
    """The second ``--config`` of a case: the float64 twin, SGD, the run record, ``prompts_per_rank`` prompts per
    data rank and step."""
    _, policy, reward = FAMILIES[family]
    model = {"policy": policy, "reward": reward, "seed": seed,
             "sampling": {"num_steps": 4, "group_size": 2, "rollout_batch_size": 2},
             "grpo": {"train_batch_size": 2, "kl_beta": 0.5, "adv_std": "global", "clip_range": 1e-4}
             | overrides.get("grpo", {}),
             "jagg": {"window_size": 2} | overrides["jagg"],
             "optimizer": {"class_path": "torch.optim.SGD", "init_args": {"lr": 0.5, "momentum": 0.9}},
             "evaluation": {"num_steps": 3, "grid_prompts": 0}}
    data = ({"prompts": None, "prompts_file": "configs/prompts/edits"} if family in CONDITIONED else
            {"prompts": PROMPTS, "prompts_file": None}) | {"batch_size": prompts_per_rank, "shuffle": False}
    if evaluation:
        data |= {"val_prompts": PROMPTS, "eval_batch_size": 2}
    trainer = {"max_steps": STEPS, "logger": False, "enable_progress_bar": False, "enable_model_summary": False,
               "num_sanity_val_steps": 0, "default_root_dir": f"{out}/{name}",
               "callbacks": [{"class_path": "run_record.RunRecord", "init_args": {"dirpath": f"{out}/{name}"}}]}
    return {"trainer": trainer, "model": model, "data": data, "lora_export": {"dirpath": f"{out}/{name}/lora"}}


def fit_arguments(out, name, case, prompts_per_rank, seed, strategy=True):
    family, strategy_path, overrides, evaluation = case
    path = out / f"{name}-{prompts_per_rank}.yaml"
    path.write_text(yaml.safe_dump(case_config(out, name, family, overrides, evaluation, prompts_per_rank, seed)))
    args = ["fit", "--config", f"configs/{FAMILIES[family][0]}", "--config", str(path)]
    if strategy:
        args += ["--trainer.strategy", strategy_path, "--trainer.devices", "WORLD",
                 "--trainer.strategy.process_group_backend", "gloo", "--trainer.strategy.context_parallel_size", "2"]
    return args


RANK_SCRIPT = textwrap.dedent('''
    import contextlib, io, json, sys
    from jagg_lightning.cli import cli_main, prepare

    prepare()  # what the `jagg` command sets first: its stderr is the command's (quiet.py)

    cases, world, report = json.loads(open(sys.argv[1]).read()), sys.argv[2], sys.argv[3]
    sys.argv = sys.argv[:1]  # cli_main reads its arguments from the list
    for args in cases["fits"]:
        cli_main([world if a == "WORLD" else a for a in args])
    refused = {}
    for name, args in cases["refused"].items():
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                cli_main(args + ["--trainer.devices", world, "--trainer.strategy.process_group_backend", "gloo",
                                 "--trainer.strategy.context_parallel_size", "2", "--trainer.logger", "false",
                                 "--trainer.max_steps", "1"])
        except SystemExit as exit:  # the CLI's one line, status 2
            refused[name] = [exit.code, err.getvalue().strip().splitlines()[-1]]
    with open(report, "w") as f:
        json.dump(refused, f)
    from jagg_lightning.distributed.collectives import end_process_group
    end_process_group()  # every rank finished: leave together (collectives.end_process_group)
''')


def launch(tmp_path, cases, world, prompts_per_rank, seed, refused=None):
    fits = [fit_arguments(tmp_path, name, case, prompts_per_rank, seed) for name, case in cases.items()]
    (tmp_path / "cases.json").write_text(json.dumps({"fits": fits, "refused": refused or {}}))
    script = tmp_path / "ranks.py"
    script.write_text(RANK_SCRIPT)
    stderr: list[str] = []
    run_ranks(script, str(tmp_path / "cases.json"), str(world), str(tmp_path / "refused.json"), world=world,
              timeout=400, cwd=ROOT, stderr=stderr)
    # what the `jagg` command prints under context parallelism: no warning outside quiet.ALLOWED_STDERR (diffusers'
    # and torch's notices are filtered with their reasons in quiet.py; docs/configuration.md)
    # diffusers' own line when a prompt is cut (the twins' 8-token max_sequence_length, a 16-token CLIP) is one a
    # user can act on: kept, and allowed here
    unexpected = [f"rank {rank}: {line}" for rank, text in enumerate(stderr) for line in unexpected_lines(text)
                  if not line.startswith("The following part of your input was truncated because")]
    if unexpected:
        pytest.fail("\n".join(unexpected), pytrace=False)
    return json.loads((tmp_path / "refused.json").read_text())


def one_process(tmp_path, name, case, prompts, seed):
    """The same case through the same CLI, on one process with ``prompts`` prompts per step."""
    cli_main(fit_arguments(tmp_path, f"{name}-single", case, prompts, seed, strategy=False))
    return tmp_path / f"{name}-single"


def compare(tmp_path, name, case, world, prompts_single, seed):
    """Relative error of the LoRA update (every rank against one process) and the logged metrics' agreement."""
    single = one_process(tmp_path, name, case, prompts_single, seed)
    start, end = load_file(single / "rank0_start.safetensors"), load_file(single / "rank0_end.safetensors")
    names = sorted(start)
    update = [end[n] - start[n] for n in names]
    assert sum(float(u.abs().sum()) for u in update) > 0, name
    errors = []
    for rank in range(world):
        mine = tmp_path / name
        assert sorted(load_file(mine / f"rank{rank}_start.safetensors")) == names
        assert all(torch.equal(load_file(mine / f"rank{rank}_start.safetensors")[n], start[n]) for n in names)
        trained = load_file(mine / f"rank{rank}_end.safetensors")
        errors.append(rel_error([trained[n] - start[n] for n in names], update))
    reference = json.loads((single / "rank0.json").read_text())
    records = [json.loads((tmp_path / name / f"rank{r}.json").read_text()) for r in range(world)]
    for rank, record in enumerate(records):
        assert record["world"] == world
        assert 2 * record["tokens"] == reference["tokens"] > 0, (name, rank)  # each context rank: half the sequence
        # a context rank logs what its data rank's one process would: with one data rank, the one process's
        if world == 2:
            assert len(record["steps"]) == STEPS
            for mine, theirs in zip(record["steps"], reference["steps"]):
                assert mine["prompts"] == theirs["prompts"]
                for key in set(theirs) - {"prompts", "train/passes/grad_all_reduce"}:
                    assert mine[key] == pytest.approx(theirs[key], rel=1e-6, abs=1e-9), (name, rank, key)
                # DDP: one gradient all-reduce per update (FSDP2 reduce-scatters in its backward hooks)
                assert mine["train/passes/grad_all_reduce"] == (case[1] == DDP)
            assert len(record["validations"]) == len(reference["validations"])
            for mine, theirs in zip(record["validations"], reference["validations"]):
                assert mine == pytest.approx(theirs, rel=1e-6), (name, rank)
        else:  # the context peers of a data rank log alike, the data ranks their own prompts
            peer = records[rank - rank % 2]
            assert record["steps"] == peer["steps"], (name, rank)
            assert record["steps"][0]["prompts"] == [rank // 2]
    return max(errors)


def test_context_parallel_2_processes_equal_one_process(tmp_path, rng_seed):
    seed = rng_seed % 10_000
    refused = launch(tmp_path, CASES_2, 2, 2, seed, REFUSED)
    worst = {name: compare(tmp_path, name, case, 2, 2, seed) for name, case in CASES_2.items()}
    print("relative update error, context 2 vs one process:", worst)
    # float64 up to the float32 timestep embedding (docs/distributed.md); measured ~1e-15
    assert max(worst.values()) < 1e-6, worst
    wan = json.loads((tmp_path / "wan-routed-fsdp2" / "rank0.json").read_text())
    assert len(wan["validations"]) == STEPS and "val/reward_mean" in wan["validations"][0]
    assert sorted(refused) == sorted(REFUSED), refused
    for name, (_, line) in REFUSED.items():
        status, said = refused[name]
        assert status == 2 and said.startswith("jagg: error: ") and line in said, refused[name]


def test_data_2_by_context_2_equals_one_process_on_twice_the_prompts(tmp_path, rng_seed):
    seed = rng_seed % 10_000
    launch(tmp_path, CASES_4, 4, 1, seed)
    worst = {name: compare(tmp_path, name, case, 4, 2, seed) for name, case in CASES_4.items()}
    print("relative update error, data 2 x context 2 vs one process:", worst)
    assert max(worst.values()) < 1e-6, worst
