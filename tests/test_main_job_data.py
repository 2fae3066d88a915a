"""The main job on a user's dataset and reward file (docs/data.md): `launch/train.py --config=configs/tiny_agentic.py
--config.data.train_files=... --config.data.reward_fn=reward.py:compute_score` trains on the file's rows, scored by
the veRL-style reward file, with held-out rows from the train file when no held-out file is given; a malformed row
is skipped and counted; bad data settings are one-line errors (exit 2)."""

import json
import subprocess
import sys

import pytest
from conftest import ROOT
from test_main_job import TINY

REWARD = '''
import json, os

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    with open(os.path.join(os.path.dirname(__file__), "calls.jsonl"), "a") as f:
        f.write(json.dumps({"data_source": data_source, "ground_truth": ground_truth, "extra_info": extra_info,
                            "solution": solution_str}) + "\\n")
    return {"score": float(ground_truth in solution_str), "matched": ground_truth in solution_str}
'''


def _dataset(path, n=24):
    rows = [{"data_source": "test/arith", "prompt": [{"role": "user", "content": f"What is {i} + {i + 1}?"}],
             "reward_model": {"style": "rule", "ground_truth": str(2 * i + 1)}, "extra_info": {"index": i}}
            for i in range(n)]
    lines = [json.dumps(r) for r in rows]
    lines.insert(5, json.dumps({"data_source": "test/arith", "reward_model": {"ground_truth": "1"}}))  # no prompt
    path.write_text("\n".join(lines) + "\n")
    return path


def _train(tmp_path, *args, timeout=600):
    return subprocess.run([sys.executable, "launch/train.py", "--config=configs/tiny_agentic.py",
                           f"--config.logdir={tmp_path / 'run'}", *TINY, *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout)


@pytest.mark.e2e
@pytest.mark.timeout(900)
def test_the_main_job_trains_on_a_jsonl_file_scored_by_a_verl_reward_file(tmp_path):
    data = _dataset(tmp_path / "train.jsonl")
    (tmp_path / "reward.py").write_text(REWARD)
    out = _train(tmp_path, f"--config.data.train_files={data}", f"--config.data.reward_fn={tmp_path}/reward.py:compute_score",
                 "--config.data.system_prompt=Answer with the number only.")
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    assert "Traceback" not in text
    # the model line names the data, the held-out rows taken from it and the skipped row
    assert f"train {data} (20 rows)" in text and "held-out 4 rows of the train files, not trained on" in text, text[-4000:]
    assert "1 rows skipped (1 malformed" in text and "row 6: field 'prompt'" in text
    run = tmp_path / "run"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["step"] == 3 and summary["heldout_tasks"] == 4
    assert summary["ledger"]["unexplained"] == 0
    held = [json.loads(line) for line in open(run / "rollouts" / "heldout_before_greedy.jsonl")]
    assert len(held) == 4 and {r["kind"] for r in held} == {"test/arith"}
    assert all("Answer with the number only." in r["text"] and "What is" in r["text"] for r in held)
    held_index = {int(r["text"].split("What is ")[1].split(" ")[0]) for r in held}
    calls = [json.loads(line) for line in open(tmp_path / "calls.jsonl")]
    assert {c["data_source"] for c in calls} == {"test/arith"}
    assert all(c["ground_truth"] == str(2 * c["extra_info"]["index"] + 1) for c in calls)  # the row's own fields
    # the held-out evaluations before (greedy, sampled) and after are the first and last 8 calls; between them the
    # training samples (at least 3 updates x 2 groups x 2), never a held-out row, and the one evaluation during RL
    # (at update 2, eval.during_tasks=2)
    assert {c["extra_info"]["index"] for c in calls[:8] + calls[-8:]} == held_index
    during_rl = [c["extra_info"]["index"] for c in calls[8:-8]]
    assert len([i for i in during_rl if i not in held_index]) >= 12
    assert len([i for i in during_rl if i in held_index]) == 2
    config = json.loads((run / "config.json").read_text())
    assert config["data"]["train_files"] == str(data)


@pytest.mark.parametrize("args,named", [
    (["--config.data.train_files=/nonexistent/train.jsonl"], "data: dataset file /nonexistent/train.jsonl not found"),
    (["--config.data.train_files={data}", "--config.data.reward_fn=no_such_module:score"], "data.reward_fn"),
    (["--config.data.train_files={data}", "--config.warm_start=scratch"], "warm_start='scratch'"),
    (["--config.data.train_files={data}", "--config.data.reward_timeout_s=0"], "data.reward_timeout_s=0"),
    (["--config.data.train_files={data}", "--config.rollout.max_context=128", "--config.rollout.max_new_tokens=96"],
     "no row's prompt fits rollout.max_context=128"),
])
def test_bad_data_settings_are_one_line_errors(tmp_path, args, named):
    data = _dataset(tmp_path / "train.jsonl")
    out = _train(tmp_path, *[a.format(data=data) for a in args], timeout=300)
    assert out.returncode == 2, (out.stdout + out.stderr)[-3000:]
    lines = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and named in lines[0], out.stderr[-3000:]
    assert "Traceback" not in out.stderr
