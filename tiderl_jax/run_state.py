"""The main job's log directory as a run that can be resumed, continued or found finished (JAX-free).

- `config.json`: the resolved config of the latest invocation, readable (`write_config`).
- `run_state.json` (`RunState`): the flattened config and what the finished phases produced
  (`heldout_before`, `rl_summary`, `heldout_after`) and, once `summary.json` is written, `finished`
  (the RL step it reached and where its summary is).

Rules (`launch/train.py` applies them before it builds a model):
- a log directory that holds a run of another configuration is refused, in one line naming every
  differing key (old -> new) and how to start a fresh run; the keys in `RESUMABLE_CHANGES` may change
  (the step budget, how much to evaluate, logging and export), except `eval.tasks` once the held-out
  "before" ran (the "after" must pair with it, task for task);
- a key the run's saved config lacks (the run directory was made before the key existed) is no difference
  while it has its default (the config file's value, `defaults`); set to another value it is one (unless
  it is in `RESUMABLE_CHANGES`);
- a finished run whose step budget is not raised is reported finished, nothing re-run or overwritten;
- raising `controller.steps` continues a finished run: its summary is kept as `summary.<steps>_steps.json`
  and the new one replaces it at the end.
"""

from __future__ import annotations

import json
import os

from tiderl_jax.model.config import ConfigError, read_json_object

# keys a resumed run may change (how long to train, how much to evaluate, where progress and exports go)
RESUMABLE_CHANGES = ("controller.steps", "eval.", "sft.log_every", "export_every_checkpoint")
# ... except these, once the phase named has run (its result must stay comparable)
FIXED_AFTER = {"eval.tasks": "heldout_before"}
_ABSENT = "(not set)"


def flat(d: dict, prefix: str = "") -> dict:
    """A nested config dict as {"a.b": value}; values that are not JSON scalars as their repr."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v if isinstance(v, (int, float, str, bool, type(None))) else repr(v)
    return out


def _show(v) -> str:
    """A flattened value as the user would write it (tuples are stored as their repr already)."""
    if v is _ABSENT or (isinstance(v, str) and v[:1] and v[:1] in "([{"):
        return str(v)
    return repr(v)


def config_changes(old: dict, new: dict, phases_done=(), defaults: dict | None = None) -> list[tuple[str, object, object]]:
    """(key, old, new) for every key of the flattened configs that differs and may not (module docstring).
    `defaults`: the flattened config file's own values; a key the old run's config lacks (it was written
    before the key existed) counts as unchanged when its new value is the default."""
    defaults = defaults or {}
    keys = sorted(set(old) | set(new))
    return [(k, old.get(k, _ABSENT), new.get(k, _ABSENT)) for k in keys
            if old.get(k, _ABSENT) != new.get(k, _ABSENT) and k != "logdir"
            and not (k not in old and k in new and k in defaults and new[k] == defaults[k])
            and (not k.startswith(RESUMABLE_CHANGES) or FIXED_AFTER.get(k) in phases_done)]


def write_config(logdir: str, config: dict) -> str:
    """Writes the resolved config (tuples as lists) to `logdir/config.json`; returns its path."""
    os.makedirs(logdir, exist_ok=True)
    path = os.path.join(logdir, "config.json")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(config, f, indent=1, sort_keys=True, default=repr)
        f.write("\n")
    os.replace(tmp, path)
    return path


class RunState:
    """`run_state.json` in the log directory: the run's config and what its finished phases produced."""

    def __init__(self, logdir: str, config: dict, defaults: dict | None = None, write: bool = True):
        """`write=False`: kept in memory only (a multi-process run's processes but the first)."""
        self.write = write
        self.logdir = logdir
        self.path = os.path.join(logdir, "run_state.json")
        self.config = flat(config)
        self.defaults = flat(defaults or {})  # the config file's own values (`config_changes`)
        self.data = {}
        if os.path.exists(self.path):
            try:
                self.data = read_json_object(self.path)
            except OSError as e:
                raise ConfigError(f"{self.path}: unreadable ({e}); delete the log directory to start over") from None
            except ConfigError as e:  # truncated or corrupt
                raise ConfigError(f"{e}; delete the log directory to start over") from None

    def check_same_run(self) -> None:
        """A resume must continue the same run: a different config in the same log directory is refused,
        naming every differing key."""
        old = self.data.get("config")
        if old is None:
            return
        diff = config_changes(old, self.config, [p for p in FIXED_AFTER.values() if p in self.data], self.defaults)
        if diff:
            shown = ", ".join(f"{k}: {_show(a)} -> {_show(b)}" for k, a, b in diff)
            raise ConfigError(f"{self.logdir} holds a run of another configuration ({shown}); resume it with "
                              f"its own settings (only {', '.join(RESUMABLE_CHANGES)} may change), or start a "
                              f"fresh run with another --config.logdir or after deleting {self.logdir}")

    def finished(self) -> dict | None:
        """{"steps": RL steps reached, "summary": path} of a finished run, else None. A run_state.json
        written before the `finished` entry existed counts as finished when it holds the held-out
        "after" and its summary.json exists (it reached its own config's step budget then)."""
        if "finished" in self.data:
            return self.data["finished"]
        summary = os.path.join(self.logdir, "summary.json")
        old = self.data.get("config", {})
        if "heldout_after" in self.data and os.path.exists(summary) and "controller.steps" in old:
            return {"steps": old["controller.steps"], "summary": summary}
        return None

    def continue_finished(self, done: dict) -> str | None:
        """A finished run continues (a raised step budget): its held-out "after" and `finished` go, its
        summary.json is kept as summary.<steps>_steps.json. Returns that path (None if it had none)."""
        self.data.pop("finished", None)
        self.data.pop("heldout_after", None)
        self.save()
        summary = os.path.join(self.logdir, "summary.json")
        if not os.path.exists(summary):
            return None
        kept = os.path.join(self.logdir, f"summary.{done['steps']}_steps.json")
        if not self.write:
            return kept
        os.replace(summary, kept)
        return kept

    def save(self, **updates) -> None:
        self.data.update(updates, config=self.config)
        if not self.write:
            return
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.data, f)
        os.replace(tmp, self.path)
