"""benchmarks/sim_validation.py's settings (goodput.py's, kept equal by hand) and its workload: the built-in tasks'
demonstration shapes, replayed samples and their environment latencies, as simulator task samplers."""

import statistics

from _env import setup

ROOT = setup(devices=8)

import numpy as np  # noqa: E402

from tiderl_jax.agents import tasks as task_lib  # noqa: E402
from tiderl_jax.model import chat  # noqa: E402
from tiderl_jax.model.config import ModelConfig  # noqa: E402
from tiderl_jax.model.tokenizer import Tokenizer  # noqa: E402
from tiderl_jax.sim import costs, workloads  # noqa: E402

# benchmarks/goodput.py's model, engine and trainer settings (kept equal by hand: importing goodput.py
# would import its whole JAX stack before the flags here are parsed)
MODEL = ModelConfig(arch="qwen3", vocab_size=384, hidden_size=128, intermediate_size=384, num_layers=4,
                    num_heads=4, num_kv_heads=2, head_dim=32, qk_norm=True, max_position_embeddings=2048,
                    dtype="float32")
ENGINE = dict(page_size=16, num_pages=4096, max_seq_len=2048, max_running=64, prefill_chunk=512,
              prefill_budget=2048, max_prefill_rows=16, decode_steps=8, bucket_growth=4)
TRAINER = dict(learning_rate=1e-4, warmup_steps=1, row_len=1024, micro_rows=4)
KINDS = ("calculator", "lookup")
GROUPS, GROUP_SIZE, STEPS, SKIP, MAX_CONCURRENT = 4, 4, 8, 2, 48
LATENCY = (0.3, 1.0, 5.0)  # median s, sigma, cap s
# rollout / ref / train devices of each mode's layout (goodput.py run_mode; sync: all 8 for everything)
LAYOUTS = {"sync": (8, 0, 8), "async": (4, 0, 4), "tiderl": (4, 0, 4), "limit": (4, 0, 4)}
MODES = ("sync", "async", "tiderl", "limit")
DEFAULT_MEASURED = [f"/tmp/notes/goodput_run{i}.json" for i in (1, 2, 3, 4)]
LONG = 448  # context tokens of the long-context decode and prefill measurements (later turns' contexts)
OFFSETS = {8: 0, 4: 4, 2: 6}  # first device of a train mesh of n devices (goodput's layouts put train last)
# _Lab.rollout: about the groups a goodput.py mode runs (8 updates of 4, and stale ones replaced), as each mode
# runs them: (KV mode, rollout devices, groups in flight): sync one batch at a time on all 8 devices, the
# others two batches (staleness 1) on 4
ROLLOUT_GROUPS, ROLLOUT_IN_FLIGHT = 40, 2 * GROUPS
ROLLOUTS = (("request", 8, GROUPS), ("request", 4, 2 * GROUPS), ("ctb", 4, 2 * GROUPS))
KV_MODE = {"sync": "request_8", "async": "request", "tiderl": "ctb", "limit": "ctb"}  # its rollout measurement


# ------------------------------------------------------------------ workload from the demonstrations

def demo_shapes(count: int = 64) -> dict[str, list[tuple]]:
    """Per kind, `count` train tasks' demonstration shapes: (prompt tokens incl. the generation
    prompt, model tokens per turn, observation tokens between turns incl. the next generation prompt),
    and the token ids of their prompts (for the engine measurements)."""
    tok = Tokenizer.builtin()
    out = {}
    for kind in KINDS:
        rows = []
        for i in range(count):
            task = task_lib.make_task(kind, i, "train", 0)
            enc = chat.encode(tok, task_lib.demonstration(task))
            runs, gaps, prev_end, prompt = [], [], None, 0
            mask = list(enc.model_mask)
            j = 0
            while j < len(mask):
                if mask[j]:
                    k = j
                    while k < len(mask) and mask[k]:
                        k += 1
                    if prev_end is None:
                        prompt = j
                    else:
                        gaps.append(j - prev_end)
                    runs.append(k - j)
                    prev_end = j = k
                else:
                    j += 1
            rows.append((prompt, tuple(runs), tuple(gaps), list(enc.ids[:prompt])))
        out[kind] = rows
    return out


