#!/usr/bin/env python3
"""Time the official state-spaces/mamba pipelines on this GPU, for comparison with `mamba3 bench`.

The official pipeline: state-spaces/mamba's `MambaLMHeadModel` with `ssm_cfg.layer` = Mamba3
(default), Mamba2 or Mamba1, bf16, random weights and tokens. The sources are not part of this
repository: point --src at a directory holding the `mamba_ssm` package of state-spaces/mamba
with an empty `__init__.py` (the real one imports compiled extensions that need not be
installed). Prefill: `model.backbone(ids)` per BxT shape (first call, Triton autotuning,
separately). Decode (--decode-batches): one-token steps the way `mamba_ssm.utils.generation`
decodes greedily (`InferenceParams`, `model(tok, inference_params=...)`, argmax), after a
--decode-prompt prefill; eagerly, and with --decode-cg through the official CUDA-graph cache
(`update_graph_cache`, the path of `generate(cg=True)`). One JSON object per measurement;
"notes" name every piece that is not the official fast path (fallbacks, references). Eager
decode is bound by Python and launches (0.5-0.9 ms a layer on the H100 machine); the CUDA-graph
figures are the GPU's. A decode line's prompt_prefill_s includes first-call autotuning.

Without the compiled extensions (causal_conv1d, selective_scan_cuda):
  Mamba2: use_mem_eff_path=False (mamba_split_conv1d_scan_combined needs causal_conv1d), so
          the conv is torch's nn.Conv1d, the scan Triton mamba_chunk_scan_combined, the gated
          RMSNorm Triton; its decode step: torch conv update + Triton selective_state_update.
  Mamba1: the scan is the official pure-PyTorch selective_scan_ref (a Python loop over T; very
          slow), the conv torch's; decode: torch conv update + Triton selective_state_update.
          With --selective-scan DIR (a selective_scan_cuda built there by
          scripts/build-selective-scan, the official CUDA scan) the scan is the official CUDA
          one; the conv stays torch's.
--max-seconds bounds one prefill shape: one layer is timed first; if the full model would
overrun, fewer layers are timed and scaled to all ("extrapolated_from_layers"), or the shape is
skipped when even one layer would.
"""
import argparse
import json
import statistics
import sys
import time
import types

ap = argparse.ArgumentParser()
ap.add_argument("--src", required=True)
ap.add_argument("--layer", default="Mamba3", choices=["Mamba3", "Mamba2", "Mamba1"])
ap.add_argument("--shapes", default="1x4096,8x4096,1x16384", help="prefill BxT,... ('' for none)")
ap.add_argument("--repeats", type=int, default=10)
ap.add_argument("--d-model", type=int, default=768)
ap.add_argument("--layers", type=int, default=24)
ap.add_argument("--d-state", type=int, default=128)
ap.add_argument("--headdim", type=int, default=64)
ap.add_argument("--expand", type=int, default=2)
ap.add_argument("--ngroups", type=int, default=1)
ap.add_argument("--chunk", type=int, default=64, help="chunk_size (MIMO: 64/R unless given)")
ap.add_argument("--selective-scan", default="",
                help="a directory holding a built selective_scan_cuda (scripts/build-selective-scan)")
ap.add_argument("--mimo-rank", type=int, default=0, help="Mamba3 MIMO with this rank (0: SISO)")
ap.add_argument("--vocab", type=int, default=256)
ap.add_argument("--max-seconds", type=float, default=0, help="budget of one prefill shape (0: none)")
ap.add_argument("--decode-batches", default="", help="decode batch sizes, e.g. 1,64 ('' for none)")
ap.add_argument("--decode-steps", type=int, default=64)
ap.add_argument("--decode-prompt", type=int, default=64, help="prompt prefilled before decoding")
ap.add_argument("--decode-cg", choices=["off", "on", "both"], default="off",
                help="CUDA graphs for decode (official update_graph_cache): off, on, or both")
a = ap.parse_args()
sys.path.insert(0, a.src)
if a.selective_scan:
    sys.path.insert(0, a.selective_scan)
notes = []


def stub(name, **attrs):
    m = types.ModuleType(name)
    m.__dict__.update(attrs)
    sys.modules[name] = m


# mamba_ssm.utils.{generation,hf} and modules.mamba2 import these at the top; neither is used
# on the paths timed here. Stubbed only if absent.
try:
    import transformers.generation  # noqa: F401
    import transformers.utils.hub  # noqa: F401
except ImportError:
    stub("transformers")
    stub("transformers.generation", GenerateDecoderOnlyOutput=dict, TextStreamer=object)
    stub("transformers.utils", WEIGHTS_NAME="pytorch_model.bin", CONFIG_NAME="config.json")
    stub("transformers.utils.hub", cached_file=None)
    notes.append("transformers absent: stubbed (only from_pretrained/generate() output types use it)")
try:
    from huggingface_hub import PyTorchModelHubMixin  # noqa: F401
