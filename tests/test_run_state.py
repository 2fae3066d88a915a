"""The main job's log directory as a run (`tiderl_jax/run_state.py`) and its summary (`tiderl_jax/run_report.py`):
which config changes a resume refuses, a finished run, the continuation of one, the sample ledger's identity,
counts beside rates and the two clocks. Pure Python: no model, no JAX."""

import json

import pytest

from tiderl_jax import run_report
from tiderl_jax.model.config import ConfigError
from tiderl_jax.run_state import RunState, config_changes, flat, write_config

CONFIG = {"logdir": "runs/a", "seed": 0, "tasks": ("calculator", "lookup"), "checkpoint": "",
          "controller": {"mode": "tiderl", "steps": 3, "group_size": 8},
          "eval": {"tasks": 16}, "sft": {"log_every": 25, "steps": 100}}


def _config(**changes):
    """CONFIG with `section={key: value}` merged into a section, or a top-level key replaced."""
    return {k: {**v, **changes.get(k, {})} if isinstance(v, dict) else changes.get(k, v) for k, v in CONFIG.items()}


def test_every_differing_key_is_named_and_the_step_budget_may_change():
    old = flat(_config())
    assert config_changes(old, flat(_config(controller={"steps": 9}, sft={"log_every": 1}, logdir="b"))) == []
    diff = config_changes(old, flat(_config(controller={"mode": "sync", "group_size": 4}, sft={"steps": 5},
                                            tasks=("lookup",))))
    assert [k for k, _, _ in diff] == ["controller.group_size", "controller.mode", "sft.steps", "tasks"]
    # eval.tasks may change until the held-out "before" ran (the "after" pairs with it task for task)
    changed = flat(_config(eval={"tasks": 32}))
    assert config_changes(old, changed) == []
    assert config_changes(old, changed, ["heldout_before"]) == [("eval.tasks", 16, 32)]
    # a key only one side has (a config file that grew a key) is a difference too
    assert config_changes(old, {**old, "new_key": 1}) == [("new_key", "(not set)", 1)]


def test_a_refused_resume_is_one_line_naming_all_keys_and_how_to_start_fresh(tmp_path):
    RunState(str(tmp_path), _config()).save(heldout_before={"rewards": [0.0]})
    state = RunState(str(tmp_path), _config(controller={"mode": "sync", "group_size": 4}, eval={"tasks": 8},
                                            tasks=("lookup",), checkpoint="ckpt"))
    with pytest.raises(ConfigError) as e:
        state.check_same_run()
    message = str(e.value)
    assert "\n" not in message
    for shown in ("controller.mode: 'tiderl' -> 'sync'", "controller.group_size: 8 -> 4",
                  "tasks: ('calculator', 'lookup') -> ('lookup',)", "checkpoint: '' -> 'ckpt'", "eval.tasks: 16 -> 8"):
        assert shown in message, message
    assert "another --config.logdir" in message and f"deleting {tmp_path}" in message
    RunState(str(tmp_path), _config(controller={"steps": 30})).check_same_run()  # the budget: fine


def test_the_evaluation_during_rl_may_change_on_resume():
    old = flat(_config(eval={"tasks": 16, "every": 4, "during_tasks": 8}))
    new = flat(_config(eval={"tasks": 16, "every": 1, "during_tasks": 4}))
    assert config_changes(old, new, ["heldout_before"]) == []


def test_a_run_from_before_a_key_existed_resumes_while_the_key_has_its_default(tmp_path):
    old_run = _config()  # no eval.every, eval.during_tasks, trainer.new_knob: made before they existed
    RunState(str(tmp_path), old_run).save(heldout_before={"rewards": [0.0]})
    defaults = _config(eval={"tasks": 16, "every": 4, "during_tasks": 32}, controller={"new_knob": 1})
    RunState(str(tmp_path), defaults, defaults).check_same_run()
    # a new key set to something else than its default is a difference (unless resumable, as eval.* is)
    changed = _config(eval={"tasks": 16, "every": 2, "during_tasks": 32}, controller={"new_knob": 2})
    with pytest.raises(ConfigError, match=r"\(controller.new_knob: \(not set\) -> 2\);"):
        RunState(str(tmp_path), changed, defaults).check_same_run()
    # without the defaults (an entry point that gives none) a key the old run lacks is a difference
    with pytest.raises(ConfigError, match="controller.new_knob"):
        RunState(str(tmp_path), defaults).check_same_run()
    # a key the new config lost is a difference, whatever the defaults
    assert config_changes(flat(defaults), flat(old_run), (), flat(defaults)) == [
        ("controller.new_knob", 1, "(not set)")]


