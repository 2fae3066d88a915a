"""The `visual` task end to end: generator, images, reward, demonstrations; image observations through
the rollout loop (CTB and request-level), trajectories with images on disk, and packed training
log-probs with images."""

import asyncio
import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from tiderl_jax.agents import tasks as T
from tiderl_jax.agents import visual
from tiderl_jax.agents.env import LatencyModel, Observation
from tiderl_jax.agents.rollout import RolloutConfig, RolloutRunner
from tiderl_jax.trajectory import Trajectory, load_trajectories, save_trajectories
from tiderl_jax.engine.engine import Engine, EngineConfig
from tiderl_jax.model import chat
from tiderl_jax.model.config import ModelConfig
from tiderl_jax.model.decoder import init_decoder
from tiderl_jax.model.tokenizer import IMAGE_TOKEN, Tokenizer
from tiderl_jax.model.vision import check_images, dense_inputs, patchify
from tiderl_jax.rl.batch import pack
from tiderl_jax.rl.trainer import Trainer, token_logprobs
from tiderl_jax.rl.trainer_config import TrainerConfig

TOK = Tokenizer.builtin()
PATCH = 4
CFG = ModelConfig(arch="qwen3", vocab_size=384, hidden_size=64, intermediate_size=128, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True,
                  image_patch_dim=PATCH * PATCH * 3, max_image_patches=16,
                  image_token_id=TOK.token_id(IMAGE_TOKEN))
MODEL = init_decoder(CFG, seed=0)
TEXT_MODEL = init_decoder(dataclasses.replace(CFG, image_patch_dim=0, max_image_patches=0,
                                              image_token_id=None), seed=0)
HEADER = f"{chat.TURN_START}assistant\n"


def _model_turns(task):
    """The assistant turns of the task's demonstration, as the model would write them."""
    return [chat.render([m])[len(HEADER):] for m in T.demonstration(task, patch_size=PATCH)
            if m.role == "assistant"]


def _run_env(task, turns):
    env = T.make_env(task)

    async def go():
        first = await env.reset(task)
        return first, [await env.step(text) for text in turns]
    return asyncio.run(go())


# ------------------------------------------------------------------ the task


def test_generator_is_seeded_and_splits_differ():
    assert T.make_task("visual", 3) == T.make_task("visual", 3)
    train = [T.make_task("visual", i) for i in range(20)]
    held = [T.make_task("visual", i, "heldout") for i in range(20)]
    assert all(a.data["grid"] != b.data["grid"] for a, b in zip(train, held))
    assert T.make_task("visual", 1, seed=1).data["grid"] != T.make_task("visual", 1, seed=2).data["grid"]
    assert all(t.is_eval for t in held) and not any(t.is_eval for t in train)
    assert {t.data["question"] for t in train} == {"count", "locate"}
    for t in train:
        squares = sum(c != "." for row in t.data["grid"] for c in row)
        assert len(t.data["grid"]) == 8 and 4 <= squares <= 9
        if t.data["question"] == "locate":  # the target colour is unique in the scene
            letter = next(k for k, v in visual.COLOURS.items() if v == t.data["colour"])
            assert sum(row.count(letter) for row in t.data["grid"]) == 1


def test_images_show_the_scene_blurred_then_sharp():
    grid = ["R......."] + ["." * 8] * 6 + [".......B"]
    overview = visual.overview_image(grid)
    assert overview.shape == (8, 8, 3) and overview.dtype == np.uint8
    assert overview[:2, :2].tolist() == [[[64, 0, 0]] * 2] * 2  # one red cell of a 2x2 block: a quarter
    assert overview[6:, 6:].tolist() == [[[0, 0, 64]] * 2] * 2 and overview[2:6].max() == 0
    zoom = visual.zoom_image(grid, "bottom-right")
    assert zoom.shape == (16, 16, 3)
    assert zoom[12:, 12:].tolist() == [[[0, 0, 255]] * 4] * 4 and zoom[:12].max() == 0
    assert len(patchify(zoom, PATCH)) == 16 and len(patchify(overview, PATCH)) == 4  # tokens per image


