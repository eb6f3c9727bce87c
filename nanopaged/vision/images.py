"""An image as a request brings it: a PIL image, a numpy array or torch tensor of uint8
pixels, a data URL, or a local file (only under `allowed_local_media_path`, as vLLM's);
read into a PIL image, and named by its content (`image_key`): the same pixels under the
same processing are the same image wherever they come from.
"""

import base64
import binascii
import io
import os

import xxhash

REMOTE = ("http://", "https://")


def load_image(
    source, allowed_local_media_path: str | None = None, allow_remote: bool = False
):
    """`source` as an RGB PIL image; a ValueError says why it is none."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(source, Image.Image):
        return source.convert("RGB")
    if hasattr(source, "__array__") and hasattr(source, "dtype"):
        return _from_array(source)
    if isinstance(source, dict):  # a chat part's {"url": ...}
        source = source.get("url")
    if isinstance(source, (bytes, bytearray)):
        data = bytes(source)
    elif isinstance(source, str) and source.startswith("data:"):
        header, _, payload = source.partition(",")
        if ";base64" not in header:
            raise ValueError(
                "an image data URL must be base64 (data:image/...;base64,...)"
            )
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise ValueError("the image data URL's base64 does not decode") from None
    elif isinstance(source, str) and source.startswith(REMOTE):
        if not allow_remote:
            raise ValueError(
                f"image URL {source[:80]!r} is remote, and this engine fetches nothing "
                f"(it may be offline): send the image as a data URL, or allow remote "
                f"media (--allow-remote-media)"
            )
        import urllib.request

        with urllib.request.urlopen(source, timeout=30) as response:
            data = response.read()
    elif isinstance(source, str) and source.startswith("file://"):
        data = _read_local(source.removeprefix("file://"), allowed_local_media_path)
    else:
        raise ValueError(
            f"an image must be a PIL image, an array of pixels, a data URL, or a "
            f"file:// URL, got "
            f"{type(source).__name__} {str(source)[:60]!r}"
        )
    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except (UnidentifiedImageError, OSError) as error:
        raise ValueError(
            f"the image's bytes are no image PIL can read ({error})"
        ) from None
    return image.convert("RGB")


def _from_array(pixels):
    """A numpy array or torch tensor of uint8 pixels, (H, W), (H, W, C) or (C, H, W)
    with C of 1, 3 or 4, as an RGB PIL image: the same image as the PIL image of the
    same pixels."""
    import numpy as np
    from PIL import Image

    array = np.asarray(pixels.detach().cpu() if hasattr(pixels, "detach") else pixels)
    if array.dtype != np.uint8:
        raise ValueError(
            f"an image array must hold uint8 pixels (0-255), got {array.dtype}: "
            f"e.g. (pixels * 255).round() as uint8 for values in [0, 1]"
        )
    channels = (1, 3, 4)
    if (
        array.ndim == 3
        and array.shape[0] in channels
        and array.shape[2] not in channels
    ):
        array = array.transpose(1, 2, 0)  # channels first, as torch keeps them
    if array.ndim == 3 and array.shape[2] == 1:
        array = array[:, :, 0]
    if array.ndim != 2 and not (array.ndim == 3 and array.shape[2] in channels[1:]):
        raise ValueError(
            f"an image array must be (H, W), (H, W, C) or (C, H, W) with C of 1, 3 "
            f"or 4, got shape {tuple(array.shape)}"
        )
    return Image.fromarray(np.ascontiguousarray(array)).convert("RGB")


def _read_local(path: str, allowed: str | None) -> bytes:
    """A local file's bytes, only from under `allowed` (vLLM's
    allowed_local_media_path)."""
    if not allowed:
        raise ValueError(
            "local image files are off: create the engine with "
            "allowed_local_media_path=DIR to read images under DIR"
        )
    real, root = os.path.realpath(path), os.path.realpath(allowed)
    if os.path.commonpath([real, root]) != root:
        raise ValueError(
            f"image file {path!r} is not under allowed_local_media_path={allowed!r}"
        )
    try:
        with open(real, "rb") as f:
            return f.read()
    except OSError as error:
        raise ValueError(f"cannot read image file {path!r}: {error.strerror}") from None


def image_key(image, processing: dict) -> int:
    """A 64-bit name of an image's content and of how it is processed: its blocks'
    hashes are made of it, so that the prefix cache shares an image's K/V only with the
    same image."""
    digest = xxhash.xxh64()
    digest.update(f"{image.mode} {image.size} {sorted(processing.items())}".encode())
    digest.update(image.tobytes())
    return digest.intdigest()
