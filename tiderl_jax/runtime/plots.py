"""The main job's plots: what a person looks at to see whether RL learned.

`learning_curves` (`learning.png`): left, the train reward of every update (the mean over every sample drawn
for it, the groups dynamic sampling dropped included; without the filter, the batch's GRPO samples) with its
running mean, and the held-out greedy mean reward during RL (the first `eval.during_tasks` held-out tasks:
before RL at update 0, every `eval.every` updates, after RL at the last); right, the held-out mean reward
(success, where rewards are 0 or 1) before and after RL, greedy and sampled, pooled and by task kind, with the pooled
gain's 95% paired-bootstrap interval in the title.

`reward_curve` (`reward_curve.png`): per update, the reward mean with a band of one standard deviation over the
batch's samples (and held-out success of the evaluations during RL, when there were any); below it the share of
GRPO groups whose rewards were all equal (no GRPO signal), with the not-learning threshold.
"""

from __future__ import annotations

import json
import os


def _steps(metrics_jsonl: str) -> list[dict]:
    rows = {}
    if os.path.exists(metrics_jsonl):
        with open(metrics_jsonl) as f:
            for line in f:
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if "step" in row:
                    rows[row["step"]] = row  # a resumed run logs its later steps again: the last wins
    return [rows[k] for k in sorted(rows)]


def _mean(xs):
    return sum(xs) / len(xs) if xs else float("nan")


def _eval_points(rows: list[dict], key: str) -> list[tuple[int, float]]:
    """(update, value) of the evaluations during RL logged in metrics.jsonl's rows: `key` "eval_success" (the
    share of tasks with reward 1) or "eval_reward" (the mean reward)."""
    return [(r["step"], r[key]) for r in rows if key in r]


def learning_curves(metrics_jsonl: str, before: dict, after: dict, gains: dict, path: str,
                    during_tasks: int = 0) -> str:
    """Writes the PNG (module docstring); `before` / `after`: {"greedy"|"sampled": heldout_results},
    `gains`: {"greedy"|"sampled": (mean, low, high)}; "sampled" is absent when `eval.sampled` is off;
    `during_tasks`: how many held-out tasks the evaluations during RL ran (0: none ran). Returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = _steps(metrics_jsonl)
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.5))
    steps = [r["step"] for r in rows]
    # every sample drawn for the update (dynamic sampling's dropped groups included: `sampled_reward`), else the batch's
    reward = [r.get("sampled_reward", r.get("reward", float("nan"))) for r in rows]
    left.plot(steps, reward, "o", color="tab:blue", alpha=0.35, label="train reward (per update, every sample drawn)")
    window = max(3, len(reward) // 5)
    running = [_mean(reward[max(0, i - window + 1):i + 1]) for i in range(len(reward))]
    left.plot(steps, running, "-", color="tab:blue", label=f"running mean ({window} updates)")
    during = _eval_points(rows, "eval_reward")
    if during_tasks and during:  # the same first tasks before RL, during it and after it, all greedy
        ends = [(0, _mean(before["greedy"]["rewards"][:during_tasks]))]
        if steps and during[-1][0] != steps[-1]:
            ends.append((steps[-1], _mean(after["greedy"]["rewards"][:during_tasks])))
        points = sorted(during + ends)
        left.plot(*zip(*points), "s--", color="tab:green",
                  label=f"held-out greedy mean reward, first {during_tasks} tasks (update 0: before RL)")
    left.set_xlabel("RL update")
    left.set_ylabel("reward")
    left.set_ylim(-0.02, 1.02)
    left.grid(alpha=0.3)
    left.legend(loc="upper left", fontsize=8)
    left.set_title("training reward" + (" and held-out reward during RL" if during_tasks and during else ""))

    kinds = sorted(set(before["greedy"]["kinds"]))
    groups = ["all"] + kinds if len(kinds) > 1 else ["all"]
    bars = [(name, when, results) for name in before for when, results in (("before", before), ("after", after))]
    width = 0.8 / len(bars)
    for j, (name, when, results) in enumerate(bars):
        r = results[name]
        vals = []
        for g in groups:
            xs = [x for x, k in zip(r["rewards"], r["kinds"]) if g == "all" or k == g]
            vals.append(_mean(xs))
        xs = [i + (j - (len(bars) - 1) / 2) * width for i in range(len(groups))]
        color = {"greedy": "tab:green", "sampled": "tab:orange"}[name]
        right.bar(xs, vals, width, color=color, alpha=0.45 if when == "before" else 0.95,
                  label=f"{name} {when}")
    right.set_xticks(range(len(groups)), groups)
    right.set_ylim(0, 1.02)
    right.set_ylabel("held-out mean reward (success if 0/1)")
    right.grid(axis="y", alpha=0.3)
    right.legend(fontsize=8, ncol=2)
    n = len(before["greedy"]["rewards"])
    right.set_title(f"held-out, {n} tasks; gain after - before [95% CI]:\n" + ", ".join(
        f"{name} {d:+.3f} [{lo:+.3f}, {hi:+.3f}]" for name, (d, lo, hi) in gains.items()), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def reward_curve(metrics_jsonl: str, path: str) -> str:
    """Writes `reward_curve.png` from metrics.jsonl (module docstring); returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    from tiderl_jax.runtime.health import NOT_LEARNING_UPDATES, ZERO_VARIANCE_SHARE

    rows = _steps(metrics_jsonl)
    nan = float("nan")
    steps = [r["step"] for r in rows]
    mean = [r.get("reward", nan) for r in rows]
    std = [r.get("reward_std", nan) for r in rows]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6), sharex=True, height_ratios=(2, 1))
    top.fill_between(steps, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)],
                     color="tab:blue", alpha=0.2, label="± one std over the batch's samples")
    top.plot(steps, mean, "o-", color="tab:blue", label="train reward (batch mean)")
    evals = _eval_points(rows, "eval_success")
    if evals:
        top.plot(*zip(*evals), "s--", color="tab:green", label="held-out success (evaluation during RL)")
    top.set_ylabel("reward")
    top.grid(alpha=0.3)
    top.legend(loc="upper left", fontsize=8)
    top.set_title(f"training reward over {len(rows)} updates")
    bottom.bar(steps, [r.get("zero_variance_groups", nan) for r in rows], color="tab:red", alpha=0.6,
               label="GRPO groups with all-equal rewards (no signal)")
    bottom.axhline(ZERO_VARIANCE_SHARE, color="black", linestyle=":", linewidth=1,
                   label=f"not learning above this for {NOT_LEARNING_UPDATES} updates")
    bottom.set_ylim(0, 1.02)
    bottom.set_ylabel("share of groups")
    bottom.set_xlabel("RL update")
    bottom.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))  # updates are whole numbers
    bottom.grid(alpha=0.3)
    bottom.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
