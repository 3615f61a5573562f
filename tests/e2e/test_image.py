"""Image preprocessing parity: the server's tiles for a real photo (vlmgraph-generate --dump-tiles,
the same code the server runs) against upstream nanoVLM's pipeline rebuilt in Python: PIL
convert("RGB") and bicubic resize (DynamicResize on a PIL image), ToTensor, row-major tiles, and
the global tile from torchvision's tensor resize (bilinear, antialiased)."""
import json
import os
import struct
import subprocess
import unittest

from e2e_util import CHELSEA, GENERATE, chelsea, require, scratch_dir
from vlmgraph_client import resized_size


def read_safetensors(path):
    import numpy as np
    with open(path, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(n))
        data = fh.read()
    t = header["tiles"]
    assert t["dtype"] == "F32", t
    begin, end = t["data_offsets"]
    return np.frombuffer(data[begin:end], dtype=np.float32).reshape(t["shape"])


def upstream_tiles(path, tile, max_side):
    """nanoVLM's get_image_processor(max_side, tile, resize_to_max_side_len=True) on a file."""
    import numpy as np
    import torch
    from PIL import Image
    img = Image.open(path).convert("RGB")
    w, h = img.size
    new_h, new_w = resized_size(h, w, tile, max_side, True)
    img = img.resize((new_w, new_h), Image.BICUBIC)                         # torchvision F.resize on PIL
    x = torch.from_numpy(np.asarray(img, dtype=np.float32) / 255.0).permute(2, 0, 1)  # ToTensor
    nh, nw = new_h // tile, new_w // tile
    patches = x.reshape(3, nh, tile, nw, tile).permute(1, 3, 0, 2, 4).reshape(nh * nw, 3, tile, tile)
    if nh * nw == 1:
        return patches.numpy()
    glob = torch.nn.functional.interpolate(x.unsqueeze(0), size=[tile, tile], mode="bilinear",
                                           align_corners=False, antialias=True)
    return torch.cat([glob, patches]).numpy()


class ImageParityTest(unittest.TestCase):
    def test_tiles_match_upstream_preprocessing(self):
        chelsea()
        for module in ("numpy", "torch", "PIL"):
            try:
                __import__(module)
            except ImportError:
                require(False, f"python module {module}")
        out = os.path.join(scratch_dir("image"), "tiles.safetensors")
        run = subprocess.run([GENERATE, "--image", CHELSEA, "--dump-tiles", out], capture_output=True, text=True,
                             timeout=120)
        self.assertEqual(run.returncode, 0, run.stderr)
        ours = read_safetensors(out)
        ref = upstream_tiles(CHELSEA, tile=64, max_side=256)  # nanovlm-tiny: 64 px tiles, 256 px max
        self.assertEqual(ours.shape, ref.shape)
        self.assertEqual(ours.shape, (13, 3, 64, 64))
        diff = abs(ours - ref)
        # PIL's fixed-point weights against LibTorch's float weights may land on the neighbouring
        # 8-bit level for a few pixels; the global tile (float bilinear) matches closely.
        self.assertLessEqual(float(diff.max()), 1.0 / 255 + 1e-6)
        self.assertLess(float((diff > 0.5 / 255).mean()), 0.001)
        self.assertLess(float(diff[0].max()), 0.5 / 255)


if __name__ == "__main__":
    unittest.main()
