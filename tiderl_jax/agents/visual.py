"""The `visual` task: questions about a small rendered grid of coloured squares, seen through images.

The scene is an 8x8 grid of cells, a few of which hold a red, green, blue or yellow square (the
rest are black). The model never sees it whole and sharp:

- the first observation (the user's message) is a blurred overview: each 2x2 block of cells is
  averaged into one colour, 8x8 pixels in all. It shows roughly where colours are, not exact
  cells or counts;
- the `zoom` tool (`{"quadrant": "top-left" | "top-right" | "bottom-left" | "bottom-right"}`) returns
  that quadrant's 4x4 cells sharply, 4 pixels per cell (16x16 pixels), with its row and column range.

Two kinds of question, both verifiable:

- count: "How many red squares are in the top-right quadrant?" (zoom there, count);
- locate: "Which cell holds the only blue square?" (find its quadrant in the overview, zoom there,
  reply with the row and column in the whole grid).

Images are raw uint8 pixels [height, width, 3]; the rollout patchifies them with the model's patch
size. Sizes are multiples of 8, so patch sizes 1, 2, 4 and 8 all fit; with patch size 4 the overview
is 4 image tokens and a zoom 16, one per cell. A model reads them only if its image_patch_dim is
patch_size**2 * 3 for one of those sizes (`patch_size_of`); a text-only model cannot do this task.
`task.answer` is the expected integers separated by spaces; the reward is 1 when the reply's last
integers are those, else 0.

Seeding and splits are `tasks.py`'s (`tasks.visual_task` draws from its seeded `random.Random`);
this module only knows scenes, images, the tool, the score and the ideal conversation.
"""

from __future__ import annotations

import random
import re
from typing import Any, Mapping

import numpy as np

from tiderl_jax.agents.env import LatencyModel, Observation, Task, ToolEnvironment, ToolError
from tiderl_jax.model import chat, vision
from tiderl_jax.model.config import ConfigError

