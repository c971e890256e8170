"""The context-parallel split check fires before diffusers' sharder asserts, in one process: torch's single-process
``fake`` process group stands in for the peers (two ranks; its collectives move no data), the networks are diffusers'
own with their real ``_cp_plan`` applied by :meth:`ContextParallel.apply`. What only a real second rank shows (the
update equals one process's) is ``test_context_parallel.py``'s.

Wan's plan splits its rotary embedding's OUTPUT before the first block: a video whose tokens do not divide by the
context size (48 x 48 px x 9 frames: 3 x 3 x 3 = 27 tokens over 2 ranks) used to end in diffusers' bare
``AssertionError`` there; it is one :class:`ContextParallelError` naming the policy field. FLUX's text tokens
(split at the transformer's input) name ``policy.max_sequence_length``.
"""

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from jagg_lightning.distributed.context_parallel import ContextParallelError, build

SIZE = 2


@pytest.fixture
def two_fake_ranks():
    dist.init_process_group("fake", rank=0, world_size=SIZE, store=FakeStore())
    try:
        yield build(SIZE, "ulysses", torch.device("cpu"))
    finally:
        dist.destroy_process_group()


def tiny_wan():
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4,
                                 out_channels=4, text_dim=16, freq_dim=32, ffn_dim=32, num_layers=1, rope_max_seq_len=32)


def test_wan_tokens_that_do_not_divide_are_refused_naming_the_field_before_diffusers_asserts(two_fake_ranks, rng_seed):
    torch.manual_seed(rng_seed)
    network = tiny_wan()
    two_fake_ranks.apply([network], "wan")
    text = torch.randn(1, 5, 16)
    # latent frames x height x width after the (1, 2, 2) patches: 3 x 3 x 3 = 27 tokens (48 px, 9 frames)
    with pytest.raises(ContextParallelError) as info:
        network(torch.randn(1, 4, 3, 6, 6), torch.tensor([500.0]), text, return_dict=False)
    message = str(info.value)
    assert message.startswith("policy.resolution / policy.num_frames: ") and "27 tokens" in message, message
    assert "context_parallel_size 2" in message and "\n" not in message
    # 3 x 2 x 4 = 24 tokens divide: the check lets the forward through (the gathered output has the input's shape)
    latent = torch.randn(1, 4, 3, 4, 8)
    out = network(latent, torch.tensor([500.0]), text, return_dict=False)[0]
    assert out.shape == latent.shape


def test_flux_text_tokens_that_do_not_divide_name_max_sequence_length(two_fake_ranks, rng_seed):
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(rng_seed)
    network = FluxTransformer2DModel(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1,
                                     attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16,
                                     pooled_projection_dim=8, axes_dims_rope=(2, 2, 4))
    two_fake_ranks.apply([network], "flux")
    text_tokens = 3
    with pytest.raises(ContextParallelError, match=r"^policy\.max_sequence_length: .* 3 tokens"):
        network(hidden_states=torch.randn(1, 4, 4), encoder_hidden_states=torch.randn(1, text_tokens, 16),
                pooled_projections=torch.randn(1, 8), timestep=torch.tensor([0.5]),
                img_ids=torch.zeros(4, 3), txt_ids=torch.zeros(text_tokens, 3), return_dict=False)


def test_ltx2s_diffusers_plan_is_refused_naming_the_size(two_fake_ranks):
    """LTX-2's ``_cp_plan`` splits the rotary embedding's dim 1 -- the heads of its split RoPE -- and leaves the audio
    stream whole (on two real ranks the first block fails with a shape error): refused in one line before anything
    is split, for both LTX-2 families (one transformer class)."""
    from jagg_lightning.policies.ltx2 import build_tiny_ltx2_pipeline

    network = build_tiny_ltx2_pipeline(0).transformer
    for family in ("ltx2", "ltx2_i2v"):
        with pytest.raises(ContextParallelError) as info:
            two_fake_ranks.apply([network], family)
        message = str(info.value)
        assert message.startswith(f"trainer.strategy.context_parallel_size {SIZE}: the {family!r} family's "
                                  "LTX2VideoTransformer3DModel has a _cp_plan") and "\n" not in message
        assert "context_parallel_size 1" in message
    assert not getattr(network, "_parallel_config", None)  # nothing was applied
