"""Images in prompt data: slime's ``--multimodal-keys`` and verl's parquet ``images`` column, turned into the
vision inputs a vision-language model takes, once, on the driver.

``--multimodal-keys '{"image": "images"}'`` (slime's JSON map from a modality to the prompt record's column;
verl's ``data.image_key``, whose default is ``images``) names where a record keeps its images: one image or a
list of them. An image is given as

* a file path (absolute, relative to the working directory, or relative to the prompt file's directory; a
  ``file://`` prefix is dropped), as slime's and verl's datasets store them;
* raw bytes of an encoded image (PNG, JPEG, ...; a parquet ``binary`` cell);
* a base64 string of those bytes, with or without a ``data:image/...;base64,`` prefix;
* verl's dict ``{"bytes": ..., "path": ...}`` (HF datasets' ``Image`` feature, as verl's geo3k preprocessing
  writes it): its bytes if it has them, else its path.

Each image is decoded with PIL (converted to RGB) and the model's own image processor (``AutoImageProcessor``
from the ``--hf-checkpoint`` directory's ``preprocessor_config.json``, never the hub) resizes it between the
processor's pixel bounds and cuts it into patches: ``pixel_values`` ``[patches, C * temporal_patch * patch^2]``
(float32) and ``image_grid_thw`` ``[images, 3]`` (int64), as transformers' Qwen2.5-VL processor gives them.

The prompt holds one image-pad token (the model's ``image_token_id``; the chat template writes it between the
vision-start and vision-end tokens) per image, in image order. verl's ``<image>`` marker in a text or chat prompt
(as its geo3k preprocessing writes it) is first replaced by the model's image slot, the tokenizer's text for
vision-start, image-pad, vision-end (``<|vision_start|><|image_pad|><|vision_end|>``), as verl's dataset and the
processor's chat template do between them. Like transformers' processor, each is expanded
to the image's ``t * h * w / merge^2`` pad tokens, the number of features the vision tower's merger gives it,
so the expanded prompt is what the model checks (``models/mrope.py::check_image_tokens``) and
``--rollout-max-prompt-len`` counts the image's tokens. Why on token ids and not the processor's text path: the
prompt is already tokenized (text, chat or token ids alike), and the expansion is one rule; the full
``AutoProcessor`` also wants a video processor (torchvision) that image prompts never use.

Refused before any work, by file and line (or row), column and image: an image that cannot be read or decoded,
one larger than ``MAX_DECODED_PIXELS`` before resizing (read from the image's header, before its pixels are
decoded: a decompression bomb costs nothing), and
a prompt whose image-pad tokens are not one per image.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import os
from typing import Any, Optional, Sequence

import numpy as np

from megatron_rl.config.multimodal import FLAG, parse_multimodal_keys
from megatron_rl.errors import ConfigError

#: the largest image decoded (width x height, before the processor resizes it): 8192 x 8192. Larger ones are
#: refused by name; PIL's own check only warns up to twice its limit
MAX_DECODED_PIXELS = 8192 * 8192


class VisionInputs:
    """A prompt's images as the model takes them: ``pixel_values`` ``[patches, patch_width]`` float32 and
    ``image_grid_thw`` ``[images, 3]`` int64 (temporal, height, width patches of each image, in prompt order), and
    ``sources``: each image's encoded bytes as the data gave them (PNG, JPEG, ...), what an engine served over
    HTTP receives (SGLang's ``image_data``) and processes again with the same processor; None when the pixels
    were made without them (then only the in-process engine can take them).

    A plain class with exact equality of what the model takes (dtype, shape and every value of the pixels and grids;
    the sources are how they travel, not compared) and numpy state, so a
    ``Sample`` holding one compares and pickles exactly (rollout checkpoints, async buffers and debug dumps pickle
    samples; the sample codec pickles the field in its header) and ``dataclasses.asdict`` keeps it whole."""

    __slots__ = ("pixel_values", "image_grid_thw", "sources")

    def __init__(self, pixel_values: Any, image_grid_thw: Any, sources: Optional[Sequence[bytes]] = None):
        pixel_values, image_grid_thw = np.asarray(pixel_values), np.asarray(image_grid_thw)
        if pixel_values.ndim != 2 or pixel_values.dtype.kind != "f":
            raise ValueError(f"pixel_values must be a float array [patches, patch_width], got {pixel_values.dtype} "
                             f"{pixel_values.shape}")
        if image_grid_thw.ndim != 2 or image_grid_thw.shape[1] != 3 or image_grid_thw.dtype.kind not in "iu":
            raise ValueError(f"image_grid_thw must be an integer array [images, 3], got {image_grid_thw.dtype} "
                             f"{image_grid_thw.shape}")
        patches = int(image_grid_thw.prod(axis=1).sum())
        if patches != pixel_values.shape[0]:
            raise ValueError(f"pixel_values has {pixel_values.shape[0]} rows; image_grid_thw {image_grid_thw.tolist()}"
                             f" gives {patches} patches")
        if sources is not None and len(sources) != image_grid_thw.shape[0]:
            raise ValueError(f"sources has {len(sources)} image(s); image_grid_thw {image_grid_thw.shape[0]}")
        self.pixel_values = pixel_values
        self.image_grid_thw = image_grid_thw
        self.sources: Optional[tuple[bytes, ...]] = None if sources is None else tuple(bytes(b) for b in sources)

    @property
    def num_images(self) -> int:
        return int(self.image_grid_thw.shape[0])

    def tokens_per_image(self, merge_size: int) -> list[int]:
        """The image-pad tokens (merged features) of each image: ``t * h * w / merge_size^2``."""
        return [int(t * h * w) // merge_size ** 2 for t, h, w in self.image_grid_thw.tolist()]

    def data_urls(self) -> list[str]:
        """Each image as a ``data:`` URL of its encoded bytes: the items of SGLang's ``image_data`` for one
        request. ``ValueError`` when the images came without their bytes (``sources`` None)."""
        if self.sources is None:
            raise ValueError("these images carry no encoded bytes (VisionInputs made from pixels alone), so they "
                             "cannot be sent to an engine over HTTP; read them through --multimodal-keys")
        return [f"data:{image_mime(b)};base64,{base64.b64encode(b).decode('ascii')}" for b in self.sources]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, VisionInputs) and all(
            a.dtype == b.dtype and a.shape == b.shape and bool(np.array_equal(a, b))
            for a, b in ((self.pixel_values, other.pixel_values), (self.image_grid_thw, other.image_grid_thw)))

    __hash__ = None  # type: ignore[assignment]  # mutable arrays, like Sample's list fields

    def __repr__(self) -> str:
        return (f"VisionInputs(images={self.num_images}, grids={self.image_grid_thw.tolist()}, "
                f"pixel_values={self.pixel_values.dtype} {tuple(self.pixel_values.shape)}"
                f"{'' if self.sources is None else ', with their bytes'})")

    def __getstate__(self):
        return self.pixel_values, self.image_grid_thw, self.sources

    def __setstate__(self, state) -> None:
        self.pixel_values, self.image_grid_thw = state[:2]
        self.sources = state[2] if len(state) > 2 else None  # pickled before the sources were kept: none


#: an encoded image's leading bytes -> its MIME type (what a data: URL names; SGLang and our server read the bytes)
_MAGIC = ((b"\x89PNG", "image/png"), (b"\xff\xd8", "image/jpeg"), (b"GIF8", "image/gif"), (b"BM", "image/bmp"),
          (b"II*\x00", "image/tiff"), (b"MM\x00*", "image/tiff"))


def image_mime(data: bytes) -> str:
    """The MIME type of encoded image bytes (``image/webp`` for RIFF/WEBP), ``application/octet-stream`` if unknown."""
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    return next((mime for magic, mime in _MAGIC if data.startswith(magic)), "application/octet-stream")


def image_list(value: Any) -> list:
    """A record's image column as a list: None (no images), one image, or a list / tuple of them."""
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return list(value)
    return [value]


def _read_file(path: str, base_dir: Optional[str], where: str) -> bytes:
    path = path[len("file://"):] if path.startswith("file://") else path
    candidates = [path]
    if base_dir and not os.path.isabs(path):
        candidates.append(os.path.join(base_dir, path))
    for candidate in candidates:
        if os.path.isfile(candidate):
            try:
                with open(candidate, "rb") as f:
                    return f.read()
            except OSError as exc:
                raise ConfigError(f"{where}: image file {candidate} cannot be read ({exc.strerror}); check its "
                                  "permissions") from None
    tried = " or ".join(candidates)
    raise ConfigError(f"{where}: no image file {tried}; give an existing path (absolute, or relative to the working "
                      "directory or to the prompt file), the image's bytes or base64")


def _is_file(path: str, base_dir: Optional[str]) -> bool:
    return os.path.isfile(path) or bool(base_dir and not os.path.isabs(path)
                                        and os.path.isfile(os.path.join(base_dir, path)))


def _looks_like_path(text: str) -> bool:
    return text.startswith(("file://", "/", "./", "../")) or os.path.splitext(text)[1].lower() in (
        ".png", ".jpg", ".jpeg", ".gif", ".bmp", ".webp", ".tif", ".tiff")


def image_bytes(value: Any, where: str, base_dir: Optional[str] = None) -> bytes:
    """The encoded bytes of one image as a prompt record gives it (module docstring); ``ConfigError`` naming
    ``where`` for a missing file, a string that is neither a file nor base64, and a value of another type."""
    if isinstance(value, dict):
        if value.get("bytes") is not None:
            return image_bytes(value["bytes"], where, base_dir)
        if value.get("path"):
            return _read_file(str(value["path"]), base_dir, where)
        raise ConfigError(f"{where}: an image dict needs 'bytes' or 'path' (verl's / HF datasets' image form), got "
                          f"keys {sorted(value)}")
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, str):
        if value.startswith("data:"):
            head, _, data = value.partition(",")
            if not head.endswith(";base64"):
                raise ConfigError(f"{where}: a data: URL image must be base64 ('data:image/png;base64,...'), got "
                                  f"{head[:40]!r}")
            value = data
        elif value.startswith("file://") or _is_file(value, base_dir):
            return _read_file(value, base_dir, where)
        try:  # base64 before the path rules: a JPEG's base64 starts with "/9j/", which looks like a path
            return base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            if _looks_like_path(value):
                return _read_file(value, base_dir, where)  # raises naming the missing file
            raise ConfigError(f"{where}: {value[:60]!r} is neither an image file nor base64; give a path to an "
                              "image file, its bytes or its base64") from None
    raise ConfigError(f"{where}: an image is a file path, bytes, base64 text or a {{'bytes'|'path'}} dict; got a "
                      f"{type(value).__name__}")


