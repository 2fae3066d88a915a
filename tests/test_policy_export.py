"""The trained policy is usable: the main job's export (`hf_io.export_policy`, from weights sharded over the
8-device mesh as the trainer holds them) is an HF checkpoint `launch/generate.py` runs; held-out rollouts
are saved as JSONL a person can read (`rl.evaluate.save_readable`)."""

import json
import os
import subprocess
import sys

import numpy as np
import safetensors.numpy
from conftest import ROOT
from flax import nnx

from tiderl_jax.trajectory import Trajectory, Turn
from tiderl_jax.model import chat
from tiderl_jax.model.hf_io import export_policy, load_hf_checkpoint
from tiderl_jax.model.sharding import make_mesh
from tiderl_jax.model.tokenizer import Tokenizer
from tiderl_jax.rl.evaluate import save_readable

POLICY = ROOT / "checkpoints" / "tiny_agentic_sft"


def test_the_exported_policy_is_the_trained_weights_and_generate_runs_on_it(tmp_path):
    model = load_hf_checkpoint(POLICY, mesh=make_mesh({"data": 1, "fsdp": -1, "tensor": 2}))
    graphdef, params = nnx.split(model)
    plain = Tokenizer.from_file(POLICY / "tokenizer.json")
    template = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    tokenizer = Tokenizer(plain._tok, eos_token="<|im_end|>", pad_token="<|pad|>", stop_tokens=("<|endoftext|>",),
                          chat_template=template)
    out = tmp_path / "hf_export"
    size = export_policy(graphdef, params, tokenizer, out, meta={"step": 7})
    assert {p.name for p in out.iterdir()} == {"config.json", "model.safetensors", "tokenizer.json", "export.json",
                                               "tokenizer_config.json", "generation_config.json"}
    assert size == sum(p.stat().st_size for p in out.iterdir())
    assert json.loads((out / "export.json").read_text()) == {"step": 7}
    # the tokenizer comes back as it went: its chat template, special tokens and stop ids
    loaded = Tokenizer.from_checkpoint(out)
    assert loaded.chat_template == template and loaded.pad_id == tokenizer.pad_id
    assert loaded.stop_ids == tokenizer.stop_ids == (plain.eos_id, plain.token_id("<|endoftext|>"))
    original = safetensors.numpy.load_file(str(POLICY / "model.safetensors"))
    exported = safetensors.numpy.load_file(str(out / "model.safetensors"))
    assert set(original) == set(exported)
    for name in original:
        np.testing.assert_array_equal(original[name], exported[name], err_msg=name)
    r = subprocess.run([sys.executable, "launch/generate.py", f"--checkpoint={out}", "--chat",
                        "--prompt=What is 2 + 3? Use the calc tool.", "--temperature=0", "--max_new_tokens=8",
                        "--max_seq_len=256", "--num_pages=64", f"--json_out={tmp_path / 'o.json'}"],
                       cwd=ROOT, env=dict(os.environ), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    result = json.loads((tmp_path / "o.json").read_text())
    assert len(result) == 1 and 1 <= len(result[0]["token_ids"]) <= 8 and isinstance(result[0]["text"], str)


def test_rollouts_are_saved_decoded_with_reward_turns_and_end_reason(tmp_path):
    tokenizer = Tokenizer.builtin()
    prompt = chat.encode(tokenizer, [chat.Message("user", "2+3?")], add_generation_prompt=True).ids
    answer = tokenizer.encode("The answer is 5.")
    traj = Trajectory("calculator/heldout/0", "calculator", 0)
    traj.extend(prompt, generated=False)
    start = len(traj.tokens)
    traj.extend(answer + [10_000], generated=True, logprobs=[0.0] * (len(answer) + 1),
                model_logprobs=[0.0] * (len(answer) + 1), versions=[3] * (len(answer) + 1))
    traj.turns.append(Turn(start, len(traj.tokens), generate_s=0.1, env_s=0.0))
    traj.reward, traj.end_reason = 1.0, "answered"
    path = save_readable([traj, traj], tokenizer, str(tmp_path / "rollouts" / "heldout_after_greedy.jsonl"))
    lines = [json.loads(line) for line in open(path)]
    assert len(lines) == 2
    row = lines[0]
    assert row["task_id"] == "calculator/heldout/0" and row["reward"] == 1.0 and row["end_reason"] == "answered"
    assert row["num_turns"] == 1 and row["turns"][0]["text"] == "The answer is 5."  # id 10000: past the vocabulary
    assert row["text"].endswith("The answer is 5.") and "2+3?" in row["text"]
    assert row["tokens"] == traj.tokens and sum(row["model_written"]) == len(answer) + 1
