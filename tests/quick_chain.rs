mod common;
use common::*;
use mamba3::cpu::{zero_state, CpuModel, LogitsWant, Reference};
use mamba3::model::{DType, Weights};
use std::sync::Arc;

#[test]
fn chunked_matches_reference_on_fixtures() {
    for name in FIXTURES {
        let w = Arc::new(Weights::load(&fixture(name), DType::F64).unwrap());
        let g = Golden::load(name);
        let r = Reference::<f64>::new(&w);
        let mut st = zero_state::<f64>(&w.dims);
        let want: Vec<f64> = r.run(&g.input_ids, &mut st).concat();
        let m = CpuModel::<f64>::new(w.clone());
        let mut s2 = m.zero_state();
        let got = m
            .forward(&[&g.input_ids], &mut [&mut s2], LogitsWant::All)
            .unwrap();
        let e = rel_l2(&got[0], &want);
        println!("{name}: chunked vs ref {e:e}");
        assert!(e < 1e-10);
        // decode from prefix
        let mut s3 = m.zero_state();
        let mut out = m
            .forward(&[&g.input_ids[..g.prefix]], &mut [&mut s3], LogitsWant::All)
            .unwrap()
            .remove(0);
        for &t in &g.input_ids[g.prefix..] {
            out.extend(
                m.forward(&[&[t]], &mut [&mut s3], LogitsWant::Last)
                    .unwrap()
                    .remove(0),
            );
        }
        let e = rel_l2(&out, &want);
        println!("{name}: decode vs ref {e:e}");
        assert!(e < 1e-10);
        let gold = to_f64(&g.logits);
        let m32 =
            CpuModel::<f32>::new(Arc::new(Weights::load(&fixture(name), DType::F32).unwrap()));
        let mut s4 = m32.zero_state();
        let got = m32
            .forward(&[&g.input_ids], &mut [&mut s4], LogitsWant::All)
            .unwrap();
        println!("{name}: f32 vs gold {:e}", rel_l2(&to_f64(&got[0]), &gold));
        let mb = CpuModel::<f32>::new(Arc::new(
            Weights::load(&fixture(name), DType::BF16).unwrap(),
        ));
        let mut s5 = mb.zero_state();
        let got = mb
            .forward(&[&g.input_ids], &mut [&mut s5], LogitsWant::All)
            .unwrap();
        println!("{name}: bf16 vs gold {:e}", rel_l2(&to_f64(&got[0]), &gold));
    }
}
