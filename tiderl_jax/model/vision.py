"""Images in the token stream: pixels -> patches, where patches sit in a sequence, the decoder's inputs.

A vision model (`ModelConfig.image_patch_dim > 0`) reads an image as N patches placed on N
consecutive positions of its token sequence, each holding the image placeholder token
(`image_token_id`, `<|image_pad|>` in the built-in tokenizer). At those positions the decoder adds
the patch embedding instead of the token embedding (`decoder.PatchEmbed`):

    tokens   ... user \\n <img> <img> <img> <img> \\n what digit ...
    images   ImageSpan(offset=3, patches [4, patch_dim])

An `ImageSpan` says where one image sits (its first position) and carries its patches, so the same
value serves the chat template (`chat.encode` returns spans relative to its ids), the engine
(`Request.images`, `Engine.resume(..., images=)`: relative to the tokens being added) and a training
forward (`dense_inputs` over a whole sequence). A placeholder token that no span covers is plain text:
it keeps its token embedding, as does one the model samples itself (generated tokens are text).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from tiderl_jax.model.config import ModelConfig


def patchify(image: np.ndarray, patch_size: int) -> np.ndarray:
    """An image [height, width, channels] -> its patches [N, patch_size**2 * channels], float32 in [0, 1].

    uint8 pixels are divided by 255; float pixels must already lie in [0, 1]. Patches are in raster
    order (left to right, then top to bottom); each is flattened row by row, channels last.
    """
    image = np.asarray(image)
    if image.ndim != 3:
        raise ValueError(f"image must be [height, width, channels], got shape {image.shape}")
    if patch_size <= 0:
        raise ValueError(f"patch_size={patch_size} must be positive")
    h, w, c = image.shape
    if h == 0 or w == 0 or h % patch_size or w % patch_size:
        raise ValueError(f"image of {h}x{w} pixels does not split into {patch_size}x{patch_size} "
                         f"patches: height and width must be positive multiples of {patch_size}")
    if image.dtype == np.uint8:
        pixels = image.astype(np.float32) / 255.0
    elif np.issubdtype(image.dtype, np.floating):
        pixels = image.astype(np.float32)
        if not (np.isfinite(pixels).all() and pixels.min() >= 0.0 and pixels.max() <= 1.0):
            raise ValueError("float image pixels must lie in [0, 1]")
    else:
        raise ValueError(f"image dtype {image.dtype} is not uint8 or float")
    p = patch_size
    grid = pixels.reshape(h // p, p, w // p, p, c).transpose(0, 2, 1, 3, 4)
    return np.ascontiguousarray(grid.reshape((h // p) * (w // p), p * p * c))


@dataclasses.dataclass(frozen=True, eq=False)
class ImageSpan:
    """One image in a token sequence: patch i sits at position `offset + i`.

    `patches` [N, patch_dim] is kept as a read-only float32 copy, so what the engine hashes into its
    prefix cache cannot change behind its back.
    """

    offset: int
    patches: np.ndarray

    def __post_init__(self):
        patches = np.array(self.patches, np.float32)  # a copy
        if patches.ndim != 2:
            raise ValueError(f"image patches must be [num_patches, patch_dim], got shape {patches.shape}")
        patches.setflags(write=False)
        object.__setattr__(self, "patches", patches)
        object.__setattr__(self, "offset", int(self.offset))

    @property
    def end(self) -> int:
        """One past the position of the last patch."""
        return self.offset + len(self.patches)

    def __repr__(self):
        return f"ImageSpan(offset={self.offset}, patches={list(self.patches.shape)})"

    def shifted(self, by: int) -> "ImageSpan":
        """The same image `by` positions later (e.g. after tokens prepended to its sequence)."""
        return dataclasses.replace(self, offset=self.offset + by)


def check_images(tokens: Sequence[int], images: Sequence[ImageSpan], cfg: ModelConfig) -> None:
    """Raises ValueError naming the first problem of `images` placed over `tokens` for model `cfg`.

    Every span must lie inside the tokens, on placeholder tokens only, without overlapping another,
    with 1..max_image_patches finite patches of image_patch_dim values. A text-only model accepts
    no image.
    """
    if not images:
        return
    if not cfg.is_vision:
        raise ValueError("the model is text-only (image_patch_dim=0): it takes no images")
    patch_dim, max_patches = cfg.image_patch_dim, cfg.max_image_patches
    end = 0
    for im in sorted(images, key=lambda im: im.offset):
        where = f"image at offset {im.offset}"
        n, dim = im.patches.shape
        if dim != patch_dim:
            raise ValueError(f"{where} has patches of {dim} values; the model's image_patch_dim "
                             f"is {patch_dim}")
        if not 1 <= n <= max_patches:
            raise ValueError(f"{where} has {n} patches; the model takes 1..{max_patches} per image")
        if im.offset < 0 or im.end > len(tokens):
            raise ValueError(f"{where} spans positions {im.offset}..{im.end - 1}, outside the "
                             f"{len(tokens)} tokens")
        if im.offset < end:
            raise ValueError(f"{where} overlaps the previous image (which ends at {end - 1})")
        end = im.end
        wrong = [i for i in range(im.offset, im.end) if tokens[i] != cfg.image_token_id]
        if wrong:
            raise ValueError(f"{where}: positions {wrong[:4]} hold tokens {[tokens[i] for i in wrong[:4]]}, "
                             f"not the image token {cfg.image_token_id} (one placeholder per patch)")
        if not np.isfinite(im.patches).all():
            raise ValueError(f"{where} has non-finite patch values")


def _overlaps(images: Sequence[ImageSpan], start: int, end: int):
    """(image, lo, hi) for each image with positions in [start, end): it covers [lo, hi) of them."""
    for im in images:
        lo, hi = max(start, im.offset), min(end, im.end)
        if lo < hi:
            yield im, lo, hi


def dense_inputs(images: Sequence[ImageSpan], start: int, end: int,
                 patch_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """The decoder's image inputs for positions [start, end) of a sequence holding `images`.

    Returns patches [end - start, patch_dim] float32 (zeros off images) and patch_index
    [end - start] int32: each patch's index within its image, -1 at positions that are not patches.
    A chunk may start or end inside an image: its patches keep their indices.
    """
    patches = np.zeros((end - start, patch_dim), np.float32)
    index = np.full(end - start, -1, np.int32)
    for im, lo, hi in _overlaps(images, start, end):
        patches[lo - start:hi - start] = im.patches[lo - im.offset:hi - im.offset]
        index[lo - start:hi - start] = np.arange(lo - im.offset, hi - im.offset)
    return patches, index


def content_key(images: Sequence[ImageSpan], start: int, end: int) -> bytes:
    """Bytes that identify the image content at positions [start, end); b"" where there is none.

    The engine hashes them into a prefix-cache block's key, so two blocks with the same placeholder
    tokens but different images never share KV.
    """
    parts = []
    for im, lo, hi in _overlaps(images, start, end):
        parts.append(np.asarray([lo - start, hi - start, lo - im.offset], np.int64).tobytes())
        parts.append(im.patches[lo - im.offset:hi - im.offset].tobytes())
    return b"".join(parts)
