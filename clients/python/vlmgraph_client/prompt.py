"""Prompt arithmetic for vlmgraph: the server has no tokenizer, so clients place image tokens.

An image becomes tiles as nanoVLM preprocesses it (proto/vlmgraph/v1/image.proto); each tile
fills `mp_image_token_length` copies of `image_token_id` in the prompt.

    info = client.model_info()
    n = image_tiles(open("cat.png", "rb").read(), info)          # 13 for a 451x300 photo, tiny model
    ids = build_prompt(info, [n], text_ids=[5, 6, 7])
"""
import math
import struct


def image_size(data):
    """(width, height) of PNG or JPEG bytes, read from the header. Raises ValueError otherwise."""
    if data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) >= 24:
        width, height = struct.unpack(">II", data[16:24])
        return width, height
    if data[:3] == b"\xff\xd8\xff":
        i = 2
        while i + 9 < len(data):
            if data[i] != 0xFF:
                i += 1
                continue
            marker = data[i + 1]
            if marker in (0xD8, 0x01) or 0xD0 <= marker <= 0xD7 or marker == 0xFF:
                i += 1 if marker == 0xFF else 2
                continue
            (length,) = struct.unpack(">H", data[i + 2:i + 4])
            if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):
                height, width = struct.unpack(">HH", data[i + 5:i + 9])
                return width, height
            i += 2 + length
        raise ValueError("JPEG without a frame header")
    raise ValueError("not a PNG or JPEG image")


def resized_size(height, width, vit_img_size, max_img_size, resize_to_max_side_len=True):
    """(height, width) after nanoVLM's DynamicResize (data/custom_transforms.py)."""
    p, m = vit_img_size, max_img_size
    wide = width >= height
    long_side, short_side = (width, height) if wide else (height, width)
    target_long = m if resize_to_max_side_len else min(m, math.ceil(long_side / p) * p)
    scale = target_long / long_side
    target_short = max(p, math.ceil(short_side * scale / p) * p)
    return (target_short, target_long) if wide else (target_long, target_short)


def tiles_for_size(width, height, info):
    """Tiles (global tile included) of a width x height image for the model `info` describes."""
    h, w = resized_size(height, width, info.vit_img_size, info.max_img_size, info.resize_to_max_side_len)
    grid = (h // info.vit_img_size) * (w // info.vit_img_size)
    return grid + (1 if grid > 1 else 0)


def image_tiles(data, info):
    """Tiles of encoded PNG/JPEG `data`."""
    width, height = image_size(data)
    return tiles_for_size(width, height, info)


def build_prompt(info, tiles_per_image, text_ids):
    """Image tokens for every tile of every image, then `text_ids`."""
    n = sum(tiles_per_image)
    return [info.image_token_id] * (n * info.mp_image_token_length) + list(text_ids)