def test_finished_runs_and_their_continuation(tmp_path):
    state = RunState(str(tmp_path), _config())
    state.save(heldout_before={}, rl_summary={}, heldout_after={})
    assert state.finished() is None  # no summary.json yet: the summary phase did not end
    (tmp_path / "summary.json").write_text('{"steps": 3}')
    # a run_state.json from before `finished` was kept: its own config's budget is what it reached
    assert RunState(str(tmp_path), _config()).finished() == {"steps": 3, "summary": str(tmp_path / "summary.json")}
    state.save(finished={"steps": 3, "summary": str(tmp_path / "summary.json")})
    state = RunState(str(tmp_path), _config(controller={"steps": 5}))
    done = state.finished()
    assert done["steps"] == 3
    kept = state.continue_finished(done)
    assert kept == str(tmp_path / "summary.3_steps.json") and json.loads(open(kept).read()) == {"steps": 3}
    assert not (tmp_path / "summary.json").exists()
    again = RunState(str(tmp_path), _config(controller={"steps": 5}))
    assert again.finished() is None and "heldout_after" not in again.data and "heldout_before" in again.data
    assert again.data["config"]["controller.steps"] == 5


def test_the_resolved_config_is_written_readable(tmp_path):
    path = write_config(str(tmp_path / "new"), _config())
    written = json.loads(open(path).read())
    assert written["tasks"] == ["calculator", "lookup"] and written["controller"]["mode"] == "tiderl"


def test_the_ledger_identity_names_every_term():
    ledger = {"admitted": 148, "completed": 135, "dropped:stale": 4, "dropped:env_error": 2,
              "dropped:error:RuntimeError": 1}
    acc = run_report.ledger_accounts(ledger, unfinished=10, trained=120, ready=8, waiting=3)
    assert acc["dropped"] == {"env_error": 2, "error:RuntimeError": 1}  # stale ones completed first
    assert acc["unexplained"] == 0 and acc["completed_as"]["unexplained"] == 0
    first, second = run_report.ledger_lines(acc)
    assert first == ("admitted 148 = completed 135 + dropped 3 (env_error 2, error:RuntimeError 1) + unfinished "
                     "when RL stopped 10")
    assert second.startswith("completed 135 = trained 120 + dropped as stale 4 + ready at the end 8")
    # samples an interruption of RL lost (the update's batch in progress) are a term of their own
    cut = run_report.ledger_accounts(ledger, unfinished=10, trained=116, ready=8, waiting=3, interrupted=4)
    assert cut["completed_as"]["unexplained"] == 0
    assert run_report.ledger_lines(cut)[1].endswith("in groups not yet complete 3 + lost when RL was interrupted 4")
    # numbers that do not add up are shown, not hidden
    short = run_report.ledger_accounts(ledger, unfinished=1, trained=120, ready=8, waiting=0)
    assert short["unexplained"] == 9 and short["completed_as"]["unexplained"] == 3
    assert "+ unexplained 9" in run_report.ledger_lines(short)[0]


def _rl(**extra):
    return dict(steps=3, step=3, wall_s=40.0, rewards=[0.0, 0.5, 1.0], goodput_tokens_per_s=100.0,
                goodput_samples_per_s=1.5, step_time_s=2.0, rollout_wait_s=3.0, trainer_wait_s=4.0, kv_hit_rate=0.5,
                ledger={"admitted": 4, "completed": 4}, ers_refused=3, ers_refusal_last="", moves=1,
                ers_refusals={"does not pay": 1, "cooldown": 2},
                ers_moves=[dict(step=2, by="ERS", frm="train", to="rollout", reason="rollout deficit")],
                ledger_accounts=run_report.ledger_accounts({"admitted": 4, "completed": 4}, unfinished=0,
                                                           trained=4, ready=0, waiting=0), **extra)


