#!/usr/bin/env python3
"""Time the official Mamba-3 prefill on this GPU, for comparison with `mamba3 bench`.

The official pipeline: state-spaces/mamba's `MambaLMHeadModel` with
`ssm_cfg.layer = "Mamba3"`, its `backbone(ids)` forward (Triton kernels), bf16, on the
shape of docs/performance.md. The sources are not part of this repository: point --src at a
directory holding the `mamba_ssm` package of state-spaces/mamba with an empty
`__init__.py` (the real one imports compiled extensions that need not be installed).
Prints one JSON object per shape; the first call's time (Triton autotuning) separately.
"""
import argparse
import json
import statistics
import sys
import time

ap = argparse.ArgumentParser()
ap.add_argument("--src", required=True)
ap.add_argument("--shapes", default="1x4096,8x4096,1x16384", help="BxT,...")
ap.add_argument("--repeats", type=int, default=10)
ap.add_argument("--d-model", type=int, default=768)
ap.add_argument("--layers", type=int, default=24)
ap.add_argument("--d-state", type=int, default=128)
ap.add_argument("--headdim", type=int, default=64)
ap.add_argument("--chunk", type=int, default=64)
ap.add_argument("--vocab", type=int, default=256)
a = ap.parse_args()
sys.path.insert(0, a.src)

import torch  # noqa: E402
from mamba_ssm.models.config_mamba import MambaConfig  # noqa: E402
from mamba_ssm.models.mixer_seq_simple import MambaLMHeadModel  # noqa: E402

cfg = MambaConfig(
    d_model=a.d_model, d_intermediate=0, n_layer=a.layers, vocab_size=a.vocab,
    ssm_cfg=dict(layer="Mamba3", d_state=a.d_state, headdim=a.headdim, expand=2, ngroups=1,
                 rope_fraction=0.5, chunk_size=a.chunk, is_mimo=False),
    rms_norm=True, residual_in_fp32=True, fused_add_norm=True, pad_vocab_size_multiple=8,
    tie_embeddings=True)
torch.manual_seed(0)
model = MambaLMHeadModel(cfg, device="cuda", dtype=torch.bfloat16).eval()
gpu = torch.cuda.get_device_name(0)
first_call = None
for shape in a.shapes.split(","):
    b, t = (int(x) for x in shape.split("x"))
    ids = [torch.randint(0, a.vocab, (b, t), device="cuda") for _ in range(2)]
    with torch.inference_mode():
        t0 = time.perf_counter()
        model.backbone(ids[0])
        torch.cuda.synchronize()
        first = time.perf_counter() - t0
        if first_call is None:
            first_call = first
        for i in range(2):
            model.backbone(ids[i % 2])
        times = []
        for i in range(a.repeats):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            model.backbone(ids[i % 2])
            e1.record()
            torch.cuda.synchronize()
            times.append(e0.elapsed_time(e1) / 1e3)
    s = statistics.median(times)
    print(json.dumps({"impl": "official", "device_name": gpu, "dtype": "bf16", "batch": b,
                      "prompt_len": t, "prefill_ms": s * 1e3,
                      "prefill_tokens_per_s": b * t / s, "first_call_s": first,
                      "torch": torch.__version__}), flush=True)
print(json.dumps({"impl": "official", "first_call_s_first_shape": first_call}), flush=True)
