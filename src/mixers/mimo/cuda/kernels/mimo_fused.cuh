// Mamba-3 MIMO's mixer in the fused decode (src/cuda/kernels/decode_layers.cu): the names
// that file calls, over mimo_step.cu's step of one (sequence, head). A layer's `MixerW` is
// its `MimoScan` (offsets into the in_proj row, parameters, where its state tensors start;
// its `proj` is unused: the fused decode's rows are `proj`, PROJ_LD apart). Heads are not
// split between blocks (FUSED_MIXER_SPLIT 0): the keys and the gate's norm span the head.
typedef MimoScan MixerW;
typedef MimoSmem StepSmem;
typedef MimoHead StepAhead;
struct StepHead {};

__device__ __forceinline__ void mixer_head(StepHead&, float* const* __restrict__, int, int, int) {}

// (the state's previous keys go to shared memory in `mixer_run`, once the block's previous
// head has stored its own from there)
__device__ __forceinline__ void mixer_ahead(StepAhead& ah, const MixerW& w, float* const* __restrict__ states,
                                            int /*layer*/, int h, int b, int = 0, int = HEADDIM) {
    mimo_head_regs(ah, w, states[b], h);
}

__device__ __forceinline__ const state_t* mixer_state_rows(const MixerW& w, float* seq, int /*layer*/, int h) {
    return reinterpret_cast<const state_t*>(seq + w.ssm_off) + (size_t)h * HEADDIM * DSTATE;
}

// The step of head h of sequence b from its in_proj row (row b of `proj`): its gated output
// to row b of `y_f32` (D_INNER wide, the out_proj's input), its state in place.
template <class Mark>
__device__ __forceinline__ void mixer_run(StepSmem& sm, StepAhead& ah, const StepHead&, const MixerW& w,
                                          const float* proj, float* const* __restrict__ states, int /*layer*/,
                                          int h, int b, float* y_f32, act_t*, Mark, int = 0, int = HEADDIM) {
    mimo_head_smem(sm, w, states[b], h);
    mimo_head_row(ah, sm, w, proj + (size_t)b * PROJ_LD, h, y_f32 + (size_t)b * D_INNER);
    mimo_head_store(ah, sm, w, states[b], h);
}