def encoded_image(value: Any, where: str, base_dir: Optional[str] = None) -> bytes:
    """``image_bytes`` of a record's image; a ``PIL.Image`` given in memory is encoded as PNG (lossless: the same
    pixels decode back)."""
    if type(value).__module__.startswith("PIL."):
        buf = io.BytesIO()
        (value if value.mode in ("1", "L", "LA", "I", "P", "RGB", "RGBA") else value.convert("RGB")).save(buf, "PNG")
        return buf.getvalue()
    return image_bytes(value, where, base_dir)


def decode_image(value: Any, where: str, base_dir: Optional[str] = None, max_pixels: Optional[int] = None):
    """One image of a record as an RGB ``PIL.Image``; ``ConfigError`` naming ``where`` when it cannot be read or
    decoded, or holds more than ``max_pixels`` pixels (checked from its header, before the pixels are decoded)."""
    from PIL import Image, UnidentifiedImageError  # lazy: only prompt data with images needs PIL

    if isinstance(value, Image.Image):
        image = value
    else:
        data = image_bytes(value, where, base_dir)
        try:
            image = Image.open(io.BytesIO(data))
        except Image.DecompressionBombError as exc:  # PIL's own refusal, above twice its MAX_IMAGE_PIXELS
            raise ConfigError(f"{where}: image too large to decode ({exc}); downscale it in the data") from None
        except (UnidentifiedImageError, OSError, ValueError) as exc:
            raise ConfigError(f"{where}: not an image PIL can read ({len(data)} bytes starting {data[:8]!r}: "
                              f"{type(exc).__name__}); give PNG, JPEG or another format PIL decodes") from None
    max_pixels = MAX_DECODED_PIXELS if max_pixels is None else max_pixels
    width, height = image.size
    if width * height > max_pixels:
        raise ConfigError(f"{where}: image is {width} x {height} = {width * height} pixels, more than the "
                          f"{max_pixels} decoded here; downscale it in the data (the processor resizes every image "
                          "to its own max_pixels anyway)")
    try:
        return image.convert("RGB")
    except (OSError, ValueError, Image.DecompressionBombError) as exc:
        raise ConfigError(f"{where}: the image's pixels cannot be decoded ({type(exc).__name__}: {exc}); the file "
                          "is truncated or damaged: re-encode it") from None