@pytest.mark.parametrize("split", ["train", "heldout"])
def test_demonstrations_earn_reward_one_and_wrong_answers_zero(split):
    for i in range(6):
        task = T.make_task("visual", i, split)
        demo = T.demonstration(task, patch_size=PATCH)
        first, results = _run_env(task, _model_turns(task))
        assert isinstance(first, Observation) and first.text == task.prompt
        assert [im.shape for im in first.images] == [(8, 8, 3)]
        zoomed = results[0].observation  # the tool's answer is an image observation
        assert isinstance(zoomed, Observation) and [im.shape for im in zoomed.images] == [(16, 16, 3)]
        assert not results[0].done and results[-1].done and results[-1].reward == 1.0
        # the demonstration shows exactly what the environment shows
        np.testing.assert_array_equal(demo[1].images[0], patchify(first.images[0], PATCH))
        assert demo[3].content == zoomed.text
        np.testing.assert_array_equal(demo[3].images[0], patchify(zoomed.images[0], PATCH))
        wrong = "row 9, column 9" if task.data["question"] == "locate" else "99"
        assert _run_env(task, _model_turns(task)[:1] + [wrong])[1][-1].reward == 0.0
        assert _run_env(task, [wrong])[1][0].info.get("no_tool_call")  # answering blind is sent back


def test_bad_zoom_arguments_are_error_observations():
    task = T.make_task("visual", 0)
    _, results = _run_env(task, [chat.ToolCall("zoom", {"quadrant": "middle"}).render()])
    assert results[0].observation.startswith("error: zoom needs") and not results[0].done


# ------------------------------------------------------------------ the rollout loop


class _Scripted(visual.VisualEnvironment):
    """Replays given turns whatever the model writes, so the zoom images reach the (untrained) model."""

    def __init__(self, turns):
        super().__init__(latency=LatencyModel(0.01, 0.5))
        self.turns = list(turns)

    async def step(self, action):
        return await super().step(self.turns.pop(0))


def _scripted_env(task):
    zoom, answer = _model_turns(task)
    other = next(q for q in visual.QUADRANTS if q != task.data["quadrant"])
    wrong_zoom = chat.ToolCall("zoom", {"quadrant": other}).render()
    return _Scripted([wrong_zoom, zoom, answer])  # three turns, three images


def _engine(model=MODEL):
    return Engine(model, EngineConfig(page_size=16, num_pages=256, max_seq_len=1024, max_running=8,
                                      prefill_chunk=256, decode_steps=8))


def _rollout(mode, engine, tasks, make_env):
    runner = RolloutRunner(engine, TOK, RolloutConfig(mode=mode, max_turns=3, max_new_tokens=8,
                                                      temperature=0.0, max_context=1024))
    return runner, asyncio.run(runner.run(tasks, make_env))


VISUAL_TASKS = [(T.make_task("visual", i), i) for i in range(4)]


def _same_images(a, b):
    return [im.offset for im in a.images] == [im.offset for im in b.images] and all(
        np.array_equal(x.patches, y.patches) for x, y in zip(a.images, b.images))


@pytest.fixture(scope="module")
def ctb_and_request():
    ctb_engine, req_engine = _engine(), _engine()
    runner, ctb = _rollout("ctb", ctb_engine, VISUAL_TASKS, _scripted_env)
    _, req = _rollout("request", req_engine, VISUAL_TASKS, _scripted_env)
    return runner, ctb, req, ctb_engine.stats(), req_engine.stats()


def test_ctb_and_request_level_give_identical_image_trajectories(ctb_and_request):
    runner, ctb, req, ctb_stats, req_stats = ctb_and_request
    for a, b in zip(ctb, req):
        assert a.tokens == b.tokens and a.loss_mask == b.loss_mask and _same_images(a, b)
        assert a.end_reason == "answered" and a.reward == 1.0 and len(a.turns) == 3
        assert [len(im.patches) for im in a.images] == [4, 16, 16]  # overview, wrong zoom, right zoom
        check_images(a.tokens, a.images, CFG)  # every span sits on placeholders, inside the tokens
        assert a.tokens.count(CFG.image_token_id) == 36
        assert all(not any(a.loss_mask[im.offset:im.end]) for im in a.images)
        assert a.images[1].offset > a.turns[0].end and a.images[2].offset > a.turns[1].end
    assert runner.metrics["completed"] == len(VISUAL_TASKS) and runner.metrics["failed"] == 0
    assert ctb_stats["prefill_tokens_computed"] < req_stats["prefill_tokens_computed"]


def test_trajectories_with_images_round_trip_through_disk(ctb_and_request, tmp_path):
    trajs = ctb_and_request[1]
    save_trajectories(trajs, tmp_path / "t.jsonl")
    loaded = load_trajectories(tmp_path / "t.jsonl")
    assert [t.to_dict() for t in loaded] == [t.to_dict() for t in trajs]
    for a, b in zip(loaded, trajs):
        assert _same_images(a, b) and all(im.patches.dtype == np.float32 for im in a.images)


