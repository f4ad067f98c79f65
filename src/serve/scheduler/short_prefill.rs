//! Short prefill turns by CUDA graph. A turn that carries one sequence a few tokens on (the
//! tail of a prompt after a prefix-cache hit, a chat's next message) does little work per
//! kernel and pays a launch for each of the pass's hundreds of kernels: on a GPU such a
//! turn replays a prefill graph captured for its exact length instead, the same launches
//! in one (bit-identical to the eager pass, `tests/gpu_graphs.rs`). A length's graph is
//! captured the first time a turn of that length comes; longer turns, batched turns and
//! backends without prefill graphs (the CPU, the Mamba-1/2 and MIMO mixers) run eagerly.

use crate::engine::{Device, Logits, LogitsWant, Model, State};
use crate::error::Result;

/// The longest turn that replays a graph (a graph per length up to this).
pub const MAX_GRAPH_ROWS: usize = 32;

/// What the scheduler knows of its model's short-prefill graphs.
pub(super) struct ShortPrefill {
    /// The lengths whose graph was captured.
    captured: Vec<usize>,
    /// Cleared when a capture fails: that backend has no prefill graphs, every turn runs
    /// eagerly from then on.
    enabled: bool,
}

impl ShortPrefill {
    pub fn new(model: &Model) -> ShortPrefill {
        ShortPrefill {
            captured: Vec::new(),
            enabled: model.device() != Device::Cpu,
        }
    }

    /// Continue `states` by `pieces` and return each one's last logits row: by a graph
    /// when the turn is one piece of 2 to [`MAX_GRAPH_ROWS`] tokens, else eagerly.
    pub fn prefill(
        &mut self,
        model: &Model,
        pieces: &[&[u32]],
        states: &mut [&mut State],
    ) -> Result<Vec<Logits>> {
        if self.has_graph(model, pieces) {
            return model.prefill_graph(pieces, states, LogitsWant::Last);
        }
        model.prefill_batch(pieces, states, LogitsWant::Last)
    }

    /// Whether this turn replays a graph, capturing it now if it is the first of its length.
    fn has_graph(&mut self, model: &Model, pieces: &[&[u32]]) -> bool {
        let &[piece] = pieces else {
            return false;
        };
        let n = piece.len();
        if !self.enabled || !(2..=MAX_GRAPH_ROWS).contains(&n) {
            return false;
        }
        if self.captured.contains(&n) {
            return true;
        }
        match model.capture_prefill_graph(&[n], LogitsWant::Last) {
            Ok(()) => {
                self.captured.push(n);
                true
            }
            Err(e) => {
                eprintln!("mamba3 serve: short prefill turns run eagerly (no prefill graph: {e})");
                self.enabled = false;
                false
            }
        }
    }
}
