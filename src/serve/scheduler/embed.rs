//! Embedding requests on the engine thread: each input read from a fresh state, at most
//! `prefill_chunk` tokens a turn, its rows pooled.

use super::*;

/// An embedding request being read, one input after another.
pub(super) struct EmbedTask {
    pub(super) job: EmbedJob,
    /// The input being read.
    pub(super) input: usize,
    pub(super) state: Option<State>,
    /// Tokens of that input already read.
    pub(super) fed: usize,
    /// Sum of its pooled rows so far (f64).
    pub(super) sum: Vec<f64>,
    pub(super) out: Vec<Vec<f32>>,
}

impl Scheduler {
    /// Read at most `prefill_chunk` tokens of the oldest embedding request (each input
    /// from a fresh state, in continued windows), so that a long input does not stall the
    /// running sequences; answer it when its last input is read.
    pub(super) fn embed_step(&mut self) -> Result<(), String> {
        let mut budget = self.cfg.prefill_chunk.max(1);
        // (the hidden states are computed on the CPU whatever the model's device)
        let on_cpu = self.model.device() == Device::Cpu;
        while budget > 0 {
            let Some(task) = self.embeds.front_mut() else {
                return Ok(());
            };
            if task.job.reply.is_closed() {
                self.embeds.pop_front();
                continue;
            }
            let tokens = &task.job.inputs[task.input];
            let end = tokens.len().min(task.fed + budget);
            let last = end == tokens.len();
            let want = match (task.job.pooling, last) {
                (Pooling::Mean, _) => LogitsWant::All,
                (Pooling::Last, true) => LogitsWant::Last,
                (Pooling::Last, false) => LogitsWant::None,
            };
            let state = task.state.get_or_insert_with(|| self.model.new_state());
            let t = Instant::now();
            let rows = self.model.hidden(&tokens[task.fed..end], state, want);
            if on_cpu {
                self.device.device_busy.since(t);
            }
            let rows = rows.map_err(|e| e.to_string())?;
            let d = task.sum.len();
            for r in rows.chunks(d) {
                task.sum
                    .iter_mut()
                    .zip(r)
                    .for_each(|(a, &b)| *a += b as f64);
            }
            budget -= end - task.fed;
            task.fed = end;
            if !last {
                continue;
            }
            let n = match task.job.pooling {
                Pooling::Mean => tokens.len(),
                Pooling::Last => 1,
            };
            let v = task.sum.iter().map(|&x| (x / n as f64) as f32).collect();
            task.out.push(v);
            task.sum.iter_mut().for_each(|x| *x = 0.0);
            task.state = None;
            task.fed = 0;
            task.input += 1;
            if task.input == task.job.inputs.len() {
                if let Some(t) = self.embeds.pop_front() {
                    let _ = t.job.reply.send(Ok(t.out));
                }
            }
        }
        Ok(())
    }
}
