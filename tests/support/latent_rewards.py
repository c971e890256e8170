"""A small latent reward for the tests: scored on the sampler's final latents, no VAE decode."""

import torch

from jagg_lightning.rewards import Reward


class LatentEnergy(Reward):
    """R(z) = -mean(z^2) over each sample's final latents (float64), recording what it was handed."""

    name = "latent_energy"
    scores_latents = True

    def __init__(self):
        super().__init__()
        self.seen: list[torch.Tensor] = []
        self.freeze()

    def score(self, latents, prompts):
        self.seen.append(latents.detach().clone())
        return -(latents.double() ** 2).flatten(1).mean(1)
