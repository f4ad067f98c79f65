//! The backward's word that gradients are final: the hook through which a data-parallel
//! replica starts a bucket's all-reduce while the backward goes on with the layers below
//! (`super::parallel`).
//!
//! The backward of the LM (`super::model::loss_and_grad` on the host, `super::cuda`'s
//! `backward` on a GPU; SISO and MIMO alike) finishes the model's tensors in stages:
//!
//! 1. [`Stage::Head`]: the final norm and an untied head;
//! 2. [`Stage::Layer`] `n_layer − 1`, …, `0`: every tensor of that layer;
//! 3. [`Stage::Embedding`]: the embedding, and with it a tied head, whose gradient the
//!    backward's first step began.
//!
//! After each stage it calls [`GradReady::ready`]. Nothing later in the same backward adds
//! to a tensor of a stage already announced.

use crate::error::Result;

/// A part of the model whose gradients the backward finishes at once (see the module doc).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stage {
    Head,
    Layer(usize),
    Embedding,
}

impl Stage {
    /// The stage that finishes the tensor `name` (an official tensor name) of a model of
    /// `n_layer` layers. A tied model has no `lm_head.weight`: its head is the embedding.
    pub fn of(name: &str, n_layer: usize) -> Stage {
        if name == "backbone.embedding.weight" {
            return Stage::Embedding;
        }
        match (name.strip_prefix("backbone.layers."))
            .and_then(|rest| rest.split('.').next())
            .and_then(|i| i.parse::<usize>().ok())
        {
            Some(layer) if layer < n_layer => Stage::Layer(layer),
            // the final norm and the head
            _ => Stage::Head,
        }
    }

    /// Where the stage comes in the backward: larger keys finish first (the head
    /// `n_layer + 1`, layer `l` at `l + 1`, the embedding 0).
    pub fn key(self, n_layer: usize) -> usize {
        match self {
            Stage::Head => n_layer + 1,
            Stage::Layer(l) => l + 1,
            Stage::Embedding => 0,
        }
    }

    /// Every stage of a model of `n_layer` layers, in the backward's order.
    pub fn all(n_layer: usize) -> Vec<Stage> {
        let layers = (0..n_layer).rev().map(Stage::Layer);
        std::iter::once(Stage::Head)
            .chain(layers)
            .chain(std::iter::once(Stage::Embedding))
            .collect()
    }
}

/// Told by a backward that a stage's gradients are final. `G` is the gradient as the
/// backward holds it: the host's tensors (`Params<F>`), or `()` on a GPU, whose hook
/// addresses the device buffer itself.
pub trait GradReady<G: ?Sized> {
    /// Every gradient of `stage`, and of the stages before it in the backward, is final.
    fn ready(&mut self, stage: Stage, grad: &mut G) -> Result<()>;
}

/// The hook of a backward that nobody waits on.
pub struct NoHook;

impl<G: ?Sized> GradReady<G> for NoHook {
    fn ready(&mut self, _: Stage, _: &mut G) -> Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mixers::mamba3::params::Params;
    use crate::model::config::Config;

    #[test]
    fn every_tensor_has_the_stage_of_its_place() {
        let mut c = Config::synthetic(32, 3, 16, 16, 2, 1, 256);
        c.d_intermediate = 64;
        c.tie_embeddings = false;
        let p = Params::<f32>::zeros(&c);
        for (name, _) in p.tensors() {
            let layer = (0..3).find(|l| name.starts_with(&format!("backbone.layers.{l}.")));
            let want = match (layer, name.as_str()) {
                (Some(l), _) => Stage::Layer(l),
                (None, "backbone.norm_f.weight" | "lm_head.weight") => Stage::Head,
                (None, "backbone.embedding.weight") => Stage::Embedding,
                _ => panic!("a tensor of no known place: {name}"),
            };
            assert_eq!(Stage::of(&name, 3), want, "{name}");
        }
        let keys: Vec<usize> = Stage::all(3).iter().map(|s| s.key(3)).collect();
        assert_eq!(keys, [4, 3, 2, 1, 0]);
    }
}
