//! The Mamba-2 reference against `m2-tiny` in every layout.

use super::reference::Reference;
use super::State;
use crate::cpu::Real;
use crate::mixers::family::FamilyWeights;
use crate::mixers::mamba1::golden_tests::{
    against_golden, conv_ssm_parts, fixture, Golden, Oracle, LAYOUTS,
};
use crate::mixers::mamba1::lm::TokenOut;
use crate::mixers::mamba2::weights::Mamba2Weights;
use crate::model::dtype::DType;

impl<F: Real> Oracle<F> for Reference<'_, F> {
    type State = State<F>;
    fn fresh(&self) -> State<F> {
        self.new_state()
    }
    fn step_full(&self, st: &mut State<F>, token: u32) -> TokenOut<F> {
        Reference::step_full(self, st, token).unwrap()
    }
    fn layer_states(&self, st: &State<F>) -> Vec<(Vec<F>, Vec<F>)> {
        let c = self.config();
        conv_ssm_parts(st, c.conv_dim() * c.d_conv)
    }
}

pub(crate) fn load_m2(layout: &str) -> Mamba2Weights {
    match FamilyWeights::load(&fixture(&format!("m2-tiny/{layout}")), DType::F32).unwrap() {
        FamilyWeights::Mamba2(w) => w,
        FamilyWeights::Mamba1(_) => panic!("m2-tiny read as Mamba-1"),
    }
}

#[test]
fn m2_reference_matches_the_goldens_in_every_layout_f64_and_f32() {
    let g = Golden::load("m2-tiny");
    for layout in LAYOUTS {
        let w = load_m2(layout);
        against_golden(
            &Reference::<f64>::new(&w).unwrap(),
            &g,
            &format!("m2-tiny {layout} f64"),
        );
        against_golden(
            &Reference::<f32>::new(&w).unwrap(),
            &g,
            &format!("m2-tiny {layout} f32"),
        );
    }
}

#[test]
fn m2_layouts_hold_the_same_parameters() {
    let official = load_m2("model.safetensors");
    let hf = load_m2("hf");
    assert_eq!(official.layers, hf.layers);
    assert_eq!(official.embedding, hf.embedding);
    assert!(official.lm_head.is_none() && hf.lm_head.is_none());
    assert_eq!(load_m2("pytorch_model.bin").layers, official.layers);
}

#[test]
fn out_of_range_tokens_and_foreign_states_are_errors() {
    let w = load_m2("hf");
    let r = Reference::<f64>::new(&w).unwrap();
    let mut st = r.new_state();
    let e = r.step(&mut st, 1000).unwrap_err().to_string();
    assert!(e.contains("1000") && e.contains("out of range"), "{e}");
    let mut st = r.new_state();
    st.data.push(0.0);
    let e = r.step(&mut st, 1).unwrap_err().to_string();
    assert!(e.contains("does not fit"), "{e}");
}