except ImportError:
    stub("huggingface_hub", PyTorchModelHubMixin=type("PyTorchModelHubMixin", (), {}))
    notes.append("huggingface_hub absent: PyTorchModelHubMixin stubbed")

import torch  # noqa: E402

try:
    import mamba_ssm.ops.selective_scan_interface as ssi  # noqa: E402
except ImportError:  # older sources import the compiled extensions unguarded
    stub("selective_scan_cuda")
    stub("causal_conv1d_cuda")
    notes.append("empty stub modules for selective_scan_cuda, causal_conv1d_cuda (older sources)")
    import mamba_ssm.ops.selective_scan_interface as ssi  # noqa: E402
import mamba_ssm.modules.mamba2 as m2  # noqa: E402
import mamba_ssm.modules.mamba_simple as m1  # noqa: E402
from mamba_ssm.models.config_mamba import MambaConfig  # noqa: E402
from mamba_ssm.models.mixer_seq_simple import MambaLMHeadModel  # noqa: E402
from mamba_ssm.utils.generation import InferenceParams, update_graph_cache  # noqa: E402

have_conv = m2.causal_conv1d_fn is not None and m2.causal_conv1d_update is not None
have_scan = hasattr(ssi.selective_scan_cuda, "fwd")
impl = "official"
if a.layer == "Mamba3":
    mimo = a.mimo_rank > 0
    chunk = a.chunk if not mimo or "--chunk" in sys.argv else 64 // a.mimo_rank
    ssm = dict(d_state=a.d_state, headdim=a.headdim, expand=a.expand, ngroups=a.ngroups,
               rope_fraction=0.5, chunk_size=chunk, is_mimo=mimo)
    if mimo:
        ssm["mimo_rank"] = a.mimo_rank
        notes.append(f"MIMO rank {a.mimo_rank}, chunk {chunk}: TileLang kernels (tilelang from PYTHONPATH)")
    else:
        notes.append("prefill: Triton mamba3_siso_combined; decode step: mamba3_step_fn (CuteDSL)")
elif a.layer == "Mamba2":
    ssm = dict(d_state=a.d_state, headdim=a.headdim, expand=a.expand, ngroups=a.ngroups,
               chunk_size=a.chunk, use_mem_eff_path=have_conv)
    if have_conv:
        notes.append("official fast path: mamba_split_conv1d_scan_combined, causal_conv1d")
    else:
        notes += ["causal_conv1d absent: use_mem_eff_path=False (mamba_split_conv1d_scan_combined "
                  "needs it); conv1d via torch nn.Conv1d; decode conv update via torch roll",
                  "scan: Triton mamba_chunk_scan_combined; gated RMSNorm: Triton layernorm_gated"]
    notes.append("decode SSM step: Triton selective_state_update" if m2.selective_state_update
                 else "decode SSM step: torch fallback (Triton selective_state_update not importable)")
else:
    ssm = dict(d_state=a.d_state, expand=a.expand, use_fast_path=have_conv and have_scan)
    if have_scan:
        impl = "official selective_scan_cuda (forward-only build); conv1d torch's"
        notes.append("prefill scan: the official CUDA selective_scan_cuda.fwd (scripts/build-selective-scan)")
    else:
        m1.selective_scan_fn = ssi.selective_scan_ref  # the module calls it by its global name
        impl = "selective_scan_ref (official PyTorch reference; selective_scan_cuda not built)"
        notes.append("prefill scan: selective_scan_ref, a Python loop over T (selective_scan_cuda not built)")
    if not have_conv:
        notes.append("causal_conv1d absent: conv1d via torch nn.Conv1d; decode conv update via torch roll")
    notes.append("decode SSM step: Triton selective_state_update" if m1.selective_state_update
                 else "decode SSM step: torch fallback (Triton selective_state_update not importable)")
cfg = MambaConfig(
    d_model=a.d_model, d_intermediate=0, n_layer=a.layers, vocab_size=a.vocab,
    ssm_cfg=dict(layer=a.layer, **ssm), rms_norm=True, residual_in_fp32=True,
    fused_add_norm=True, pad_vocab_size_multiple=8, tie_embeddings=True)
torch.manual_seed(0)
model = MambaLMHeadModel(cfg, device="cuda", dtype=torch.bfloat16).eval()
gpu = torch.cuda.get_device_name(0)
all_layers = model.backbone.layers
base = {"impl": impl, "layer": a.layer, "mimo_rank": a.mimo_rank, "device_name": gpu, "dtype": "bf16", "d_model": a.d_model,
        "layers": a.layers, "d_state": a.d_state, "torch": torch.__version__, "notes": notes}


def emit(**kw):
    print(json.dumps({**base, **kw}), flush=True)


