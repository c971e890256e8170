"""What a newcomer reads off a run's outputs (issue 39): `jagg predict`'s file names carry their prompt, a grid's
two counts say what each is over, the digits config's validate grid pictures the ten digits, and a `jagg_frac` the
rounding turns into every or no window says so (the line agrees with what `route_windows` routes)."""

import random
import re
from pathlib import Path

import lightning as L
import pytest

from jagg_lightning.callbacks import DigitAccuracy, SampleImages
from jagg_lightning.callbacks.predictions import SLUG_CHARS, file_stem, slug
from jagg_lightning.method.jagg import Window
from jagg_lightning.method.routing import rounding_note, route_windows

ROOT = Path(__file__).resolve().parents[2]
WORDS = ["a", "handwritten", "digit", "cat", "lighthouse", "at", "night", "crème", "brûlée", "—", "7", "猫", "!!",
         "photo,", "of", "an", "astronaut", "riding", "horse", "on", "the", "moon"]


def test_prediction_file_names_carry_the_prompt_bounded_and_unique(rng_seed):
    gen = random.Random(rng_seed)
    prompts = [" ".join(gen.choice(WORDS) for _ in range(gen.randrange(1, 30))) for _ in range(40)]
    prompts += [prompts[0], "猫"]  # a repeated prompt; one with no ASCII letter
    stems = [file_stem(i, s, p) for i, p in enumerate(prompts) for s in range(2)]
    assert len(set(stems)) == len(stems)  # unique by (prompt index, sample), repeated prompts included
    for i, prompt in enumerate(prompts):
        words = slug(prompt)
        assert len(words) <= SLUG_CHARS and re.fullmatch(r"([a-z0-9]+(-[a-z0-9]+)*)?", words), words
        assert file_stem(i, 1, prompt) == f"p{i:05d}_s01" + (f"_{words}" if words else "")
        ascii_words = re.findall(r"[a-z0-9]+", prompt.lower().replace("è", "e").replace("û", "u").replace("é", "e"))
        if len("-".join(ascii_words)) <= SLUG_CHARS:  # short enough: every word of the prompt, in order
            assert words == "-".join(ascii_words)
        else:  # cut at a word's end: the slug is a prefix of the words, whole words only
            assert "-".join(ascii_words).startswith(words + "-") and len(words) >= SLUG_CHARS // 2
    assert file_stem(7, 0, "a handwritten digit 7") == "p00007_s00_a-handwritten-digit-7"
    assert file_stem(3, 2, "猫") == "p00003_s02"


def test_grid_header_says_what_each_count_is_over(rng_seed):
    """The half's count is of the pictured samples; the held-out accuracy beside it names its own sample count."""
    gen = random.Random(rng_seed)
    per, rows = gen.randrange(1, 5), gen.randrange(1, 11)
    correct = [[gen.random() < 0.5 for _ in range(2 * per)] for _ in range(rows)]
    accuracy = DigitAccuracy(samples_per_prompt=8)
    accuracy.base_result = {"accuracy": gen.random(), "samples": 240}
    accuracy.history, accuracy.results = [(0, gen.random(), 0.0)], [{"samples": 240}]
    samples = SampleImages(prompts=[f"a handwritten digit {d}" for d in range(rows)], samples_per_prompt=per)
    trainer = L.Trainer(callbacks=[accuracy, samples], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    from jagg_lightning.training.grids import GridMarks

    labels = samples.column_labels(trainer, GridMarks(correct))
    for half, (label, name) in enumerate(zip(labels, ["base", "fine-tuned"])):
        count, held_out = label.split("\n")
        right = sum(row[c] for row in correct for c in range(half * per, (half + 1) * per))
        assert count.endswith(f": {right} of these {rows * per} right")  # the pictured samples
        score = accuracy.base_result["accuracy"] if half == 0 else accuracy.history[-1][1]
        assert held_out == f"held-out accuracy {score:.3f} (240 held-out samples)"  # its own samples, counted


def test_the_digits_validate_grid_pictures_the_ten_digits():
    from jagg_lightning.cli.lightning_cli import parse_config
    from jagg_lightning.data import read_prompts
    from jagg_lightning.rewards.digits import prompt_digit

    config = parse_config(["--config", str(ROOT / "configs" / "digits.yaml")])
    shown = read_prompts(config.data.val_prompts_file, "data.val_prompts_file", "test")[:config.model.evaluation.grid_prompts]
    assert sorted({prompt_digit(p) for p in shown}) == list(range(10)), shown


@pytest.mark.parametrize("segments", [1, 2])
def test_jagg_frac_rounding_to_every_or_no_window_is_said_as_routed(segments, rng_seed):
    gen = random.Random(rng_seed + segments)
    for _ in range(200):
        size, frac = gen.randrange(2, 5), gen.choice([0.0, 1.0, gen.random(), 0.5, 0.25, 0.75])
        windows, start = [], 0
        for seg in range(segments):
            for _ in range(gen.randrange(0 if segments > 1 else 1, 4)):
                windows.append(Window(tuple(range(start, start + size)), segment=seg))
                start += size
            if gen.random() < 0.5:  # a short tail window: never routed
                windows.append(Window((start,), segment=seg))
                start += 1
        if not windows:
            continue
        route_windows(windows, [gen.random() for _ in windows], frac, size)
        routed, full = sum(w.routed for w in windows), sum(len(w.steps) == size for w in windows)
        note = rounding_note(frac, windows, size)
        if 0 < frac < 1 and routed in (0, full):
            assert note is not None and note.startswith(f"jagg: model.jagg.jagg_frac {frac:g} routes "), note
            assert ("every" if routed == full and full else "no") in note and f"{full} per rollout" in note
        else:
            assert note is None, (frac, routed, full, note)
