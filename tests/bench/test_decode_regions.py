"""bench/decode_regions.py on a hand-made trace of two decode steps: kernels go to their region
by name, a GEMM launched once per step is the LM head, the others are the blocks' GEMMs; busy
and span are per step."""
import os
import sys
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench"))
import decode_regions  # noqa: E402


def k(name, ts, dur, cat="kernel"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


def step(t0):
    return [
        k("void vlmgraph::cuda::RmsNormKernel<bf16>", t0 + 0, 2),
        k("nvjet_sm90_tst_96x64_h_bz_TNN", t0 + 3, 5),          # qkv, layer 0
        k("void vlmgraph::cuda::RopeDecodeAttentionKernel<bf16, 64, 128>", t0 + 9, 30),
        k("nvjet_sm90_tst_96x64_h_bz_TNN", t0 + 40, 5),         # qkv, layer 1
        k("memcpy32_post", t0 + 46, 1),
        k("void vlmgraph::cuda::SiluMulKernel<bf16>", t0 + 48, 3),
        k("void cutlass::Kernel2<cutlass_80_tensorop_bf16_gemm_128x256>", t0 + 52, 20),  # head
        k("void vlmgraph::cuda::ArgmaxKernel<bf16>", t0 + 73, 4),
        k("Memcpy DtoH (Device -> Pinned)", t0 + 78, 2, cat="gpu_memcpy"),
        k("some_unknown_kernel", t0 + 81, 1),
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": t0, "dur": 50},
    ]


class DecodeRegionsTest(unittest.TestCase):
    def test_regions_per_step(self):
        per, busy, span, kernels = decode_regions.regions(step(0) + step(100), steps=2)
        self.assertEqual(per["attention"], 30)
        self.assertEqual(per["gemm"], 10)       # two qkv GEMMs per step
        self.assertEqual(per["lm_head"], 20)    # the GEMM launched once per step
        self.assertEqual(per["norms_activations"], 5)
        self.assertEqual(per["sampling"], 4)
        self.assertEqual(per["copies"], 3)      # memcpy32_post + the report's copy
        self.assertEqual(per["other"], 1)
        self.assertEqual(busy, 73)
        self.assertEqual(span, (182 - 0) / 2)
        self.assertEqual(kernels, 10)

    def test_a_trace_without_kernels_is_refused(self):
        with self.assertRaises(SystemExit):
            decode_regions.regions([{"ph": "X", "cat": "cuda_runtime", "name": "x", "ts": 0,
                                     "dur": 1}], steps=1)


if __name__ == "__main__":
    unittest.main()
