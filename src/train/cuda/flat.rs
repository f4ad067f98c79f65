//! Typed device addresses into the flat f32 buffers of `crate::train::flat::FlatLayout`
//! (parameters, gradients, AdamW's two moments, and the 16-bit copies of the matrices).

use crate::mixers::mamba3::params::Params;
pub use crate::train::flat::FlatLayout;

impl FlatLayout {
    /// Typed device addresses of the tensors in the flat buffer at `base` whose elements
    /// are `elem` bytes.
    pub fn addrs(&self, p: &Params<f32>, base: u64, elem: usize) -> Addrs {
        let mut it = self
            .spans
            .iter()
            .map(|&(off, _)| base + (elem * off) as u64);
        let mut next = || it.next().expect("one span per tensor");
        let embedding = next();
        let layers = p
            .layers
            .iter()
            .map(|l| {
                let norm = next();
                let dt_bias = next();
                let b_bias = next();
                let c_bias = next();
                let mimo = l.mimo.as_ref().map(|_| {
                    let x = next();
                    let z = next();
                    let o = next();
                    MimoAddrs { x, z, o }
                });
                let d = next();
                let in_proj = next();
                let b_norm = next();
                let c_norm = next();
                let out_norm = l.out_norm.as_ref().map(|_| next());
                let out_proj = next();
                let mlp = l.mlp.as_ref().map(|_| {
                    let norm = next();
                    let fc1 = next();
                    let fc2 = next();
                    MlpAddrs { norm, fc1, fc2 }
                });
                LayerAddrs {
                    norm,
                    dt_bias,
                    b_bias,
                    c_bias,
                    mimo,
                    d,
                    in_proj,
                    b_norm,
                    c_norm,
                    out_norm,
                    out_proj,
                    mlp,
                }
            })
            .collect();
        let norm_f = next();
        let lm_head = p.lm_head.as_ref().map(|_| next());
        Addrs {
            embedding,
            layers,
            norm_f,
            lm_head,
        }
    }
}

#[derive(Clone, Copy)]
pub struct MlpAddrs {
    pub norm: u64,
    pub fc1: u64,
    pub fc2: u64,
}

/// A MIMO layer's per-rank projections `mimo_x`, `mimo_z`, `mimo_o`.
#[derive(Clone, Copy)]
pub struct MimoAddrs {
    pub x: u64,
    pub z: u64,
    pub o: u64,
}

#[derive(Clone)]
pub struct LayerAddrs {
    pub norm: u64,
    pub dt_bias: u64,
    pub b_bias: u64,
    pub c_bias: u64,
    /// MIMO only
    pub mimo: Option<MimoAddrs>,
    pub d: u64,
    pub in_proj: u64,
    pub b_norm: u64,
    pub c_norm: u64,
    pub out_norm: Option<u64>,
    pub out_proj: u64,
    pub mlp: Option<MlpAddrs>,
}

/// Device addresses of every tensor, by role (the order of `Params::tensors`).
#[derive(Clone)]
pub struct Addrs {
    pub embedding: u64,
    pub layers: Vec<LayerAddrs>,
    pub norm_f: u64,
    pub lm_head: Option<u64>,
}

impl Addrs {
    /// The head matrix (the embedding when tied).
    pub fn head(&self) -> u64 {
        self.lm_head.unwrap_or(self.embedding)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::config::Config;

    #[test]
    fn addresses_follow_the_layout() {
        let mut cfg = Config::synthetic(32, 2, 16, 16, 2, 1, 256);
        cfg.d_intermediate = 64;
        cfg.tie_embeddings = false;
        let p = Params::<f32>::zeros(&cfg);
        let f = FlatLayout::new(&p);
        let a = f.addrs(&p, 0, 4);
        assert_eq!(a.embedding, 4 * f.spans[0].0 as u64);
        assert_eq!(f.addrs(&p, 0, 2).embedding, 2 * f.spans[0].0 as u64);
        assert!(a.layers[1].mlp.is_some() && a.lm_head.is_some());
    }

    #[test]
    fn a_mimo_layer_addresses_its_rank_projections() {
        let mut cfg = Config::synthetic(32, 2, 16, 16, 2, 1, 256);
        cfg.ssm_cfg.is_mimo = true;
        cfg.ssm_cfg.mimo_rank = 2;
        let p = Params::<f32>::zeros(&cfg);
        let f = FlatLayout::new(&p);
        let a = f.addrs(&p, 0, 4);
        let at = |suffix: &str, l: usize| {
            let name = format!("backbone.layers.{l}.mixer.{suffix}");
            let i = p.tensors().iter().position(|(n, _)| *n == name).unwrap();
            4 * f.spans[i].0 as u64
        };
        for (l, la) in a.layers.iter().enumerate() {
            let m = la.mimo.expect("a MIMO layer");
            assert_eq!(
                (m.x, m.z, m.o),
                (at("mimo_x", l), at("mimo_z", l), at("mimo_o", l))
            );
            assert_eq!((la.b_bias, la.d), (at("B_bias", l), at("D", l)));
        }
    }
}
