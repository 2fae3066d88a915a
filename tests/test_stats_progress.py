"""The before / after statistics against their normal-approximation reference, and the progress lines."""

import io

import numpy as np
import pytest

from tiderl_jax.progress import Progress, format_seconds
from tiderl_jax.rl.stats import paired_bootstrap, reference_paired_ci


def test_paired_bootstrap_agrees_with_the_normal_interval_on_binary_rewards():
    rng = np.random.default_rng(0)
    before = (rng.random(256) < 0.5).astype(float)
    after = np.where(rng.random(256) < 0.3, 1.0, before)  # some tasks flip to solved
    d, lo, hi = paired_bootstrap(before, after, seed=1)
    rd, rlo, rhi = reference_paired_ci(before, after)
    assert d == pytest.approx(rd) and lo < d < hi
    assert lo == pytest.approx(rlo, abs=0.015) and hi == pytest.approx(rhi, abs=0.015)
    assert lo > 0  # a real improvement of ~0.15 on 256 tasks is resolved


def test_paired_bootstrap_of_identical_results_is_zero_and_bad_input_is_refused():
    assert paired_bootstrap([1, 0, 1], [1, 0, 1]) == (0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="equal-length"):
        paired_bootstrap([1, 0], [1])


def test_progress_lines_show_global_step_rate_and_eta():
    out = io.StringIO()
    bar = Progress("warm start", 100, start=50, every=25, stream=out, tty=False)
    for i in range(51, 101):
        bar.update(i, nll=0.5)
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and lines[0].startswith("warm start step 75/100 (75%): nll 0.500 |")
    assert "step/s" in lines[0] and "ETA" in lines[0] and lines[1].endswith("ETA 0s")
    tty = io.StringIO()
    bar = Progress("held-out", 4, unit="task", stream=tty, tty=True)
    bar.update(4)
    bar.print("done")
    assert "\r" in tty.getvalue() and "[####################] 4/4" in tty.getvalue() and "\ndone\n" in tty.getvalue()
    assert format_seconds(3725) == "1h02m" and format_seconds(75) == "1m15s" and format_seconds(float("nan")) == "?"
