"""The supervised warm start on the `visual` task: demonstrations keep their images (spans on the
`<|image_pad|>` placeholders, patches of the model's patch size), `sft.warm_start` packs them with the
model's patch_dim and trains on them (alone and mixed with a text task), and a model that cannot see
the images gets a ConfigError naming the problem before any step."""

import dataclasses
import math

import numpy as np
import pytest

from tiderl_jax.agents import tasks as T
from tiderl_jax.agents import visual
from tiderl_jax.model.config import ConfigError, ModelConfig
from tiderl_jax.model.decoder import init_decoder
from tiderl_jax.model.tokenizer import IMAGE_TOKEN, Tokenizer
from tiderl_jax.model.vision import check_images, patchify
from tiderl_jax.rl import sft
from tiderl_jax.rl.trainer import Trainer
from tiderl_jax.rl.trainer_config import TrainerConfig

TOK = Tokenizer.builtin()
IMG = TOK.token_id(IMAGE_TOKEN)
PATCH = 4
CFG = ModelConfig(arch="qwen3", vocab_size=384, hidden_size=32, intermediate_size=64, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True, max_position_embeddings=1024,
                  image_patch_dim=PATCH * PATCH * 3, max_image_patches=16, image_token_id=IMG)
TEXT_CFG = dataclasses.replace(CFG, image_patch_dim=0, max_image_patches=0, image_token_id=None)
TRAIN = TrainerConfig(learning_rate=1e-2, warmup_steps=0, total_steps=100, row_len=512, micro_rows=4)


def _recording(trainer):
    """The packed batches `trainer.sft_step` is given, in order."""
    seen, step = [], trainer.sft_step

    def sft_step(packed):
        seen.append(packed)
        return step(packed)
    trainer.sft_step = sft_step
    return seen


def test_demonstration_images_sit_on_the_image_placeholders():
    for i in range(6):
        task = T.make_task("visual", i)
        t = sft.demonstration_trajectory(task, TOK, group=i, patch_size=PATCH)
        assert t.group == i and len(t.tokens) == len(t.loss_mask) == len(t.logprobs) == len(t.versions)
        assert [im.patches.shape for im in t.images] == [(4, 48), (16, 48)]  # overview, then the zoom
        covered = set()
        for im in t.images:
            assert all(t.tokens[p] == IMG for p in range(im.offset, im.end))
            assert not any(t.loss_mask[im.offset:im.end])  # images are never model tokens
            covered |= set(range(im.offset, im.end))
        assert covered == {p for p, tok in enumerate(t.tokens) if tok == IMG}  # every placeholder is an image's
        grid = task.data["grid"]
        np.testing.assert_array_equal(t.images[0].patches, patchify(visual.overview_image(grid), PATCH))
        np.testing.assert_array_equal(t.images[1].patches,
                                      patchify(visual.zoom_image(grid, task.data["quadrant"]), PATCH))
        check_images(t.tokens, t.images, CFG)  # exactly what the model takes
        assert any(t.loss_mask[t.images[0].end:t.images[1].offset])  # the zoom call is trained
        assert any(t.loss_mask[t.images[1].end:])  # and the answer after the zoom
    eight = sft.demonstration_trajectory(T.make_task("visual", 0), TOK, patch_size=8)  # the model's size
    assert [im.patches.shape for im in eight.images] == [(1, 192), (4, 192)]
    calc = sft.demonstration_trajectory(T.make_task("calculator", 0), TOK, patch_size=PATCH)
    assert not calc.images and calc.tokens == sft.demonstration_trajectory(T.make_task("calculator", 0), TOK).tokens


def test_a_model_that_cannot_see_the_images_gets_a_named_config_error():
    with pytest.raises(ConfigError, match="the visual task needs a vision model: set model.image_patch_dim"):
        sft.demonstration_trajectory(T.make_task("visual", 0), TOK)  # patch size 0: a text-only model
    with pytest.raises(ConfigError, match="needs a vision model.*got patch size 3"):
        sft.demonstration_trajectory(T.make_task("visual", 0), TOK, patch_size=3)
    with pytest.raises(ConfigError, match="image_patch_dim=64 is not one of those"):
        T.image_patch_size(["visual"], 64)
    assert T.image_patch_size(["calculator", "lookup"], 0) == 0 and T.image_patch_size(["visual"], 12) == 2

    text = Trainer(init_decoder(TEXT_CFG, seed=0), TRAIN)
    seen = _recording(text)
    for kinds in (["visual"], ["calculator", "visual"]):
        with pytest.raises(ConfigError, match="the visual task needs a vision model: set "
                                              "model.image_patch_dim.*text-only \\(image_patch_dim=0\\)"):
            sft.warm_start(text, TOK, kinds, 2, 2)
    few = Trainer(init_decoder(dataclasses.replace(CFG, max_image_patches=4), seed=0), TRAIN)
    seen_few = _recording(few)
    with pytest.raises(ConfigError, match="'visual' demonstrations do not fit the model.*16 patches; "
                                          "the model takes 1..4"):
        sft.warm_start(few, TOK, ["visual"], 2, 2)
    assert seen == [] and seen_few == [] and text.step_count == few.step_count == 0  # before any step


def test_warm_start_on_visual_demonstrations_learns_a_fixed_set():
    trainer = Trainer(init_decoder(CFG, seed=0), dataclasses.replace(TRAIN, micro_rows=2))
    seen = _recording(trainer)
    curve = []
    for _ in range(12):  # the same 2 tasks every step (first_task=0)
        curve += sft.warm_start(trainer, TOK, ["visual"], 1, 2, first_task=0)
    for packed in seen:
        a = packed.arrays
        assert not packed.dropped and packed.num_sequences == 2
        assert a["patches"].shape == a["tokens"].shape + (48,)
        assert (a["patch_index"] >= 0).sum() == 2 * (4 + 16)  # every image of the 2 demonstrations
        assert np.array_equal(a["patch_index"] >= 0, a["tokens"] == IMG)  # on the placeholders
        assert not (a["mask"][a["patch_index"] >= 0]).any()
    assert all(math.isfinite(x) and x > 0 for x in curve)
    # the model reads the patches: blanking them changes the trained tokens' log-probs after an image
    blank = dataclasses.replace(seen[0], arrays=dict(seen[0].arrays, patches=0 * seen[0].arrays["patches"]))
    mask = seen[0].arrays["mask"] > 0
    assert np.abs(trainer.score(seen[0])[mask] - trainer.score(blank)[mask]).max() > 1e-3
    assert curve[-1] < 0.6 * curve[0] and min(curve[-3:]) < min(curve[:3]), curve
    assert trainer.skipped_steps == 0


def test_warm_start_on_mixed_text_and_visual_demonstrations():
    trainer = Trainer(init_decoder(CFG, seed=0), TRAIN)
    seen = _recording(trainer)
    curve = sft.warm_start(trainer, TOK, ["calculator", "visual"], 10, 4)  # fresh tasks every step
    kinds = [[sft.train_tasks(["calculator", "visual"], 4 * s + i, 1, 0)[0].kind for i in p.kept]
             for s, p in enumerate(seen)]
    assert all(sorted(k) == ["calculator"] * 2 + ["visual"] * 2 for k in kinds)  # packed together
    assert all((p.arrays["patch_index"] >= 0).sum() == 2 * (4 + 16) for p in seen)
    assert all(math.isfinite(x) and x > 0 for x in curve)
    assert np.mean(curve[-3:]) < 0.8 * np.mean(curve[:3]), curve
    assert trainer.skipped_steps == 0
