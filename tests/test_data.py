"""User datasets as a task source: JSONL (plain, .gz) and parquet in veRL's and the flat schema,
malformed rows skipped and named, seeded order; dataset tasks through their environments and the
real rollout loop."""

import asyncio
import builtins
import gzip
import json

import pytest

from tiderl_jax.data import datasets, env as data_env
from tiderl_jax.data.datasets import DatasetError
from tiderl_jax.agents.env import RewardFailed
from tiderl_jax.import_path import ImportPathError

VERL_ROWS = [
    {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"What is {i} + {i}?"}],
     "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
     "extra_info": {"split": "train", "index": i}}
    for i in range(6)
]
FLAT_ROWS = [{"prompt": "Capital of France?", "answer": "Paris"},
             {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2*3?"}],
              "label": 6}]


def _jsonl(path, rows, opener=open):
    with opener(path, "wt", encoding="utf-8") as f:
        for row in rows:
            f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    return str(path)


def test_verl_schema_rows_become_tasks(tmp_path):
    ds = datasets.load_dataset(_jsonl(tmp_path / "gsm.jsonl", VERL_ROWS), split="train")
    assert len(ds) == 6 and ds.skipped == 0
    t = ds.tasks[3]
    assert t.prompt == "What is 3 + 3?" and t.answer == "6" and t.kind == "openai/gsm8k" and not t.is_eval
    assert t.data["extra_info"] == {"split": "train", "index": 3} and t.data["source"].endswith("gsm.jsonl:4")
    assert t.task_id == "data/train/gsm/4"


def test_flat_schema_with_gzip_system_messages_and_several_files(tmp_path):
    a = _jsonl(tmp_path / "a.jsonl.gz", FLAT_ROWS, gzip.open)
    b = _jsonl(tmp_path / "b.jsonl", VERL_ROWS[:2])
    ds = datasets.load_dataset(f"{a}, {b}", split="heldout")  # a comma-separated list, as the config gives it
    assert [t.answer for t in ds.tasks] == ["Paris", "6", "0", "2"] and all(t.is_eval for t in ds.tasks)
    assert ds.tasks[1].prompt == "Be brief.\n\n2*3?" and ds.tasks[1].data["messages"][0]["role"] == "system"
    assert ds.tasks[0].kind == "dataset"
    assert datasets.load_dataset([a, b]).paths == (a, b)


def test_configurable_and_dotted_keys(tmp_path):
    rows = [{"question": {"text": "q1"}, "meta": {"gold": [1, 2]}}, {"question": {"text": "q2"}, "meta": {"gold": "x"}}]
    ds = datasets.load_dataset(_jsonl(tmp_path / "c.jsonl", rows), prompt_key="question.text", answer_key="meta.gold")
    assert [t.prompt for t in ds.tasks] == ["q1", "q2"] and ds.tasks[0].answer == "[1, 2]"
    assert ds.tasks[0].data["ground_truth"] == [1, 2]  # a list of tests stays a list for the reward


def test_malformed_rows_are_skipped_and_named(tmp_path):
    rows = [VERL_ROWS[0], "{not json", json.dumps([1, 2]), {"prompt": 5, "answer": "1"},
            {"prompt": "no answer"}, {"prompt": [{"role": "user"}], "answer": "1"},
            {"prompt": "q", "answer": None, "label": True}, {"prompt": "q", "answer": "1", "extra_info": "x"},
            "", VERL_ROWS[1]]
    path = _jsonl(tmp_path / "bad.jsonl", rows)
    ds = datasets.load_dataset(path)
    assert len(ds) == 2 and ds.skipped == 7
    messages = [str(e) for e in ds.errors]
    assert messages[0].startswith(f"{path}, row 2: not JSON")
    assert "row 3: a row is a JSON object, got list" in messages[1]
    assert "row 4: field 'prompt': expected a string or a non-empty list of chat messages, got int" in messages[2]
    assert "row 5: field 'reward_model.ground_truth': missing answer" in messages[3]
    assert "row 6: field 'prompt[0]'" in messages[4]
    assert "row 7: field 'label': expected a string, number, list or dict, got bool" in messages[5]
    assert "row 8: field 'extra_info': expected a dict, got str" in messages[6]
    assert [e.row for e in ds.errors] == [2, 3, 4, 5, 6, 7, 8]  # the blank line 9 is not a row


