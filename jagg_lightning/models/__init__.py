"""What the training does to a family's networks, for every family alike: the LoRA and its on-disk layouts
(``adapters.py``), full fine-tuning (``full_finetune.py``), the frozen KL reference copy (``reference.py``), the
consolidated export (``export.py``), regional compilation (``compiling.py``) and conditioned prompts -- the
condition images of editing and image-to-video (``conditions.py``). A family itself (its tensors, its pipeline)
lives in ``policies/``, which builds on these. It may import only ``utils/`` and ``faults/`` (crash-safe
writes); plain torch, peft and diffusers, no Lightning.
"""
