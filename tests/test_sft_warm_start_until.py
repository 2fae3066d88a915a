"""`sft.warm_start_until` (the main job's warm start): SFT in chunks until the sampled policy reaches the
target on the probe tasks, checked every `probe_every` steps from `min_steps` on, or the step cap."""

from tiderl_jax.rl import sft


def _run(monkeypatch, successes, target=0.25, **kw):
    """SFT stubbed (one NLL per step); probe i returns `successes[i]`."""
    chunks, probes = [], iter(successes)

    def warm_start(trainer, tok, kinds, n, batch, seed, log_every, first_task, progress=None, shortcut_rate=0.0):
        assert shortcut_rate == kw.get("shortcut_rate", 0.0)
        chunks.append((n, first_task))
        return [1.0] * n
    monkeypatch.setattr(sft, "warm_start", warm_start)
    calls = []

    def probe():
        calls.append(1)
        return next(probes)
    curve = sft.warm_start_until(None, None, ["calculator"], 100, 4, probe=probe, target=target,
                                 **{**dict(min_steps=30, probe_every=10), **kw}, log=lambda line: None)
    return curve, chunks, len(calls)


def test_the_warm_start_stops_at_the_first_probe_that_reaches_the_target(monkeypatch):
    curve, chunks, probes = _run(monkeypatch, [0.0, 0.125, 0.25, 1.0])
    # probes at 30, 40, 50: the third reaches 0.25; each chunk continues the demonstration stream
    assert len(curve) == 50 and probes == 3
    assert chunks == [(10, 0), (10, 40), (10, 80), (10, 120), (10, 160)]


def test_the_warm_start_stops_at_its_cap_and_without_a_target_runs_it_whole(monkeypatch):
    curve, _, probes = _run(monkeypatch, [0.0] * 10)
    assert len(curve) == 100 and probes == 7  # probes at 30..90; none at the cap
    curve, chunks, probes = _run(monkeypatch, [], target=0.0)
    assert len(curve) == 100 and chunks == [(100, 0)] and probes == 0
    assert len(_run(monkeypatch, [], target=0.0, shortcut_rate=0.4)[0]) == 100  # passed on to every chunk


def test_the_imperfect_demonstrators_shortcuts_are_what_the_steps_train_on():
    """`shortcut_rate`: the demonstrations `takes_shortcut` picks are the shortcut conversation, tokens and loss mask,
    the rest the ideal one; the same stream of tasks either way."""
    import types

    from tiderl_jax.model.tokenizer import Tokenizer
    from tiderl_jax.rl.trainer_config import TrainerConfig

    seen = []
    trainer = types.SimpleNamespace(config=TrainerConfig(row_len=576, micro_rows=8), patch_dim=0,
                                    sft_step=lambda packed: seen.append(packed) or {"nll": 1.0})
    tok = Tokenizer.builtin()
    sft.warm_start(trainer, tok, ("calculator", "lookup"), 2, 16, shortcut_rate=0.5)
    stream = sft.train_tasks(("calculator", "lookup"), 0, 32, 0)
    shortcut = [sft.takes_shortcut(t, 0.5) for t in stream]
    assert 0 < sum(shortcut) < 32
    for packed, tasks in zip(seen, (stream[:16], stream[16:])):
        want = [sft.demonstration_trajectory(t, tok, shortcut=sft.takes_shortcut(t, 0.5)) for t in tasks]
        assert sorted(packed.kept) == list(range(16))
        for j, i in enumerate(packed.kept):
            assert packed.per_token("tokens", j).tolist() == want[i].tokens
            assert packed.per_token("mask", j).tolist() == [float(m) for m in want[i].loss_mask]
    short = [t for t in stream if sft.takes_shortcut(t, 0.5)]
    assert all(len(sft.demonstration_trajectory(t, tok, shortcut=True).tokens)
               < len(sft.demonstration_trajectory(t, tok).tokens) for t in short)
