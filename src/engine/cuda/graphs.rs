//! CUDA graphs: a whole decode step for a batch-size bucket, or a whole prefill for fixed
//! sequence lengths, captured once and replayed with one launch.
//!
//! A captured graph owns its work buffers (so nothing an eager pass reallocates can move
//! under it) and records what it was captured with: the numeric options, the kernels and
//! the weights. Replay copies the tokens and the state addresses into the graph's own
//! tables, launches, and reads the logits back. It refuses, with an error, a batch larger
//! than the bucket, lengths other than the captured ones, and any change of options,
//! kernels or weights since the capture. The tokens' copy to the device is the graph's
//! first node, from page-locked memory the graph owns: replay writes the tokens there and
//! launches, with no copy call of its own (a copy from pageable memory cost the decode step
//! a staging copy on the host). Replay runs exactly the launches of an eager pass
//! with the same shapes, so results are bit-identical; a decode batch smaller than its
//! bucket is padded with a scratch state, and as every kernel of the small-batch decode
//! treats each row on its own, the padding does not change the other rows' results.

use super::captured::{CaptureKey, Captured, Graphs};
use super::model::{split_logits, CudaModel};
use super::state::CudaState;
use super::work::{Caps, Layout, Work};
use crate::cuda::context::{dev_err, PinnedBuf};
use crate::engine::LogitsWant;
use crate::error::{Error, Result};
use crate::options::GpuOptions;

enum Kind {
    Decode,
    Prefill,
}

impl CudaModel {
    fn capture_key(
        &self,
        opts: GpuOptions,
        k: &std::sync::Arc<super::kernels::Kernels>,
    ) -> CaptureKey {
        CaptureKey {
            opts,
            kernels: std::sync::Arc::as_ptr(k) as usize,
            weights: self.gw.embedding.ptr,
        }
    }

    /// Capture one pass of `lay` into a graph over fresh buffers.
    fn capture(&self, lay: Layout, kind: Kind) -> Result<Captured> {
        let mut inner = self.lock()?;
        let opts = inner.opts;
        let k = self.kernels(&mut inner, opts)?;
        let d = self.weights.dims;
        let gpu = self.gpu();
        let work = Work::new(gpu, &d, self.weights.dtype.size(), Caps::of(&lay))?;
        let mut scratch = CudaState::zeros(gpu, &self.state_layout)?;
        let sp = scratch.unique_ptr()?;
        let n = lay.seqs.len();
        work.put_layout(gpu, &lay)?;
        let tokens_in = PinnedBuf::<u32>::new(gpu, lay.rows)?;
        gpu.htod(&vec![sp; n], work.states.ptr)?;
        let mut pipe = self.pipe(&k, opts);
        // no synchronisation inside a capture
        pipe.probe = false;
        pipe.timed = false;
        let run = |w: &Work| {
            gpu.htod(tokens_in.as_slice(), w.tokens.ptr)?;
            match kind {
                Kind::Decode => pipe.decode(w, n),
                Kind::Prefill => pipe.prefill(w, &lay),
            }
        };
        // A warm-up pass first: cuBLASLt plans and lazy loading happen outside the capture.
        run(&work)?;
        gpu.sync()?;
        let graph = gpu.capture_graph(|| run(&work))?;
        gpu.sync()?;
        // A prefill replay names every state itself, so the scratch state it was captured
        // on is not kept (a graph per short length would keep a whole state each).
        let scratch = match kind {
            Kind::Decode => Some(scratch),
            Kind::Prefill => None,
        };
        Ok(Captured {
            graph,
            work,
            tokens_in,
            in_flight: false,
            key: self.capture_key(opts, &k),
            scratch,
            layout: lay,
            state_ptrs: vec![sp; n],
        })
    }