class ImageProcessor:
    """The model's own image processor and image token, loaded from a vision-language checkpoint directory.

    ``process`` turns a prompt's images into ``VisionInputs``; ``expand`` gives each image its pad tokens."""

    def __init__(self, model_dir: str, flag: str = "--hf-checkpoint"):
        try:
            with open(os.path.join(model_dir, "config.json")) as f:
                config = json.load(f)
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"{FLAG}: {flag} {model_dir}/config.json cannot be read ({type(exc).__name__}); give "
                              "a vision-language HF checkpoint directory") from None
        if config.get("image_token_id") is None or "vision_config" not in config:
            raise ConfigError(f"{FLAG} needs a vision-language {flag}: {model_dir}'s config.json (model_type "
                              f"{config.get('model_type')!r}) has no image_token_id / vision_config; drop {FLAG} or "
                              f"point {flag} at a vision-language checkpoint (docs/vlm.md)")
        if not os.path.isfile(os.path.join(model_dir, "preprocessor_config.json")):
            raise ConfigError(f"{FLAG}: {flag} {model_dir} has no preprocessor_config.json (the model's image "
                              "processor); copy it from the model's hub repository into that directory")
        from transformers import AutoImageProcessor  # lazy: heavy

        try:
            self.processor = AutoImageProcessor.from_pretrained(model_dir, local_files_only=True)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"{FLAG}: {flag} {model_dir}/preprocessor_config.json does not load as an image "
                              f"processor ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
                              ) from None
        self.image_token_id = int(config["image_token_id"])
        self.vision_start_id = config.get("vision_start_token_id")
        self.vision_end_id = config.get("vision_end_token_id")
        self.merge_size = int(getattr(self.processor, "merge_size", config["vision_config"].get(
            "spatial_merge_size", 2)))

    def process(self, values: Sequence[Any], where: str, base_dir: Optional[str] = None) -> Optional[VisionInputs]:
        """A record's images (as the column gives them) decoded and run through the processor: their pixel patches
        and grids (None for no images). ``where`` names the record and column; errors add the image's index."""
        if not values:
            return None
        sources = [encoded_image(v, f"{where} image {k}", base_dir) for k, v in enumerate(values)]
        images = [decode_image(b, f"{where} image {k}") for k, b in enumerate(sources)]
        out = self.processor(images=images, return_tensors="np")
        return VisionInputs(np.asarray(out["pixel_values"], np.float32), np.asarray(out["image_grid_thw"], np.int64),
                            sources)

    def image_slot(self, tokenizer: Any) -> Optional[str]:
        """The text of one image's slot as the model's chat template writes it (vision-start, image-pad, vision-end
        tokens: ``<|vision_start|><|image_pad|><|vision_end|>`` for Qwen2.5-VL), from ``tokenizer``; None when the
        tokenizer or the config lacks those tokens."""
        ids = [self.vision_start_id, self.image_token_id, self.vision_end_id]
        if tokenizer is None or any(i is None for i in ids):
            return None
        tokens = tokenizer.convert_ids_to_tokens([int(i) for i in ids])
        return "".join(tokens) if all(isinstance(t, str) and t for t in tokens) else None

    def expand(self, prompt_ids: Sequence[int], vision: Optional[VisionInputs], where: str) -> list[int]:
        """``prompt_ids`` with its k-th image-pad token repeated to the k-th image's feature count; refuses a
        prompt whose pad tokens are not one per image (``where`` names the prompt and column)."""
        return expand_image_tokens(prompt_ids, vision, self.image_token_id, self.merge_size, where)