def test_the_summary_gives_counts_beside_rates_and_names_both_clocks():
    before = {name: {"kinds": ["calculator", "lookup"] * 8, "rewards": [1.0] * 3 + [0.0] * 13}
              for name in ("greedy", "sampled")}
    after = {name: {"kinds": ["calculator", "lookup"] * 8, "rewards": [1.0] * 5 + [0.5] + [0.0] * 10}
             for name in ("greedy", "sampled")}
    gains = {"greedy": (0.156, -0.1, 0.4), "sampled": (0.156, -0.1, 0.4)}
    common = dict(rl=_rl(), before=before, after=after, gains=gains, phases_s={"start": 5.0, "RL": 41.0},
                  total_s=60.0, compiles=(10, 2.0))
    rows = dict(run_report.summary_rows(mode="tiderl", batch_samples=4, files={"policy": "p"}, **common))
    assert rows["held-out greedy"].startswith("3/16 (0.188) -> 5/16 (0.312) tasks solved")
    assert "calculator 2/8 -> 3/8" in rows["  by kind"]
    assert rows["RL wall time"].startswith("40s (rl_wall_s") and rows["total wall time"].startswith("60s (total_wall_s")
    assert "step 2 ERS train -> rollout (rollout deficit)" in rows["moves"] and "3 step boundaries" in rows["moves"]
    assert "(cooldown 2, does not pay 1)" in rows["moves"]  # the refusals by kind, most frequent first
    out = run_report.summary_json(devices=8, platform="cpu", files={"policy": "p"}, **common)
    assert "wall_s" not in out and out["rl_wall_s"] == 40.0 and out["total_wall_s"] == 60.0
    assert out["heldout_before"]["greedy"] == dict(solved=3, tasks=16, rate=3 / 16, mean_reward=3 / 16)
    assert out["heldout_after"]["greedy"]["solved"] == 5 and out["heldout_after"]["greedy"]["mean_reward"] == 5.5 / 16
    assert out["heldout_success_after"]["greedy"] == 5 / 16 and out["ledger"]["unexplained"] == 0
    json.dumps(out)


def test_a_greedy_only_evaluation_is_summarised_and_plotted_without_the_sampled_rows(tmp_path):
    """eval.sampled=false: the held-out results have only "greedy"; the table, summary.json and learning.png
    show that and nothing of "sampled"."""
    from tiderl_jax.runtime import plots

    before = {"greedy": {"kinds": ["gsm8k"] * 4, "rewards": [1.0, 0.0, 0.0, 0.0]}}
    after = {"greedy": {"kinds": ["gsm8k"] * 4, "rewards": [1.0, 1.0, 0.0, 0.0]}}
    common = dict(rl=_rl(), before=before, after=after, gains={"greedy": (0.25, 0.0, 0.5)},
                  phases_s={"RL": 41.0}, total_s=60.0, compiles=(10, 2.0))
    rows = dict(run_report.summary_rows(mode="sync", batch_samples=4, files={}, **common))
    assert rows["held-out greedy"].startswith("1/4 (0.250) -> 2/4 (0.500)")
    assert not any("sampled" in k for k in rows)
    out = run_report.summary_json(devices=1, platform="cpu", files={}, **common)
    assert out["heldout_gain"] == 0.25 and "heldout_gain_sampled" not in out and list(out["heldout_before"]) == ["greedy"]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"step": i, "reward": r}) + "\n" for i, r in enumerate([0.2, 0.4], 1)))
    titles = []
    from matplotlib.axes import Axes
    original = Axes.set_title
    Axes.set_title = lambda self, text, *a, **k: (titles.append(text), original(self, text, *a, **k))[1]
    try:
        path = plots.learning_curves(str(metrics), before, after, common["gains"], str(tmp_path / "learning.png"))
    finally:
        Axes.set_title = original
    assert (tmp_path / "learning.png").stat().st_size > 0 and path.endswith("learning.png")
    assert any("greedy +0.250 [+0.000, +0.500]" in t for t in titles) and not any("sampled" in t for t in titles)