    /// Capture the decode step for batches of up to `bucket` sequences.
    pub fn capture_decode(&self, bucket: usize) -> Result<()> {
        if bucket == 0 {
            return Err(Error::input(
                "a decode graph needs a batch size of at least 1",
            ));
        }
        let c = self.capture(Layout::decode(bucket, &self.weights.dims), Kind::Decode)?;
        self.lock()?.graphs.decode.insert(bucket, c);
        Ok(())
    }

    /// Capture a prefill of sequences of exactly these lengths (continued or fresh states).
    pub fn capture_prefill(&self, lens: &[usize], want: LogitsWant) -> Result<()> {
        if lens.is_empty() || lens.contains(&0) {
            return Err(Error::input(format!(
                "a prefill graph needs one or more non-empty sequences, got lengths {lens:?}"
            )));
        }
        if lens.iter().all(|&n| n == 1) {
            return Err(Error::input(
                "one token per sequence is a decode step: capture a decode graph instead",
            ));
        }
        let invariant = self.options()?.batch_invariant;
        let lay = Layout::new(
            lens,
            &self.weights.dims,
            self.scan_slots()?,
            want,
            invariant,
        );
        let c = self.capture(lay, Kind::Prefill)?;
        let mut inner = self.lock()?;
        inner
            .graphs
            .prefill
            .retain(|(l, w, _)| !(l == lens && *w == want));
        inner.graphs.prefill.push((lens.to_vec(), want, c));
        Ok(())
    }

    /// The smallest captured decode bucket that holds `batch` sequences.
    pub fn decode_bucket(&self, batch: usize) -> Result<Option<usize>> {
        Ok(self
            .lock()?
            .graphs
            .decode
            .range(batch..)
            .next()
            .map(|(&b, _)| b))
    }

    /// Drop every captured graph.
    pub fn clear_graphs(&self) -> Result<()> {
        self.lock()?.graphs = Graphs::default();
        Ok(())
    }

    /// Replay the decode graph of the smallest bucket ≥ the batch.
    pub fn decode_graph(
        &self,
        tokens: &[u32],
        states: &mut [&mut CudaState],
    ) -> Result<Vec<Vec<f32>>> {
        let vp = self.weights.dims.vocab_padded;
        let mut logits = vec![0f32; tokens.len() * vp];
        self.decode_graph_into(tokens, states, &mut logits)?;
        Ok(logits.chunks(vp).map(<[f32]>::to_vec).collect())
    }

    /// [`CudaModel::decode_graph`] with the `[batch, vocab_padded]` logits copied into `dst`
    /// (which holds at least that many).
    pub fn decode_graph_into(
        &self,
        tokens: &[u32],
        states: &mut [&mut CudaState],
        dst: &mut [f32],
    ) -> Result<()> {
        let n = tokens.len() * self.weights.dims.vocab_padded;
        self.decode_graph_replay(tokens, states, &mut dst[..n])
            .map(|_| ())
    }

    /// Replay the decode graph of the smallest bucket ≥ the batch, its logits left on the
    /// device (queued, not waited for): their address, while the graph lives.
    pub(crate) fn decode_graph_on_device(
        &self,
        tokens: &[u32],
        states: &mut [&mut CudaState],
    ) -> Result<u64> {
        self.decode_graph_replay(tokens, states, &mut [])
    }

    /// The replay of [`CudaModel::decode_graph_into`], its logits copied into `dst` (all of
    /// the batch's, or none); returns their device address.
    fn decode_graph_replay(
        &self,
        tokens: &[u32],
        states: &mut [&mut CudaState],
        dst: &mut [f32],
    ) -> Result<u64> {
        let b = tokens.len();
        let ptrs = self.state_ptrs(states)?;
        let mut inner = self.lock()?;
        let opts = inner.opts;
        let k = self.kernels(&mut inner, opts)?;
        let key = self.capture_key(opts, &k);
        let Some((&bucket, cap)) = inner.graphs.decode.range_mut(b..).next() else {
            return Err(Error::Device(format!(
                "no decode graph holds a batch of {b}: captured buckets {:?}",
                inner.graphs.decode_buckets()
            )));
        };
        check_key(&cap.key, &key, &format!("decode graph for batch {bucket}"))?;
        let sp = match cap.scratch.as_mut() {
            Some(scratch) => scratch.unique_ptr()?,
            None => {
                return Err(Error::Device(
                    "a decode graph without its scratch state".into(),
                ))
            }
        };
        let mut p = ptrs;
        p.resize(bucket, sp);
        let mut t = tokens.to_vec();
        t.resize(bucket, 0);
        self.replay(cap, &t, &p, dst)?;
        Ok(cap.work.logits.ptr)
    }