def shared_prefix(shapes: dict) -> int:
    """Tokens every task's prompt starts with (the system prompt and the chat template's head): what the
    engine's prefix cache shares across tasks (`SimConfig.shared_prefix_tokens`)."""
    prompts = [r[3] for rows in shapes.values() for r in rows]
    n = min(len(p) for p in prompts)
    for i in range(n):
        if any(p[i] != prompts[0][i] for p in prompts):
            return i
    return n


def task_latencies(group: int, latency: tuple[float, float, float], calls: int) -> list[float]:
    """The environment latencies the real run draws for the controller's g-th task: its environment
    (`tasks.make_env`) samples `LatencyModel` from a generator seeded by the task id, one draw per tool
    call, the same for every sample of the group (each has its own environment of that seed)."""
    import random
    import zlib

    from tiderl_jax.agents.env import LatencyModel

    task = task_lib.make_task(KINDS[group % len(KINDS)], group // len(KINDS), "train", 0)
    rng, model = random.Random(zlib.crc32(task.task_id.encode())), LatencyModel(*latency)
    return [model.sample(rng) for _ in range(calls)]


def replay_sampler(groups: list[list[tuple]], latency: tuple[float, float, float] | None):
    """`SimBackend.shape_sampler` replaying measured samples: group g is `groups[g]` (the real policy's
    samples of the controller's g-th task, `_Lab.rollout`), each sample its own (prompt, model tokens per
    turn, observation tokens between turns, tool calls per turn); each tool call waits the latency the
    real environment draws for it (`task_latencies`), a turn without a call none."""
    def sample(group: int, rng: np.random.Generator, n: int) -> list[workloads.TaskSample]:
        rows = groups[group % len(groups)]
        out = []
        for i in range(n):
            prompt, gen, obs, *rest = rows[i % len(rows)]
            calls = rest[0] if rest else (1,) * len(obs)
            draws = [] if latency is None else task_latencies(group, latency, sum(calls))
            lat, k = [], 0
            for c in calls:
                lat.append(float(sum(draws[k:k + c])))
                k += c
            out.append(workloads.TaskSample(prompt, tuple(gen), tuple(obs), tuple(lat), False))
        return out
    return sample


def shape_sampler(shapes: dict, latency: tuple[float, float, float] | None):
    """`SimBackend.shape_sampler`: group g is task g // len(KINDS) of kind KINDS[g % len(KINDS)] (the
    controller's `_next_task`), every sample of it the demonstration's shape, latencies drawn per call."""
    def sample(group: int, rng: np.random.Generator, n: int) -> list[workloads.TaskSample]:
        rows = shapes[KINDS[group % len(KINDS)]]
        prompt, gen, obs, _ = rows[(group // len(KINDS)) % len(rows)]
        out = []
        for _ in range(n):
            if latency is None:
                lat = (0.0,) * len(obs)
            else:
                median, sigma, cap = latency
                lat = tuple(float(x) for x in np.minimum(cap, median * np.exp(sigma * rng.standard_normal(len(obs)))))
            out.append(workloads.TaskSample(prompt, gen, obs, lat, False))
        return out
    return sample


def goodput_workload(shapes: dict) -> workloads.Workload:
    """goodput.py's workload as a `Workload` (its distributions only feed CTB's estimates: the task
    shapes come from `shape_sampler`)."""
    every = [r for rows in shapes.values() for r in rows]
    gen = [g for r in every for g in r[1]]
    obs = [o for r in every for o in r[2]]
    return workloads.Workload(
        name="goodput-cpu", source="benchmarks/goodput.py defaults; shapes from the tasks' demonstrations",
        model=costs.shape_from_config(MODEL, "goodput-1m", dtype="float32"), accelerator="h100", devices=8,
        max_turns=8, max_context=1024, prompts_per_step=GROUPS, group_size=GROUP_SIZE,
        prompt_tokens=workloads.Fixed(statistics.mean(r[0] for r in every)),
        turns=workloads.Fixed(round(statistics.mean(len(r[1]) for r in every))),
        tokens_per_turn=workloads.Fixed(statistics.mean(gen)),
        observation_tokens=workloads.Fixed(statistics.mean(obs)),
        env_latency_s=workloads.ClippedLognormal(median=LATENCY[0], sigma=LATENCY[1], high=LATENCY[2]),
        from_paper=(), assumed=workloads.PARAMETERS)


# ------------------------------------------------------------------ calibration (JAX from here on)