def test_learning_png_draws_the_held_out_curve_during_rl_from_before_to_after(tmp_path):
    """The evaluations during RL (metrics.jsonl's eval_reward) are drawn on learning.png between the same first
    `during_tasks` held-out tasks before RL (update 0) and after it (the last update, when no evaluation ran
    there); without evaluations during RL no such curve is drawn."""
    from matplotlib.axes import Axes

    from tiderl_jax.runtime import plots

    before = {"greedy": {"kinds": ["k"] * 6, "rewards": [1.0, 0.0, 0.0, 0.0, 1.0, 1.0]}}
    after = {"greedy": {"kinds": ["k"] * 6, "rewards": [1.0, 1.0, 0.5, 0.5, 0.0, 0.0]}}
    gains = {"greedy": (0.0, -0.5, 0.5)}
    metrics = tmp_path / "metrics.jsonl"
    rows = [{"step": i, "reward": 0.1 * i} for i in range(1, 6)]
    rows[1]["eval_reward"], rows[3]["eval_reward"] = 0.5, 0.75  # updates 2 and 4
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    drawn = []
    original = Axes.plot
    Axes.plot = lambda self, *a, **k: (drawn.append((a, k)), original(self, *a, **k))[1]
    try:
        plots.learning_curves(str(metrics), before, after, gains, str(tmp_path / "a.png"), during_tasks=4)
        green = [a for a, k in drawn if "held-out" in k.get("label", "")]
        drawn.clear()
        plots.learning_curves(str(metrics), before, after, gains, str(tmp_path / "b.png"))
        none = [a for a, k in drawn if "held-out" in k.get("label", "")]
    finally:
        Axes.plot = original
    assert len(green) == 1
    xs, ys = green[0][:2]
    assert list(xs) == [0, 2, 4, 5] and list(ys) == [0.25, 0.5, 0.75, 0.75]  # the first 4 tasks' means
    assert none == []


def test_the_phases_are_drawn_on_the_run_metrics_clock(tmp_path, monkeypatch):
    from matplotlib.axes import Axes

    from tiderl_jax.runtime.metrics import RunMetrics

    now = [0.0]
    phases = run_report.Phases(clock=lambda: now[0])
    for t, name in ((10.0, "warm start"), (15.0, "RL"), (25.0, "held-out after")):
        now[0] = t
        phases.enter(name)
    assert phases.spans == [("start", 0.0, 10.0), ("warm start", 10.0, 15.0), ("RL", 15.0, 25.0)]
    assert phases.seconds == {"start": 10.0, "warm start": 5.0, "RL": 10.0}
    metrics_clock = lambda: now[0] + 1000.0  # noqa: E731 - another clock: 1000 s ahead of the phases'
    on_metrics = phases.spans_on(metrics_clock)
    assert on_metrics == [("start", 1000.0, 1010.0), ("warm start", 1010.0, 1015.0), ("RL", 1015.0, 1025.0)]
    now[0] = 15.0  # the RL phase began: the run metrics' clock starts
    metrics = RunMetrics(str(tmp_path), total_steps=1, devices={"rollout": 1}, clock=metrics_clock)
    metrics.begin()
    now[0] = 16.0
    with metrics.span("rollout", "generate"):
        now[0] = 20.0
    bars = []
    draw = Axes.broken_barh

    def record(ax, xranges, *args, **kwargs):
        bars.append(xranges)
        return draw(ax, xranges, *args, **kwargs)
    monkeypatch.setattr(Axes, "broken_barh", record)
    path = metrics.plot_timeline(str(tmp_path / "timeline.png"), mode="tiderl", phases=on_metrics)
    metrics.close()
    assert (tmp_path / "timeline.png").stat().st_size > 1000 and path.endswith("timeline.png")
    # seconds since the invocation began: the RL lane's span at 16-20, the phases where they were
    assert bars == [[(16.0, 4.0)], [(0.0, 10.0)], [(10.0, 5.0)], [(15.0, 10.0)]]