def wall(f):  # seconds of one synchronized call
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    f()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def prefill(b, t):
    ids = [torch.randint(0, a.vocab, (b, t), device="cuda") for _ in range(2)]
    n, extra = a.layers, {}
    try:
        if a.max_seconds > 0:  # one layer first: how many fit in the budget?
            model.backbone.layers = all_layers[:1]
            model.backbone(ids[0])  # warm (autotuning)
            t1 = wall(lambda: model.backbone(ids[1]))
            calls = a.repeats + 3  # first call, 2 warm-ups, the repeats
            extra["est_full_forward_s"] = t1 * a.layers
            if t1 * calls > a.max_seconds:
                emit(kind="prefill", batch=b, prompt_len=t, skipped=f"one layer {t1:.2f} s x {calls} "
                     f"calls > --max-seconds {a.max_seconds}", **extra)
                return None
            n = min(a.layers, int(a.max_seconds / (t1 * calls)))
            extra["first_call_after_one_layer_probe"] = True  # first_call_s misses most autotuning
        model.backbone.layers = all_layers[:n]
        first = wall(lambda: model.backbone(ids[0]))
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
    finally:
        model.backbone.layers = all_layers
    s = statistics.median(times)
    if n < a.layers:  # scaled: embedding and final norm counted a.layers/n times (tiny)
        extra.update(extrapolated_from_layers=n, measured_ms=s * 1e3)
        s *= a.layers / n
    emit(kind="prefill", batch=b, prompt_len=t, prefill_ms=s * 1e3, prefill_tokens_per_s=b * t / s,
         first_call_s=first, repeats=a.repeats, **extra)
    return first


def decode(b, cg):
    p, n, warm = a.decode_prompt, a.decode_steps, 3
    max_len = p + warm + n + 1
    ids = torch.randint(0, a.vocab, (b, p), device="cuda")
    if cg:  # as generation.decode(cg=True): graphs captured for (b, 1), states in the cache
        cache = update_graph_cache(model, None, b, p, max_len)
        ip = cache.inference_params
        ip.reset(max_len, b)
    else:
        cache, ip = None, InferenceParams(max_seqlen=max_len, max_batch_size=b)

    def step(tok):  # generation.decode's loop body, greedy (top_k=1)
        pos = torch.full((b, 1), ip.seqlen_offset, dtype=torch.long, device="cuda")
        if cache is None:
            logits = model(tok, position_ids=pos, inference_params=ip, num_last_tokens=1).logits.squeeze(dim=1)
        else:
            logits = cache.run(tok, pos, ip.seqlen_offset).squeeze(dim=1)
        ip.seqlen_offset += tok.shape[1]
        return logits.argmax(dim=-1).unsqueeze(1)

    t_pre = time.perf_counter()
    logits = model(ids, inference_params=ip, num_last_tokens=1).logits.squeeze(dim=1)
    ip.seqlen_offset += p
    tok = logits.argmax(dim=-1).unsqueeze(1)
    torch.cuda.synchronize()
    t_pre = time.perf_counter() - t_pre
    for _ in range(warm):
        tok = step(tok)
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
    ev[0].record()  # no sync between steps (as generate): each step's span on the GPU stream
    for i in range(n):
        tok = step(tok)
        ev[i + 1].record()
    torch.cuda.synchronize()
    ms = [ev[i].elapsed_time(ev[i + 1]) for i in range(n)]
    med = statistics.median(ms)
    path = ("official update_graph_cache/capture_graph replay (generate cg=True)" if cg else
            "official InferenceParams + model(tok, inference_params) eager (generate cg=False)")
    emit(kind="decode", batch=b, prompt_len=p, decode_steps=n, cuda_graphs=cg, path=path,
         decode_ms_per_step=med, decode_ms_per_step_mean=ev[0].elapsed_time(ev[n]) / n,
         decode_ms_per_step_min=min(ms), decode_tokens_per_s=b * 1e3 / med, prompt_prefill_s=t_pre)


def guarded(kind, b, f, *args, **kw):  # one failure (OOM, missing kernel) must not end the run
    try:
        return f(*args)
    except Exception as e:  # noqa: BLE001
        emit(kind=kind, batch=b, error=f"{type(e).__name__}: {e}"[:600], **kw)
        try:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        except Exception:  # noqa: BLE001 (a broken CUDA context: the next ones fail too)
            pass


with torch.inference_mode():
    first_call = None
    for shape in filter(None, a.shapes.split(",")):
        b, t = (int(x) for x in shape.split("x"))
        first = guarded("prefill", b, prefill, b, t, prompt_len=t)
        if first_call is None:
            first_call = first
    if a.shapes:
        print(json.dumps({"impl": impl, "layer": a.layer, "first_call_s_first_shape": first_call}), flush=True)
    cgs = {"off": [False], "on": [True], "both": [False, True]}[a.decode_cg]
    for cg in cgs:
        for b in (int(x) for x in filter(None, a.decode_batches.split(","))):
            guarded("decode", b, decode, b, cg, cuda_graphs=cg)