def test_no_usable_row_missing_file_and_unknown_format_are_clear_errors(tmp_path):
    path = _jsonl(tmp_path / "all_bad.jsonl", ["{", {"x": 1}])
    with pytest.raises(DatasetError, match=r"no usable row in .*all_bad.jsonl \(2 malformed\)") as e:
        datasets.load_dataset(path)
    assert "row 2: field 'prompt': missing prompt" in str(e.value)
    with pytest.raises(DatasetError, match="absent.jsonl not found"):
        datasets.load_dataset(str(tmp_path / "absent.jsonl"))
    (tmp_path / "data.csv").write_text("a,b\n")
    with pytest.raises(DatasetError, match="unknown format"):
        datasets.load_dataset(str(tmp_path / "data.csv"))
    with pytest.raises(DatasetError, match="no dataset files"):
        datasets.load_dataset(" , ")


def test_parquet_in_verl_schema(tmp_path):
    import pyarrow as pa  # in the `test` extra, so the parquet path is tested, never skipped
    import pyarrow.parquet as pq
    path = str(tmp_path / "train.parquet")
    pq.write_table(pa.Table.from_pylist(VERL_ROWS + [{**VERL_ROWS[0], "prompt": []}]), path)
    ds = datasets.load_dataset(path)
    assert [t.answer for t in ds.tasks] == [str(2 * i) for i in range(6)]
    assert ds.tasks[2].prompt == "What is 2 + 2?" and ds.tasks[2].data["extra_info"]["index"] == 2
    assert len(ds.errors) == 1 and str(ds.errors[0]) == f"{path}, row 7: field 'prompt': expected a string " \
                                                         "or a non-empty list of chat messages, got list"


def test_parquet_without_pyarrow_names_the_extra(tmp_path, monkeypatch):
    path = tmp_path / "t.parquet"
    path.write_bytes(b"PAR1")
    real_import = builtins.__import__

    def no_pyarrow(name, *args, **kw):
        if name.startswith("pyarrow"):
            raise ImportError("no pyarrow")
        return real_import(name, *args, **kw)

    monkeypatch.setattr(builtins, "__import__", no_pyarrow)
    with pytest.raises(DatasetError, match=r"needs pyarrow.*pip install -e '\.\[data\]'"):
        datasets.load_dataset(str(path))


def test_train_order_is_seeded_per_epoch_and_resumable(tmp_path):
    ds = datasets.load_dataset(_jsonl(tmp_path / "g.jsonl", VERL_ROWS))
    a, b = datasets.TaskSource(ds, seed=1), datasets.TaskSource(ds, seed=1)
    first = [a(i).prompt for i in range(12)]
    assert first == [b(i).prompt for i in range(12)]
    assert sorted(first[:6]) == sorted(first[6:]) == sorted(t.prompt for t in ds.tasks)  # each epoch: every row
    assert first[:6] != first[6:] or first[:6] != [t.prompt for t in ds.tasks]
    assert [datasets.TaskSource(ds, seed=1)(i).prompt for i in (9, 2)] == [first[9], first[2]]  # by index alone
    assert first != [datasets.TaskSource(ds, seed=2)(i).prompt for i in range(12)]
    assert [datasets.TaskSource(ds, shuffle=False)(i).prompt for i in range(6)] == [t.prompt for t in ds.tasks]
    assert a(0).task_id.endswith("/e0") and a(6).task_id.endswith("/e1")


def test_build_data_single_turn_env_scores_with_the_reward(tmp_path):
    reward = tmp_path / "reward.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    if 'crash' in solution_str:\n        raise ValueError('cannot parse')\n"
                      "    return {'score': float(solution_str.strip() == ground_truth), 'src': data_source}\n")
    train = _jsonl(tmp_path / "t.jsonl", VERL_ROWS + ["oops"])
    data = data_env.build_data({"train_files": train, "heldout_files": _jsonl(tmp_path / "h.jsonl", FLAT_ROWS),
                                "reward_fn": f"{reward}:compute_score"}, seed=3)
    assert len(data.train) == 6 and len(data.heldout) == 2 and len(data.errors) == 1
    task = data.train(0)
    env = data.make_env(task)

    async def go(reply):
        await env.reset(task)
        return await env.step(reply)

    result = asyncio.run(go(task.answer))
    assert result.done and result.reward == 1.0 and result.info["reward_info"] == {"src": "openai/gsm8k"}
    assert asyncio.run(go("wrong")).reward == 0.0
    with pytest.raises(RewardFailed, match="raised ValueError: cannot parse"):
        asyncio.run(go("crash"))
    with pytest.raises(ImportPathError, match="has no 'nope'"):  # checked when the run is configured
        data_env.build_data({"train_files": train, "reward_fn": f"{reward}:nope"})


