"""`sft.warm_start_until` (the main job's warm start): SFT in chunks until the sampled policy reaches the
target on the probe tasks, checked every `probe_every` steps from `min_steps` on, or the step cap."""

from tiderl_jax.rl import sft


def _run(monkeypatch, successes, target=0.25, **kw):
    """SFT stubbed (one NLL per step); probe i returns `successes[i]`."""
    chunks, probes = [], iter(successes)

    def warm_start(trainer, tok, kinds, n, batch, seed, log_every, first_task, progress=None):
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
