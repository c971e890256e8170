"""``model.evaluation``: how ``validate``, ``test`` and ``predict`` sample (`EvalConfig`)."""

from __future__ import annotations

from dataclasses import dataclass

from jagg_lightning.utils.checks import check, check_ints


@dataclass
class EvalConfig:
    """Evaluation sampling: validate, test, predict and validation during fit.

    Sampling is a deterministic ODE (Euler) with the inference (EMA) weights; the noise of sample s of prompt i
    depends on (`seed`, i, s) only, so every evaluation sees the same noise and successive evaluations compare like
    with like.

    Attributes:
        num_steps: ODE (Euler) steps, an integer >= 1 (more than the rollouts, as Flow-GRPO evaluates).
        guidance_scale: Classifier-free guidance at evaluation, >= 1 (1.0 = off); null = `policy.guidance_scale`.
        samples_per_prompt: Images per prompt, an integer >= 1.
        seed: The evaluation noise's seed; null = the module's root seed (`model.seed`); a number fixes the
            evaluation noise apart from it.
        grid_prompts: The first prompts that form the logged sample grid, an integer >= 0 (0 = no grid).
    """

    num_steps: int = 20
    guidance_scale: float | None = None
    samples_per_prompt: int = 1
    seed: int | None = None
    grid_prompts: int = 8

    def __post_init__(self):
        check_ints(self, "evaluation", "num_steps", "samples_per_prompt", "seed", "grid_prompts")
        check(self.num_steps >= 1, "evaluation.num_steps", ">= 1", self.num_steps)
        check(self.guidance_scale is None or self.guidance_scale >= 1.0, "evaluation.guidance_scale",
              ">= 1.0 (1.0 = off) or null (the policy's)", self.guidance_scale)
        check(self.samples_per_prompt >= 1, "evaluation.samples_per_prompt", ">= 1", self.samples_per_prompt)
        check(self.grid_prompts >= 0, "evaluation.grid_prompts", ">= 0 (0 = no grid)", self.grid_prompts)
