"""Images in a token sequence: multimodal RoPE positions and the image-feature scatter.

Pure torch (no megatron-core, no transformers), shared by the vision-language model
(:mod:`megatron_rl.models.vision_language`) and its parity checks.

* :func:`mrope_position_ids` -- the three position rows (temporal, height, width) of one sequence, as
  transformers' Qwen2.5-VL ``get_rope_index`` computes them for images: text tokens count up by one in all
  three rows; an image's ``t x (h / m) x (w / m)`` pad tokens (``m`` the vision merger's
  ``spatial_merge_size``) take ``start + (ti, hi, wi)``, and the text after it resumes at
  ``start + max(h, w) / m``.
* :func:`check_image_tokens` -- a sample whose image-pad token count disagrees with its images' features
  (``image_grid_thw``) is refused by name, before the vision tower runs: scattering would otherwise put
  features at the wrong tokens, or fail deep inside the model (slime's "image features and tokens do not match").
* :func:`scatter_image_features` -- the features replace the pad tokens' embeddings, in order. Done on the
  whole sequence, before any sequence-parallel or context-parallel split, so no rank ever holds a pad token
  without its feature.
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_rl.errors import ConfigError


def image_token_counts(image_grid_thw: torch.Tensor, spatial_merge_size: int) -> list[int]:
    """Pad tokens (merged features) per image: ``t * h * w / m^2``."""
    grid = image_grid_thw.reshape(-1, 3).tolist()
    return [int(t) * int(h) * int(w) // spatial_merge_size ** 2 for t, h, w in grid]


def _image_runs(input_ids: torch.Tensor, image_token_id: int) -> list[tuple[int, int]]:
    """(start, end) of each maximal run of image-pad tokens in a 1-D sequence."""
    is_image = (input_ids == image_token_id).to(torch.int8)
    edges = torch.diff(is_image, prepend=is_image.new_zeros(1), append=is_image.new_zeros(1))
    starts = torch.nonzero(edges == 1).flatten().tolist()
    ends = torch.nonzero(edges == -1).flatten().tolist()
    return list(zip(starts, ends))


def check_image_tokens(input_ids: torch.Tensor, image_grid_thw: Optional[torch.Tensor], image_token_id: int,
                       spatial_merge_size: int, sample: str = "sample", pixel_rows: Optional[int] = None,
                       pixel_shape: Optional[tuple[int, ...]] = None, patch_dim: Optional[int] = None) -> list[int]:
    """Refuse (``ConfigError`` naming ``sample``) a sequence whose image-pad tokens do not match its images:
    each run of pad tokens must be exactly one image's ``t * h * w / m^2`` features, in order, and
    ``pixel_rows`` (the rows of ``pixel_values``, when given) must be the grids' ``sum(t * h * w)`` patches.
    ``input_ids``: ``[s]`` or ``[b, s]`` (the images of row 0 first). ``pixel_shape`` / ``patch_dim``: the
    ``pixel_values`` shape must be ``[patches, patch_dim]`` (channels x temporal patch x patch^2 of the tower).
    Each grid's height and width must be multiples of ``spatial_merge_size`` (the merger joins m x m patches).
    Returns the tokens per image."""
    grid = image_grid_thw.reshape(-1, 3).tolist() if image_grid_thw is not None else []
    odd = [g for g in grid if int(g[1]) % spatial_merge_size or int(g[2]) % spatial_merge_size or min(g) < 1]
    if odd:
        raise ConfigError(f"{sample}: image_grid_thw {odd} are not positive grids whose height and width are "
                          f"multiples of spatial_merge_size {spatial_merge_size}; pass the model's own processor's "
                          "image_grid_thw")
    if pixel_shape is not None and patch_dim is not None and (len(pixel_shape) != 2 or pixel_shape[1] != patch_dim):
        raise ConfigError(f"{sample}: pixel_values has shape {list(pixel_shape)}, the vision tower takes [patches, "
                          f"{patch_dim}] (channels x temporal patch x patch^2); pass the model's own processor's "
                          "pixel_values")
    counts = image_token_counts(image_grid_thw, spatial_merge_size) if image_grid_thw is not None else []
    rows = input_ids.reshape(-1, input_ids.shape[-1]) if input_ids.numel() else input_ids.reshape(1, 0)
    runs = [end - start for row in rows for start, end in _image_runs(row, image_token_id)]
    if runs != counts:
        raise ConfigError(f"{sample}: its image-pad tokens (id {image_token_id}) come in runs of {runs} but its "
                          f"{len(counts)} image(s) (image_grid_thw {grid}, spatial_merge_size "
                          f"{spatial_merge_size}) give {counts} features; each image needs exactly its t*h*w/"
                          f"merge^2 pad tokens, in order (the processor's chat template writes them); fix the "
                          f"sample's prompt or its images")
    if pixel_rows is not None and image_grid_thw is not None:
        patches = sum(int(t) * int(h) * int(w) for t, h, w in grid)
        if pixel_rows != patches:
            raise ConfigError(f"{sample}: pixel_values has {pixel_rows} patch rows but image_grid_thw {grid} "
                              f"needs {patches}; pass the processor's pixel_values and image_grid_thw together")
    return counts


def mrope_position_ids(input_ids: torch.Tensor, image_grid_thw: Optional[torch.Tensor], image_token_id: int,
                       spatial_merge_size: int, sample: str = "sample") -> torch.Tensor:
    """``[3, s]`` long positions (temporal, height, width) of the 1-D sequence ``input_ids``."""
    ids = input_ids.reshape(-1)
    check_image_tokens(ids, image_grid_thw, image_token_id, spatial_merge_size, sample)
    grids = image_grid_thw.reshape(-1, 3).tolist() if image_grid_thw is not None else []
    pieces, pos, cursor = [], 0, 0
    for (start, end), (t, h, w) in zip(_image_runs(ids, image_token_id), grids):
        if start > cursor:  # text before the image
            pieces.append(torch.arange(start - cursor).expand(3, -1) + pos)
            pos += start - cursor
        gh, gw = int(h) // spatial_merge_size, int(w) // spatial_merge_size
        tt, hh, ww = torch.meshgrid(torch.arange(int(t)), torch.arange(gh), torch.arange(gw), indexing="ij")
        pieces.append(torch.stack([tt, hh, ww]).reshape(3, -1) + pos)
        pos += max(int(h), int(w)) // spatial_merge_size
        cursor = end
    if len(ids) > cursor:
        pieces.append(torch.arange(len(ids) - cursor).expand(3, -1) + pos)
    return torch.cat(pieces, dim=1).long() if pieces else torch.zeros(3, 0, dtype=torch.long)


def scatter_image_features(embeddings: torch.Tensor, input_ids: torch.Tensor, features: torch.Tensor,
                           image_token_id: int, sample: str = "sample") -> torch.Tensor:
    """``embeddings`` ``[s, b, h]`` (megatron's layout) with the pad tokens' rows replaced by ``features``
    ``[n, h]`` in sequence order (batch row by batch row); autograd reaches both. ``input_ids`` ``[b, s]``."""
    mask = (input_ids == image_token_id).transpose(0, 1)  # [s, b]
    n = int(mask.sum())
    if n != features.shape[0]:
        raise ConfigError(f"{sample}: {n} image-pad tokens (id {image_token_id}) but the vision tower gave "
                          f"{features.shape[0]} features; each image needs exactly its t*h*w/merge^2 pad tokens")
    if n == 0:
        return embeddings
    # batch-major order of the features, as the tokens are read: [b, s] -> positions of the pad tokens
    order = torch.nonzero((input_ids == image_token_id).reshape(-1)).flatten()
    b, s = input_ids.shape
    rows = (order % s) * b + order // s  # their rows in the [s * b] flattening of the [s, b] layout
    flat = embeddings.reshape(s * b, -1)
    out = flat.index_put((rows,), features.to(flat.dtype))
    return out.reshape(embeddings.shape)
