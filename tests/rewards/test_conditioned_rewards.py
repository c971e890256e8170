"""Rewards that read the condition image (edit fidelity, first-frame consistency) on a tiny CLIP saved locally."""

import pytest
import torch
from transformers import CLIPModel, CLIPProcessor

from jagg_lightning.models.conditions import ConditionedPrompt
from jagg_lightning.rewards import EditFidelity, FirstFrameConsistency, JpegCompressibility, WeightedReward
from jagg_lightning.rewards.registry import build_reward


def prompts_with(sources):
    return [ConditionedPrompt(f"edit {i}", [s]) for i, s in enumerate(sources)]


def test_edit_fidelity_is_the_clip_cosine_to_the_source(clip_dir, rng_seed):
    """The score is cos(E(result), E(source)) computed by hand with the checkpoint's own CLIP: 1 for the source
    itself, lower for another picture; each result is compared with its own prompt's source."""
    gen = torch.Generator().manual_seed(rng_seed)
    sources, others = torch.rand(3, 3, 32, 32, generator=gen), torch.rand(3, 3, 32, 32, generator=gen)
    reward = EditFidelity(str(clip_dir))
    prompts = prompts_with(sources)
    same, other = reward(sources, prompts), reward(others, prompts)
    torch.testing.assert_close(same, torch.ones(3), atol=1e-5, rtol=0)
    assert (other < same - 1e-4).all()

    model, processor = CLIPModel.from_pretrained(clip_dir).eval(), CLIPProcessor.from_pretrained(clip_dir)
    with torch.no_grad():
        def embed(images):
            pixels = processor(images=[(i.permute(1, 2, 0) * 255).round().byte().numpy() for i in images],
                               return_tensors="pt")["pixel_values"]
            out = model.get_image_features(pixel_values=pixels)
            out = out if isinstance(out, torch.Tensor) else out.pooler_output
            return out / out.norm(dim=-1, keepdim=True)
        expected = (embed(others) * embed(sources)).sum(-1)
    torch.testing.assert_close(other, expected, atol=1e-5, rtol=0)
    # the same results against the prompts in another order: each is scored against its own prompt's source
    order = torch.randperm(3, generator=gen)
    torch.testing.assert_close(reward(others[order], [prompts[i] for i in order]), other[order], atol=1e-6, rtol=0)


def test_sources_are_fitted_to_the_result_and_read_from_files(clip_dir, tmp_path, rng_seed):
    """A source of another size (read from a PNG, as a JSONL data file names it) is centre-cropped and resized to
    the result's size before comparing: the result that is that fitted source scores 1."""
    from PIL import Image

    gen = torch.Generator().manual_seed(rng_seed)
    pixels = (torch.rand(40, 56, 3, generator=gen) * 255).round().byte().numpy()
    Image.fromarray(pixels).save(tmp_path / "source.png")
    prompt = ConditionedPrompt("keep it", [str(tmp_path / "source.png")])
    from jagg_lightning.models.conditions import condition_pixels

    fitted = condition_pixels([prompt], 32, 32)
    reward = EditFidelity(str(clip_dir))
    torch.testing.assert_close(reward(fitted, [prompt]), torch.ones(1), atol=1e-5, rtol=0)


def test_first_frame_consistency_reads_the_first_frame(clip_dir, rng_seed):
    gen = torch.Generator().manual_seed(rng_seed)
    sources = torch.rand(2, 3, 32, 32, generator=gen)
    video = torch.rand(2, 4, 3, 32, 32, generator=gen)
    reward, fidelity = FirstFrameConsistency(str(clip_dir)), EditFidelity(str(clip_dir))
    prompts = prompts_with(sources)
    torch.testing.assert_close(reward(video, prompts), fidelity(video[:, 0], prompts))
    video[:, 0] = sources  # the clip starts on its source: 1, whatever the later frames
    torch.testing.assert_close(reward(video, prompts), torch.ones(2), atol=1e-5, rtol=0)


def test_a_weighted_mix_with_text_rewards_and_plain_prompts_refused(clip_dir, rng_seed):
    """Usable in WeightedReward beside a reward that ignores the condition; rebuilt from its description (a config);
    a prompt without a source image is an error naming the prompt."""
    gen = torch.Generator().manual_seed(rng_seed)
    images, sources = torch.rand(2, 3, 32, 32, generator=gen), torch.rand(2, 3, 32, 32, generator=gen)
    fidelity, jpeg = EditFidelity(str(clip_dir)), JpegCompressibility()
    mixed = WeightedReward([fidelity, jpeg], [2.0, 0.5])
    prompts = prompts_with(sources)
    total, parts = mixed.score_with_components(images, prompts)
    torch.testing.assert_close(total, 2.0 * fidelity(images, prompts) + 0.5 * jpeg(images, prompts))
    assert set(parts) == {"edit_fidelity", "jpeg_compressibility"}
    rebuilt = build_reward(mixed.describe())
    torch.testing.assert_close(rebuilt(images, prompts), total)
    with pytest.raises(Exception, match="'a cat' carries no condition image"):
        fidelity(images, ["a cat", "a dog"])