GRID = 8  # cells per side
CELL_PX = 4  # pixels per cell side in a zoomed quadrant
BLUR = 2  # the overview averages BLUR x BLUR cells into one colour, drawn BLUR pixels wide
COLOURS = {"R": "red", "G": "green", "B": "blue", "Y": "yellow"}
_RGB = {".": (0, 0, 0), "R": (255, 0, 0), "G": (0, 255, 0), "B": (0, 0, 255), "Y": (255, 255, 0)}
QUADRANTS = {"top-left": (0, 0), "top-right": (0, GRID // 2), "bottom-left": (GRID // 2, 0),
             "bottom-right": (GRID // 2, GRID // 2)}  # name -> (first row, first column)
CHANNELS = 3  # RGB
PATCH_SIZES = (1, 2, 4, 8)  # the patch sizes that cut every image (sides 8 and 16 pixels) whole
_HOW = "The image is a blurred overview of the grid; zoom into a quadrant to see it sharply."


def _needs(got: str) -> ConfigError:
    return ConfigError(f"the visual task needs a vision model: set model.image_patch_dim to "
                       f"patch_size**2 * {CHANNELS} for a patch size in {PATCH_SIZES} (48 for patch size 4, "
                       f"with model.max_image_patches >= {max_patches(4)} and model.image_token_id the "
                       f"tokenizer's image placeholder); {got}")


def check_patch_size(patch_size: int) -> None:
    """ConfigError unless `patch_size` is one of PATCH_SIZES; 0 stands for a text-only model."""
    if patch_size not in PATCH_SIZES:
        raise _needs("got a text-only model (patch size 0)" if patch_size == 0
                     else f"got patch size {patch_size}")


def patch_size_of(image_patch_dim: int) -> int:
    """The patch size of a model with `image_patch_dim` (= patch_size**2 * CHANNELS), which this task's
    images are cut with; ConfigError naming the problem when there is none in PATCH_SIZES (0: a
    text-only model)."""
    size = next((p for p in PATCH_SIZES if p * p * CHANNELS == image_patch_dim), 0)
    if not size:
        raise _needs("the model is text-only (image_patch_dim=0)" if image_patch_dim == 0 else
                     f"the model's image_patch_dim={image_patch_dim} is not one of those")
    return size


def max_patches(patch_size: int) -> int:
    """Patches of the largest image (a zoom, 16x16 pixels) at `patch_size`: the model's
    max_image_patches must hold them."""
    return ((GRID // 2) * CELL_PX // patch_size) ** 2


def quadrant_of(row: int, col: int) -> str:
    half = GRID // 2
    return ("top" if row < half else "bottom") + "-" + ("left" if col < half else "right")


def _pixels(grid: list[str]) -> np.ndarray:
    """The grid at one pixel per cell: float [GRID, GRID, 3] in [0, 255]."""
    return np.asarray([[_RGB[c] for c in row] for row in grid], np.float32)


def overview_image(grid: list[str]) -> np.ndarray:
    """The blurred view: BLUR x BLUR cell blocks averaged, each drawn as BLUR x BLUR pixels (uint8)."""
    n = GRID // BLUR
    blocks = _pixels(grid).reshape(n, BLUR, n, BLUR, 3).mean(axis=(1, 3))
    return np.round(blocks).astype(np.uint8).repeat(BLUR, axis=0).repeat(BLUR, axis=1)


def zoom_image(grid: list[str], quadrant: str) -> np.ndarray:
    """One quadrant, sharp: CELL_PX x CELL_PX pixels per cell (uint8)."""
    r0, c0 = QUADRANTS[quadrant]
    half = GRID // 2
    cells = _pixels(grid)[r0:r0 + half, c0:c0 + half]
    return cells.astype(np.uint8).repeat(CELL_PX, axis=0).repeat(CELL_PX, axis=1)


def _zoom_text(quadrant: str) -> str:
    r0, c0 = QUADRANTS[quadrant]
    half = GRID // 2
    return f"{quadrant} quadrant: rows {r0}-{r0 + half - 1}, columns {c0}-{c0 + half - 1}"


def draw_task(rng: random.Random, task_id: str, is_eval: bool) -> Task:
    """One task from `rng` (seeded by the caller): a scene of 4..9 squares and a question about it."""
    cells = rng.sample(range(GRID * GRID), rng.randint(4, 9))
    if rng.random() < 0.5:  # count the target square's colour in its quadrant (so at least 1)
        colours = [rng.choice(list(COLOURS)) for _ in cells]
        colour, quadrant = colours[0], quadrant_of(*divmod(cells[0], GRID))
        count = sum(c == colour and quadrant_of(*divmod(cell, GRID)) == quadrant
                    for cell, c in zip(cells, colours))
        question, answer = "count", str(count)
        prompt = (f"How many {COLOURS[colour]} squares are in the {quadrant} quadrant of the "
                  f"{GRID}x{GRID} grid? {_HOW} Reply with the number.")
    else:  # locate the only square of its colour
        colour = rng.choice(list(COLOURS))
        others = [c for c in COLOURS if c != colour]
        colours = [colour] + [rng.choice(others) for _ in cells[1:]]
        row, col = divmod(cells[0], GRID)
        question, answer, quadrant = "locate", f"{row} {col}", quadrant_of(row, col)
        prompt = (f"Which cell of the {GRID}x{GRID} grid holds the only {COLOURS[colour]} square? "
                  f"{_HOW} Reply with its row and column (0-{GRID - 1}).")
    grid = [["."] * GRID for _ in range(GRID)]
    for cell, c in zip(cells, colours):
        grid[cell // GRID][cell % GRID] = c
    data = {"grid": ["".join(row) for row in grid], "question": question, "colour": COLOURS[colour],
            "quadrant": quadrant}
    return Task(task_id, "visual", prompt, answer, data, is_eval=is_eval)


def score(task: Task, reply: str) -> float:
    """1.0 when the reply's last integers are the answer's (the count, or the row and column)."""
    want = [int(x) for x in task.answer.split()]
    found = [int(x) for x in re.findall(r"-?\d+", reply)]
    return 1.0 if found[-len(want):] == want else 0.0


class VisualEnvironment(ToolEnvironment):
    """The `visual` task's environment: the overview on reset, a `zoom` tool that returns an image."""

    def __init__(self, *, latency: LatencyModel = LatencyModel(), seed: int = 0):
        super().__init__({"zoom": self._zoom}, score, latency=latency, seed=seed)

    async def reset(self, task: Task) -> Observation:
        await super().reset(task)
        return Observation(task.prompt, (overview_image(task.data["grid"]),))

    def _zoom(self, args: Mapping[str, Any]) -> Observation:
        quadrant = args.get("quadrant")
        if not isinstance(quadrant, str) or quadrant not in QUADRANTS:
            raise ToolError(f'zoom needs {{"quadrant": one of {sorted(QUADRANTS)}}}')
        return Observation(_zoom_text(quadrant), (zoom_image(self.task.data["grid"], quadrant),))


def demonstration(task: Task, patch_size: int) -> list[chat.Message]:
    """The ideal turns after the system message: the question with its overview, a zoom into the
    right quadrant, the sharp quadrant, the answer. Images are patchified with `patch_size` (the
    model's; ConfigError when it is not one of PATCH_SIZES, e.g. 0 for a text-only model)."""
    check_patch_size(patch_size)
    grid, quadrant = task.data["grid"], task.data["quadrant"]
    answer = task.answer
    if task.data["question"] == "locate":
        row, col = answer.split()
        answer = f"row {row}, column {col}"
    overview = vision.patchify(overview_image(grid), patch_size)
    zoom = vision.patchify(zoom_image(grid, quadrant), patch_size)
    return [chat.Message("user", task.prompt, images=(overview,)),
            chat.Message("assistant", "", (chat.ToolCall("zoom", {"quadrant": quadrant}),)),
            chat.Message("tool", _zoom_text(quadrant), images=(zoom,)),
            chat.Message("assistant", answer)]
