"""The scenes test bed: compositional scenes, GenEval in miniature.

Pillow-rendered scenes of 1-4 flat shapes (``SHAPES``: circle, square, triangle, diamond) in six of GenEval's
colours (``PALETTE``) on a grey, lightly textured background (:mod:`.render`: a :class:`Scene` spec, drawn
deterministically from a seed; :func:`scene_for` builds one that satisfies a GenEval metadata row), captioned in
GenEval's six task families with GenEval's own phrasing (:mod:`.captions`), with a train / held-out split of
compositions written as GenEval metadata JSONL (``TRAIN_METADATA``, ``HELDOUT_METADATA``).

:class:`jagg_lightning.rewards.GenEvalReward` with its ``scenes`` reader scores them (GenEval's rules over an
exact reader of these renders). The scenes model ships as ``PIPELINE_DIR`` (a ``StableDiffusion3Pipeline`` folder,
the shipped name ``scenes``; its recipe's record ``INFO_PATH``), made by :mod:`.train` (``python -m
jagg_lightning.testbed.scenes.train --out DIR``; its parts in :mod:`.model`); docs/testbed.md, "Scenes".
"""

from jagg_lightning.rewards.geneval_scenes import PALETTE, SHAPES
from jagg_lightning.testbed.scenes.captions import (HELDOUT_METADATA, TRAIN_METADATA, all_metadata, is_heldout,
                                                     split_metadata)
from jagg_lightning.testbed.scenes.render import Scene, SceneObject, place, render, scene_for
from jagg_lightning.utils.assets import SHIPPED

PIPELINE_DIR = SHIPPED["scenes"]
INFO_PATH = PIPELINE_DIR / "training_info.json"

__all__ = ["HELDOUT_METADATA", "INFO_PATH", "PALETTE", "PIPELINE_DIR", "SHAPES", "Scene", "SceneObject",
           "TRAIN_METADATA", "all_metadata", "is_heldout", "place", "render", "scene_for", "split_metadata"]