def test_text_only_model_fails_the_visual_task_only():
    tasks = [(T.make_task("visual", 0), 0), (T.make_task("calculator", 0), 1)]
    runner, (vis, calc) = _rollout("ctb", _engine(TEXT_MODEL), tasks, T.make_env)
    assert vis.end_reason == "engine_error" and "text-only" in vis.failure and vis.reward == 0.0
    assert calc.failure is None and calc.end_reason in ("answered", "max_turns") and calc.turns
    assert runner.metrics["failed"] == 1 and runner.metrics["completed"] == 1


# ------------------------------------------------------------------ training


def _demo_trajectory(task, group):
    """A trajectory of the task's demonstration (what SFT trains on)."""
    enc = chat.encode(TOK, T.demonstration(task, patch_size=PATCH))
    t = Trajectory(task.task_id, task.kind, group)
    t.extend(enc.ids, generated=False, images=enc.images)
    t.loss_mask = list(enc.model_mask)
    t.logprobs = [-1.0 if m else 0.0 for m in enc.model_mask]
    return t


def test_packed_logprobs_with_images_equal_each_sequence_alone():
    trajs = [_demo_trajectory(T.make_task("visual", i), i) for i in range(3)]
    trajs.append(_demo_trajectory(T.make_task("calculator", 0), 3))  # text only, packed with them
    assert trajs[0].images and not trajs[3].images
    p = pack(trajs, row_len=1024, micro_rows=1, patch_dim=CFG.image_patch_dim)
    a = p.arrays
    assert not p.dropped and a["patches"].shape == a["tokens"].shape + (48,)
    assert any(len({s for s in row if s}) > 1 for row in a["segment_ids"].reshape(-1, 1024))  # packed
    logp = np.zeros_like(a["mask"])
    for m in range(a["tokens"].shape[0]):
        logp[m] = np.asarray(token_logprobs(MODEL, *(jnp.asarray(a[k][m]) for k in (
            "tokens", "positions", "segment_ids")), 0.7, jnp.asarray(a["patches"][m]),
            jnp.asarray(a["patch_index"][m]))[0])
    trainer = Trainer(init_decoder(CFG, seed=0),  # MODEL's parameters, not donated to the step
                      TrainerConfig(row_len=1024, micro_rows=1, temperature=0.7))
    scored = trainer.score(p)
    for j, i in enumerate(p.kept):
        # each sequence alone in a row of its own, padding after it (segment 0, no patches): causal attention
        # keeps its log-probs the padding's, and a row as wide as the packed ones reuses their compiled ops
        tokens, n = trajs[i].tokens, len(trajs[i].tokens)
        patches, index = np.zeros((1024, CFG.image_patch_dim), np.float32), np.full(1024, -1, np.int32)
        patches[:n], index[:n] = dense_inputs(trajs[i].images, 0, n, CFG.image_patch_dim)
        want = np.asarray(token_logprobs(
            MODEL, jnp.asarray([tokens + [0] * (1024 - n)]), jnp.arange(1024)[None],
            jnp.asarray([[1] * n + [0] * (1024 - n)], jnp.int32), 0.7, jnp.asarray(patches[None]),
            jnp.asarray(index[None]))[0][0])[:n]
        m, r, s, n = p.placements[j]  # a segment's first log-prob reads across its start: never trained
        np.testing.assert_allclose(logp[m, r, s + 1:s + n], want[1:], atol=1e-5)
        np.testing.assert_allclose(scored[m, r, s + 1:s + n], want[1:], atol=1e-5)
    metrics = trainer.sft_step(p)  # the train step takes the images too
    assert np.isfinite(metrics["nll"]) and metrics["skipped"] == 0.0


def test_pack_keeps_text_batches_unchanged_and_drops_images_that_do_not_fit():
    vis = _demo_trajectory(T.make_task("visual", 0), 0)
    text = _demo_trajectory(T.make_task("calculator", 0), 1)
    assert set(pack([text], row_len=1024, micro_rows=1, patch_dim=48).arrays) == {
        "tokens", "positions", "segment_ids", "mask", "behaviour_logp"}
    for patch_dim in (0, 12):  # a text-only model, another patch size
        p = pack([vis, text], row_len=1024, micro_rows=1, patch_dim=patch_dim)
        assert p.kept == [1] and "patches" not in p.arrays
        assert p.dropped == [(0, "images with patches of [48] values do not fit the model's "
                                 f"patch_dim {patch_dim}")]