#: verl's image marker in prompt text (its RLHFDataset splits content at it into image and text parts, which the
#: processor's chat template renders as the model's image slot)
VERL_IMAGE_MARKER = "<image>"


def with_image_slots(prompt: Any, slot: str) -> Any:
    """``prompt`` (text or chat messages) with each of verl's ``<image>`` markers replaced by ``slot``, the model's
    image slot text; other prompts as they are."""
    if isinstance(prompt, str):
        return prompt.replace(VERL_IMAGE_MARKER, slot)
    if isinstance(prompt, list) and all(isinstance(m, dict) for m in prompt):
        return [{**m, "content": m["content"].replace(VERL_IMAGE_MARKER, slot)} if isinstance(m.get("content"), str)
                else m for m in prompt]
    return prompt


def expand_image_tokens(prompt_ids: Sequence[int], vision: Optional[VisionInputs], image_token_id: int,
                        merge_size: int, where: str) -> list[int]:
    """See ``ImageProcessor.expand``."""
    counts = vision.tokens_per_image(merge_size) if vision is not None else []
    places = [i for i, t in enumerate(prompt_ids) if t == image_token_id]
    if len(places) != len(counts):
        raise ConfigError(f"{where}: the prompt has {len(places)} image placeholder(s) (image-pad token id "
                          f"{image_token_id}) and the record {len(counts)} image(s); give one placeholder per image "
                          "(verl's <image> marker in the text, the model's own image slot "
                          "<|vision_start|><|image_pad|><|vision_end|>, or its pad token id in token-id prompts), "
                          "in image order")
    out: list[int] = []
    start = 0
    for place, count in zip(places, counts):
        out.extend(prompt_ids[start:place])
        out.extend([image_token_id] * count)
        start = place + 1
    out.extend(prompt_ids[start:])
    return out


__all__ = ["FLAG", "MAX_DECODED_PIXELS", "ImageProcessor", "VisionInputs", "decode_image", "encoded_image",
           "expand_image_tokens", "image_bytes", "image_mime", "image_list", "parse_multimodal_keys", "with_image_slots"]