def test_build_data_with_a_user_environment_class(tmp_path):
    (tmp_path / "user_env_mod.py").write_text(
        "from tiderl_jax.agents.env import StepResult\n"
        "class Echo:\n"
        "    def __init__(self, reward_fn):\n        self.reward_fn = reward_fn\n"
        "    async def reset(self, task):\n        self.task = task\n        return task.prompt\n"
        "    async def step(self, action):\n"
        "        r = await self.reward_fn('', action, self.task.answer, None)\n"
        "        return StepResult(None, r.score, True)\n")
    rows = [{"prompt": "say 4"}, {"prompt": "say 5", "answer": "5"}]  # an environment may score without answers
    data = data_env.build_data({"train_files": _jsonl(tmp_path / "e.jsonl", rows),
                                "env": f"{tmp_path}/user_env_mod.py:Echo"})
    env = data.make_env(data.train(0))
    assert type(env).__name__ == "Echo" and env.reward_fn.name == "math"
    import pickle
    again = pickle.loads(pickle.dumps(data.make_env))  # environment subprocesses get the paths
    assert again == data.make_env and type(again(data.train(0))).__name__ == "Echo"


def test_a_dataset_task_runs_through_the_rollout_loop(tmp_path):
    from tiderl_jax.agents.rollout import RolloutConfig, RolloutRunner
    from tiderl_jax.engine.engine import Engine, EngineConfig
    from tiderl_jax.model.config import ModelConfig
    from tiderl_jax.model.decoder import init_decoder
    from tiderl_jax.model.tokenizer import Tokenizer

    reward = tmp_path / "len_reward.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    if extra_info['index'] == 1:\n        raise RuntimeError('bad row')\n"
                      "    return 0.25\n")
    data = data_env.build_data({"train_files": _jsonl(tmp_path / "r.jsonl", VERL_ROWS[:3]),
                                "reward_fn": f"{reward}:compute_score"})
    model = init_decoder(ModelConfig(arch="qwen3", vocab_size=384, hidden_size=32, intermediate_size=64,
                                     num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, qk_norm=True), seed=0)
    engine = Engine(model, EngineConfig(page_size=16, num_pages=64, max_seq_len=256, max_running=4,
                                        prefill_chunk=128, decode_steps=4))
    runner = RolloutRunner(engine, Tokenizer.builtin(), RolloutConfig(max_turns=2, max_new_tokens=6, temperature=0.0,
                                                                      max_context=256))
    work = [(datasets.TaskSource(data.train.dataset, shuffle=False)(i), 0) for i in range(3)]
    trajs = {t.task_id.split("/")[3]: t for t in asyncio.run(runner.run(work, data.make_env))}
    assert trajs["1"].end_reason == "answered" and trajs["1"].reward == 0.25 and len(trajs["1"].turns) == 1
    assert trajs["2"].end_reason == "reward_error" and "bad row" in trajs["2"].failure
    assert trajs["3"].end_reason == "answered"
    from tiderl_jax.rl import evaluate  # held-out evaluation on a dataset's tasks, with their environments
    held = evaluate.heldout_trajectories(engine, Tokenizer.builtin(), (), 2, runner.config,
                                         dataset_tasks=data.train.dataset.tasks, make_env=data.make_env)
    assert [t.end_reason for t in held] == ["answered", "reward_error"] and held[0].reward == 0.25


def test_the_controller_draws_train_tasks_from_a_task_source(tmp_path):
    from tiderl_jax.runtime.controller import Controller
    from tiderl_jax.runtime.controller_config import ControllerConfig
    from tiderl_jax.sim.backend import SimBackend, SimConfig

    data = data_env.build_data({"train_files": _jsonl(tmp_path / "c.jsonl", VERL_ROWS)}, seed=5)
    cfg = ControllerConfig(mode="sync", steps=1, groups_per_step=2, group_size=2, max_concurrent=4,
                           device_group_size=2, tensor=1, rollout_groups=2, ref_groups=0, train_groups=2)
    controller = Controller(config=cfg, logdir=str(tmp_path / "run"), backend=SimBackend.for_controller(
        SimConfig(), cfg, 8), checkpoints=False, task_source=data.train, make_env=data.make_env)
    drawn = [controller._next_task() for _ in range(7)]
    assert [t.task_id for t in drawn] == [data.train(i).task_id for i in range(7)]
    assert drawn[0].kind == "openai/gsm8k" and controller.cursor == 7
