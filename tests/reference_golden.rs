//! The f64 reference against the official goldens: the oracle must itself be right.
mod common;
use common::*;
use mamba3::mixers::mamba3::state::{layers, zero_state};
use mamba3::mixers::mamba3::Reference;
use mamba3::mixers::mamba3::Weights;
use mamba3::model::DType;

#[test]
fn reference_matches_goldens_in_f64() {
    for name in FIXTURES {
        let w = Weights::load(&fixture(name), DType::F64).unwrap();
        let g = Golden::load(name);
        let r = Reference::<f64>::new(&w);
        let mut st = zero_state::<f64>(&w.dims);
        let out: Vec<f64> = r.run(&g.input_ids, &mut st).concat();
        let err = rel_l2(&out, &g.logits);
        assert!(err < 1e-6, "{name}: logits rel L2 {err:e}");
        // states after the prefix
        let mut st = zero_state::<f64>(&w.dims);
        r.run(&g.input_ids[..g.prefix], &mut st);
        for (l, ls) in layers(&st, &w.dims).iter().enumerate() {
            let e_ssm = rel_l2(ls.ssm, &g.tensor(&format!("state.{l}.ssm")));
            let e_k = rel_l2(ls.k, &g.tensor(&format!("state.{l}.k")));
            let e_v = rel_l2(ls.v, &g.tensor(&format!("state.{l}.v")));
            let e_a = rel_l2_angles(ls.angle, &g.tensor(&format!("state.{l}.angle")));
            assert!(
                e_ssm < 1e-5 && e_k < 1e-5 && e_v < 1e-5 && e_a < 1e-5,
                "{name} layer {l}: ssm {e_ssm:e} k {e_k:e} v {e_v:e} angle {e_a:e}"
            );
        }
    }
}
