#!/usr/bin/env python3
"""A nanoVLM checkpoint with SmolLM2-135M's language-model shape (576 hidden, 1536 MLP, 9 heads, 3 KV
heads, 30 blocks; nanoVLM-222M's decoder) and random weights, for timing only:
    bench/make_smol_checkpoint.py REPO_ROOT OUT_DIR   (scripts/gpu-check.sh dpserve uses it)
Names and shapes come from tests/fixtures/nanovlm-default-keys.txt with the decoder's and the
projector's sizes mapped (960 -> 576, 2560 -> 1536, 320 -> 192)."""
import json, os, sys
import torch
from safetensors.torch import save_file

root, out = sys.argv[1], sys.argv[2]
fx = os.path.join(root, "tests", "fixtures")
cfg = json.load(open(os.path.join(fx, "nanovlm-default-config.json")))
cfg.update(lm_hidden_dim=576, lm_inter_dim=1536, lm_n_heads=9, lm_n_kv_heads=3, lm_n_blocks=30)
dims = {960: 576, 2560: 1536, 320: 192}
g = torch.Generator().manual_seed(0)
tensors = {}
for line in open(os.path.join(fx, "nanovlm-default-keys.txt")):
    if line.startswith("#") or not line.strip():
        continue
    name, shape, _ = line.rstrip("\n").split("\t")
    shape = json.loads(shape)
    if name.startswith("decoder.blocks.") and int(name.split(".")[2]) >= 30:
        continue
    if name.startswith("decoder.") or name.startswith("MP."):
        shape = [dims.get(d, d) for d in shape]
    if name.endswith("inv_freq"):
        t = 1.0 / (cfg["lm_re_base"] ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
    elif "norm" in name or "ln" in name.split(".")[-2] or name.endswith("layer_norm.weight"):
        t = torch.ones(shape) if name.endswith("weight") else torch.zeros(shape)
    else:
        t = torch.randn(shape, generator=g) * 0.02
    tensors[name] = t.contiguous()
os.makedirs(out, exist_ok=True)
save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
json.dump(cfg, open(os.path.join(out, "config.json"), "w"), indent=2)
print("wrote", out, sum(t.numel() for t in tensors.values()), "values")