    /// Replay the prefill graph captured for exactly these sequence lengths.
    pub fn prefill_graph(
        &self,
        seqs: &[&[u32]],
        states: &mut [&mut CudaState],
        want: LogitsWant,
    ) -> Result<Vec<Vec<f32>>> {
        let lens: Vec<usize> = seqs.iter().map(|s| s.len()).collect();
        let ptrs = self.state_ptrs(states)?;
        let mut inner = self.lock()?;
        let opts = inner.opts;
        let k = self.kernels(&mut inner, opts)?;
        let key = self.capture_key(opts, &k);
        let shapes: Vec<String> = inner
            .graphs
            .prefill
            .iter()
            .map(|(l, w, _)| format!("{l:?} {w:?}"))
            .collect();
        let Some((_, _, cap)) = inner
            .graphs
            .prefill
            .iter_mut()
            .find(|(l, w, _)| *l == lens && *w == want)
        else {
            return Err(Error::Device(format!(
                "no prefill graph was captured for lengths {lens:?} with logits {want:?}; captured: [{}]",
                shapes.join(", ")
            )));
        };
        check_key(
            &cap.key,
            &key,
            &format!("prefill graph for lengths {lens:?}"),
        )?;
        let tokens: Vec<u32> = seqs.iter().flat_map(|s| s.iter().copied()).collect();
        let picked = cap.layout.picked.len();
        let mut logits = vec![0f32; picked * self.weights.dims.vocab_padded];
        self.replay(cap, &tokens, &ptrs, &mut logits)?;
        Ok(split_logits(
            &logits,
            seqs,
            want,
            self.weights.dims.vocab_padded,
            false,
        ))
    }

    /// Launch `cap` on these tokens and states; its first `dst.len()` logits land in `dst`.
    fn replay(
        &self,
        cap: &mut Captured,
        tokens: &[u32],
        ptrs: &[u64],
        dst: &mut [f32],
    ) -> Result<()> {
        let gpu = self.gpu();
        let slot = cap.tokens_in.as_mut_slice();
        if slot.len() != tokens.len() {
            return Err(Error::Device(format!(
                "a graph captured for {} tokens was given {}",
                slot.len(),
                tokens.len()
            )));
        }
        if cap.in_flight {
            gpu.sync()?;
            cap.in_flight = false;
        }
        self.sampling.count_pass();
        slot.copy_from_slice(tokens);
        if cap.state_ptrs != ptrs {
            gpu.htod(ptrs, cap.work.states.ptr)?;
            cap.state_ptrs = ptrs.to_vec();
        }
        gpu.bind()?;
        cap.graph
            .launch()
            .map_err(|e| dev_err("launching a CUDA graph", e))?;
        // (`dtoh` waits for the stream, unless there is nothing to copy)
        cap.in_flight = dst.is_empty();
        gpu.dtoh(cap.work.logits.ptr, dst)
    }
}

fn check_key(captured: &CaptureKey, now: &CaptureKey, what: &str) -> Result<()> {
    if captured.opts != now.opts {
        return Err(Error::Device(format!(
            "the {what} was captured with GPU options {:?}, the model now runs {:?}: capture it again",
            captured.opts, now.opts
        )));
    }
    if captured.kernels != now.kernels || captured.weights != now.weights {
        return Err(Error::Device(format!(
            "the {what} was captured over other kernels or weights than the model now holds: capture it again"
        )));
    }
    Ok(())
}
