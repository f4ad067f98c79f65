//! The MIMO decode step's mixer alone, one layer, f32, at the spec's cost example
//! (d_model 768, d_state 128, headdim 64, mimo_rank 4): `mimo_mixer_prefill` of one token
//! a call (what a CPU decode step runs per layer and sequence), timed over many calls.
//! The engine's whole step adds the projections' weight stream around it
//! (docs/decisions.md, "MIMO CPU decode as a direct one-token step").
//!
//! `cargo bench --bench mimo_step [-- STEPS]` (default 2000); `RAYON_NUM_THREADS` sets the
//! threads.

#[path = "common/args.rs"]
mod args;
#[path = "common/mimo_layer.rs"]
mod mimo_layer;
#[path = "common/timing.rs"]
mod timing;

use mamba3::mixers::mimo::{mimo_mixer_prefill, MimoLayerState, MimoMixerCtx};

fn main() {
    let steps = args::Args::new().num(0, 2000);
    let (w, proj) = mimo_layer::spec_example(steps);
    let d = w.dims;
    let ctx = MimoMixerCtx::new(&w, 0);
    let mut out = vec![0f32; d.d_inner];
    let mut st = MimoLayerState::zeros(&d);
    // Inside the pool, as the engine's step runs (one trip into it per step, not one per
    // layer's parallel loop).
    let (median, best) = timing::median_best(5, &mut || {
        rayon::scope(|_| {
            for t in 0..steps {
                let row = &proj[t * d.d_in_proj..(t + 1) * d.d_in_proj];
                mimo_mixer_prefill(&ctx, row, 1, 1, &mut st.view(), &mut out).expect("step");
            }
        })
    });
    println!(
        "MIMO mixer, one token a call, f32, {} rayon threads: median {:.2} µs a step (best {:.2})",
        rayon::current_num_threads(),
        median * 1e6 / steps as f64,
        best * 1e6 / steps as f64
    );
}
