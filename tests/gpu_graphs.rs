//! CUDA graphs: replay is bit-identical to eager execution, and refuses (with an error)
//! what does not match its capture. The fused decode (one launch for every layer) is
//! bit-identical to the launch per kernel. Run on a machine with a CUDA device:
//! `cargo test --test gpu_graphs -- --include-ignored`.

mod gpu;
use gpu::*;
use mamba3::engine::{Device, GpuOptions, LogitsWant, Model, State};
use mamba3::mixers::mamba3::Weights;
use mamba3::model::DType;

fn model(dtype: DType) -> Model {
    let cfg = config(128, 3, 64, 32, 2, 0.5, true, 128, 32);
    Model::from_weights(Weights::synthetic(cfg, dtype, 11).unwrap(), Device::Cuda(0)).unwrap()
}

fn hosts(states: &[State]) -> Vec<mamba3::model::state_layout::StateBuf<f32>> {
    states.iter().map(|s| s.to_host().unwrap()).collect()
}

/// Three decode steps from `states`, eager or through the graphs.
fn decode3(m: &Model, states: &mut [State], graph: bool) -> Vec<f32> {
    decode3_rows(m, states, graph, 0)
}

#[test]
#[ignore = "needs a CUDA device"]
fn decode_graph_replay_is_bit_identical_to_eager() {
    for dtype in [DType::BF16, DType::F32] {
        let m = model(dtype);
        // bucket 4 exactly, bucket 4 padded (3 rows), bucket 16 padded (12 rows: two lanes
        // of GEMVs in f32), large batches (cuBLASLt; 40 rows: two lanes)
        for (bucket, batch) in [(4usize, 4usize), (4, 3), (16, 12), (24, 24), (40, 40)] {
            m.capture_decode_graph(bucket).unwrap();
            let base = primed(&m, batch);
            let mut eager = base.clone();
            let mut graph = base.clone();
            let a = decode3(&m, &mut eager, false);
            let b = decode3(&m, &mut graph, true);
            assert!(
                a == b,
                "{dtype:?} bucket {bucket} batch {batch}: logits differ"
            );
            assert!(
                hosts(&eager) == hosts(&graph),
                "{dtype:?} bucket {bucket} batch {batch}: states differ"
            );
            // Model::decode picks the graph by itself once one holds the batch.
            let mut auto = base.clone();
            let c = {
                let mut st: Vec<&mut State> = auto.iter_mut().collect();
                let toks: Vec<u32> = (0..batch).map(|b| (b * 31 % 200) as u32).collect();
                m.decode(&toks, &mut st).unwrap().data
            };
            assert_eq!(
                &c[..],
                &b[..c.len()],
                "Model::decode did not replay the graph"
            );
            println!("{dtype:?} decode graph bucket {bucket} batch {batch}: bit-identical");
        }
        m.clear_graphs().unwrap();
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn prefill_graph_replay_is_bit_identical_to_eager() {
    let m = model(DType::BF16);
    let lens = [37usize, 70, 5];
    for want in [LogitsWant::All, LogitsWant::Last] {
        m.capture_prefill_graph(&lens, want).unwrap();
        let seqs: Vec<Vec<u32>> = lens
            .iter()
            .enumerate()
            .map(|(i, &n)| tokens(n, m.dims().vocab_size, 90 + i as u64))
            .collect();
        let refs: Vec<&[u32]> = seqs.iter().map(|s| s.as_slice()).collect();
        // fresh states, then continued states
        let base = primed(&m, lens.len());
        for start in [None, Some(base)] {
            let mk = || {
                start
                    .clone()
                    .unwrap_or_else(|| lens.iter().map(|_| m.new_state()).collect())
            };
            let (mut e, mut g) = (mk(), mk());
            let le = m
                .prefill_batch(&refs, &mut e.iter_mut().collect::<Vec<_>>(), want)
                .unwrap();
            let lg = m
                .prefill_graph(&refs, &mut g.iter_mut().collect::<Vec<_>>(), want)
                .unwrap();
            assert!(le == lg, "{want:?}: logits differ");
            assert!(hosts(&e) == hosts(&g), "{want:?}: states differ");
            assert_eq!(e[0].position(), g[0].position());
        }
        println!("prefill graph {lens:?} {want:?}: bit-identical");
    }
}

/// A prefill graph that reads no logits back returns without waiting for the GPU; a
/// second replay straight after, on other tokens, must not overwrite the tokens the first
/// is copying (each leaves the states its own eager prefill leaves).
#[test]
#[ignore = "needs a CUDA device"]
fn prefill_graph_replays_back_to_back_keep_their_tokens() {
    let m = model(DType::BF16);
    let lens = [300usize, 260];
    m.capture_prefill_graph(&lens, LogitsWant::None).unwrap();
    let batch = |seed: u64| -> Vec<Vec<u32>> {
        lens.iter()
            .enumerate()
            .map(|(i, &n)| tokens(n, m.dims().vocab_size, seed + i as u64))
            .collect()
    };
    let (first, second) = (batch(500), batch(600));
    let fresh = || lens.iter().map(|_| m.new_state()).collect::<Vec<State>>();
    let (mut g1, mut g2, mut e1, mut e2) = (fresh(), fresh(), fresh(), fresh());
    for (b, g) in [(&first, &mut g1), (&second, &mut g2)] {
        let r: Vec<&[u32]> = b.iter().map(|s| s.as_slice()).collect();
        m.prefill_graph(&r, &mut g.iter_mut().collect::<Vec<_>>(), LogitsWant::None)
            .unwrap();
    }
    for (b, e) in [(&first, &mut e1), (&second, &mut e2)] {
        let r: Vec<&[u32]> = b.iter().map(|s| s.as_slice()).collect();
        m.prefill_batch(&r, &mut e.iter_mut().collect::<Vec<_>>(), LogitsWant::None)
            .unwrap();
    }
    assert!(
        hosts(&g1) == hosts(&e1),
        "the first replay's states differ from eager"
    );
    assert!(
        hosts(&g2) == hosts(&e2),
        "the second replay's states differ from eager"
    );
    assert!(
        hosts(&g1) != hosts(&g2),
        "two batches of other tokens left the same states"
    );
    println!("prefill graph {lens:?} None, two replays back to back: bit-identical to eager");
}

#[test]
#[ignore = "needs a CUDA device"]
fn replay_refuses_what_differs_from_capture() {
    let m = model(DType::BF16);
    m.capture_decode_graph(4).unwrap();
    m.capture_prefill_graph(&[10, 20], LogitsWant::Last)
        .unwrap();
    let mut st = primed(&m, 5);
    // a batch larger than every bucket
    let err = m
        .decode_graph(&[1, 2, 3, 4, 5], &mut st.iter_mut().collect::<Vec<_>>())
        .unwrap_err();
    println!("batch 5, bucket 4: {err}");
    // other lengths, other logits wanted
    let a = tokens(10, 200, 1);
    let b = tokens(21, 200, 2);
    let err = m
        .prefill_graph(
            &[&a, &b],
            &mut st[..2].iter_mut().collect::<Vec<_>>(),
            LogitsWant::Last,
        )
        .unwrap_err();
    println!("lengths [10, 21]: {err}");
    let b = tokens(20, 200, 2);
    assert!(m
        .prefill_graph(
            &[&a, &b],
            &mut st[..2].iter_mut().collect::<Vec<_>>(),
            LogitsWant::All
        )
        .is_err());
    // numeric options changed since the capture
    let o = m.gpu_options().unwrap().unwrap();
    m.set_gpu_options(GpuOptions { fast: !o.fast, ..o })
        .unwrap();
    let err = m
        .decode_graph(&[1, 2, 3, 4], &mut st[..4].iter_mut().collect::<Vec<_>>())
        .unwrap_err();
    println!("options changed: {err}");
    assert!(m
        .prefill_graph(
            &[&a, &b],
            &mut st[..2].iter_mut().collect::<Vec<_>>(),
            LogitsWant::Last
        )
        .is_err());
    // Model::decode does not silently replay a stale graph either: it refuses.
    assert!(m
        .decode(&[1, 2, 3, 4], &mut st[..4].iter_mut().collect::<Vec<_>>())
        .is_err());
    // back to the capture's options: replays again
    m.set_gpu_options(o).unwrap();
    m.decode_graph(&[1, 2, 3, 4], &mut st[..4].iter_mut().collect::<Vec<_>>())
        .unwrap();
    m.prefill_graph(
        &[&a, &b],
        &mut st[..2].iter_mut().collect::<Vec<_>>(),
        LogitsWant::Last,
    )
    .unwrap();
    // states stay untouched by a refused replay
    let before = hosts(&st);
    let _ = m.decode_graph(&[1, 2, 3, 4, 5], &mut st.iter_mut().collect::<Vec<_>>());
    assert!(hosts(&st) == before);
}

#[test]
#[ignore = "needs a CUDA device"]
fn fused_decode_is_bit_identical_to_the_unfused_launches() {
    // the small model (MLP, out-proj norm, 2 groups); a wide one-layer model whose GEMVs
    // give some blocks three tiles and whose out_proj rows do not fit the weights loaded
    // ahead (the fused step takes batches whose heads fit in one block per SM: the small
    // model's 8 heads at every batch here, the wide model's 96 at batch 1)
    let wide = config(1536, 1, 64, 32, 1, 1.0, false, 0, 64);
    let cases = [
        (model(DType::BF16), vec![1usize, 5, 8, 13, 16]),
        (model(DType::F16), vec![1, 8, 16]),
        (
            Model::from_weights(
                Weights::synthetic(wide, DType::BF16, 5).unwrap(),
                Device::Cuda(0),
            )
            .unwrap(),
            vec![1, 2],
        ),
    ];
    for (m, batches) in cases {
        let o = m.gpu_options().unwrap().unwrap();
        for batch in batches {
            let base = primed(&m, batch);
            let mut runs = vec![];
            for fused in [true, false] {
                m.set_gpu_options(GpuOptions {
                    fused_decode: fused,
                    ..o
                })
                .unwrap();
                let mut st = base.clone();
                let lg = decode3(&m, &mut st, false);
                assert!(lg.iter().all(|v| v.is_finite()));
                runs.push((lg, hosts(&st)));
            }
            let d = m.dims();
            assert!(
                runs[0].0 == runs[1].0,
                "d_model {} batch {batch}: logits differ",
                d.d_model
            );
            assert!(
                runs[0].1 == runs[1].1,
                "d_model {} batch {batch}: states differ",
                d.d_model
            );
            println!(
                "d_model {} batch {batch}: fused decode bit-identical",
                d.d_model
            );
        }
        m.set_gpu_options(o).unwrap();
    }
}

/// A large decode batch cut into lanes (rows on streams of their own): each lane leaves
/// the states the decode of its rows alone leaves (bit-identical), and the logits agree
/// with those of one lane and of the rows alone (whose projections or head may take
/// another route at their batch size: cuBLASLt, the 16-bit y).
#[test]
#[ignore = "needs a CUDA device"]
fn decode_lanes_are_the_decode_of_their_rows_alone() {
    let batch = 24;
    let f = |v: &[f32]| v.iter().map(|&x| x as f64).collect::<Vec<_>>();
    for dtype in [DType::BF16, DType::F32] {
        let m = model(dtype);
        let o = m.gpu_options().unwrap().unwrap();
        let bound = if dtype == DType::F32 { 1e-5 } else { 1e-2 };
        let base = primed(&m, batch);
        let run = |lanes: usize, states: &mut [State], first: usize| {
            m.set_gpu_options(GpuOptions {
                decode_lanes: lanes,
                ..o
            })
            .unwrap();
            decode3_rows(&m, states, false, first)
        };
        let mut one_st = base.clone();
        let one = run(1, &mut one_st, 0);
        let per_row = one.len() / 3 / batch;
        for lanes in 2..=4 {
            let mut st = base.clone();
            let all = run(lanes, &mut st, 0);
            for lane in 0..lanes {
                let (r0, r1) = (batch * lane / lanes, batch * (lane + 1) / lanes);
                let mut part = base[r0..r1].to_vec();
                let alone = run(lanes, &mut part, r0);
                assert!(
                    hosts(&st[r0..r1]) == hosts(&part),
                    "{dtype:?} {lanes} lanes, lane {lane}: states differ"
                );
                let n = (r1 - r0) * per_row;
                for step in 0..3 {
                    let at = |b: usize| (step * batch + b) * per_row;
                    let e = rel_l2(
                        &f(&all[at(r0)..at(r1)]),
                        &f(&alone[step * n..(step + 1) * n]),
                    );
                    assert!(
                        e < bound,
                        "{dtype:?} {lanes} lanes, lane {lane}: logits {e:e}"
                    );
                }
            }
            let e = rel_l2(&f(&all), &f(&one));
            println!("{dtype:?} batch {batch}, {lanes} lanes against one: rel L2 {e:.3e}");
            assert!(e < bound, "{dtype:?} {lanes} lanes: {e:e}");
        }
        assert!(m
            .set_gpu_options(GpuOptions {
                decode_lanes: 5,
                ..o
            })
            .is_err());
        m.set_gpu_options(o).unwrap();
    }
}

#[test]
fn graphs_are_refused_on_the_cpu() {
    let cfg = config(64, 1, 32, 16, 1, 0.5, false, 0, 16);
    let m =
        Model::from_weights(Weights::synthetic(cfg, DType::F32, 1).unwrap(), Device::Cpu).unwrap();
    assert!(m.capture_decode_graph(1).is_err());
}
