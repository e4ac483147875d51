//! 4-bit quantisation against bitsandbytes' own (tests/fixtures/quant4, made by
//! `make_quant4_fixture.py` with bitsandbytes 0.50.2 on the CPU), and round trips.

use std::collections::HashMap;

use candle_core::{Device, Tensor};

use super::*;

fn fixture() -> HashMap<String, Tensor> {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/fixtures/quant4/quant4.safetensors"
    );
    candle_core::safetensors::load(path, &Device::Cpu).unwrap()
}

fn floats(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_vec1().unwrap()
}

fn bytes(t: &Tensor) -> Vec<u8> {
    t.flatten_all().unwrap().to_vec1().unwrap()
}

/// Equal, or the count and first places of the differences.
fn same<T: PartialEq + std::fmt::Debug>(a: &[T], b: &[T], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    let differ: Vec<(usize, &T, &T)> = (0..a.len())
        .filter(|&i| a[i] != b[i])
        .map(|i| (i, &a[i], &b[i]))
        .collect();
    assert!(
        differ.is_empty(),
        "{what}: {} differ, first {:?}",
        differ.len(),
        &differ[..differ.len().min(8)]
    );
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Every case of the fixture: the same packed codes, block absmaxes (or, nested, the same
/// 8-bit codes of the absmaxes, their absmaxes and offset) bit for bit, and the same
/// de-quantised values.
#[test]
fn codes_and_scales_are_bitsandbytes_own() {
    let all = fixture();
    let mut cases: Vec<&str> = all
        .keys()
        .filter_map(|k| k.strip_suffix(".input"))
        .collect();
    cases.sort();
    assert_eq!(cases.len(), 6, "{cases:?}");
    for case in cases {
        let parts: Vec<&str> = case.split('-').collect();
        let kind = match parts[0] {
            "nf4" => FourBit::Nf4,
            _ => FourBit::Fp4,
        };
        let (block, nested) = (parts[1].parse().unwrap(), parts[2] == "nested");
        let get = |what: &str| &all[&format!("{case}.{what}")];
        let input = floats(get("input"));
        let q = quantize_4bit(&input, block, kind, nested);
        same(&q.codes, &bytes(get("codes")), &format!("{case}: codes"));
        match &q.scales {
            Scales::Plain(absmax) => {
                same(
                    &bits(absmax),
                    &bits(&floats(get("absmax"))),
                    &format!("{case}: absmax"),
                );
            }
            Scales::Nested {
                codes,
                absmax,
                offset,
                ..
            } => {
                same(
                    codes,
                    &bytes(get("absmax_codes")),
                    &format!("{case}: absmax codes"),
                );
                assert_eq!(
                    bits(absmax),
                    bits(&floats(get("absmax2"))),
                    "{case}: absmax2"
                );
                assert_eq!(
                    offset.to_bits(),
                    floats(get("offset"))[0].to_bits(),
                    "{case}: offset"
                );
            }
        }
        let dequantized = floats(get("dequantized"));
        // Equal as numbers: the sign of FP4's zero (code 8) depends on which of bitsandbytes'
        // CPU paths de-quantises (its library's +0 for rows of even length, torch's -0
        // otherwise); every other value is the same bits.
        same(&q.dequantize(), &dequantized, &format!("{case}: values"));
    }
}

/// The map double quantisation uses is bitsandbytes' `create_dynamic_map()`.
#[test]
fn the_dynamic_map_is_bitsandbytes_own() {
    let map = floats(&fixture()["dynamic_map"]);
    assert_eq!(bits(&dynamic_map()), bits(&map));
}

/// De-quantised values quantise back to themselves, and each is within
/// half of the widest gap between levels (times its block's absmax) of what was quantised.
#[test]
fn round_trips_keep_the_values_and_bound_the_error() {
    let mut rng = ddpjob_rng::Mt19937::new(3);
    let values: Vec<f32> = (0..64 * 37 + 5).map(|_| 0.05 * rng.normal()).collect();
    for kind in [FourBit::Nf4, FourBit::Fp4] {
        let (order, _) = kind.bounds();
        let levels = kind.levels();
        let gap = (0..15)
            .map(|i| levels[order[i + 1]] - levels[order[i]])
            .fold(0f32, f32::max);
        let q = quantize_4bit(&values, 64, kind, false);
        let back = q.dequantize();
        let scales = q.absmaxes();
        for (i, (x, y)) in values.iter().zip(&back).enumerate() {
            assert!(
                (x - y).abs() <= 0.5 * gap * scales[i / 64] * 1.0001,
                "{kind:?} {i}"
            );
        }
        let again = quantize_4bit(&back, 64, kind, false).dequantize();
        same(&bits(&again), &bits(&back), &format!("{kind:?}"));
    }
}

/// A weight of 150 × 320 in NF4 with nested scales (row panels of 64 with a short last one,
/// column panels of 256 and 64), and its dense f32 copy.
fn weight() -> (Quantized4Weight, Tensor) {
    let mut rng = ddpjob_rng::Mt19937::new(8);
    let values: Vec<f32> = (0..150 * 320).map(|_| 0.05 * rng.normal()).collect();
    let w =
        Quantized4Weight::new(quantize_4bit(&values, 64, FourBit::Nf4, true), 150, 320).unwrap();
    let dense = Tensor::from_vec(w.dequantized(), (150, 320), &Device::Cpu).unwrap();
    (w, dense)
}

/// x·Wᵀ from the 4-bit weight, panel by panel, is x·Wᵀ of its de-quantised copy: values and
/// x's gradient within 1e-5.
#[test]
fn the_4bit_linear_is_the_product_with_the_dequantized_weight() {
    let (w, dense) = weight();
    let x = crate::testing::random(&[7, 320], 0.0, 4);
    crate::testing::same_with_gradients(
        &[x],
        |xs| quantized_linear(xs[0], &w).unwrap(),
        |xs| xs[0].matmul(&dense.t().unwrap()).unwrap(),
        1e-5,
    );
    assert_eq!(w.bytes(), 150 * 320 / 2 + 4 * 150 * 320 / 64);
}

/// The same bits on 1 and 3 threads, forward and backward.
#[test]
fn the_4bit_linear_gives_the_same_bits_for_any_thread_count() {
    let (w, _) = weight();
    let x = crate::testing::random(&[9, 320], 0.0, 6);
    let run = |threads: usize| {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        pool.install(|| {
            let y = quantized_linear(x.as_tensor(), &w).unwrap();
            let grads = crate::host::uneven_sum(&y).backward().unwrap();
            (
                crate::f32_bits(&y),
                crate::f32_bits(grads.get(x.as_tensor()).unwrap()),
            )
        })
    };
    assert!(run(1) == run(3));
}

/// Blocks that would straddle the weight's rows, or a length that is not the shape, are
/// refused with what to change.
#[test]
fn weights_whose_blocks_straddle_rows_are_refused() {
    let q = quantize_4bit(&vec![0.5f32; 100 * 10], 64, FourBit::Nf4, false);
    let err = Quantized4Weight::new(q.clone(), 10, 100).unwrap_err();
    assert!(
        err.contains("not a multiple of the quantisation block size 64"),
        "{err}"
    );
    let err = Quantized4Weight::new(q, 20, 100).unwrap_err();
    assert!(err.contains("is not [20, 100]"), "{err}");
}

/// The fused QLoRA layer (`lora_linear_4bit`) is the 4-bit product plus the adapter's, as
/// composed ops over the de-quantised weight: values and the gradients of x, A and B within
/// 1e-5, with a bias.
#[test]
fn the_4bit_lora_layer_matches_its_composition_with_gradients() {
    let (w, dense) = weight();
    let (x, a, b) = (
        crate::testing::random(&[7, 320], 0.0, 4),
        crate::testing::random(&[4, 320], 0.0, 5),
        crate::testing::random(&[150, 4], 0.0, 6),
    );
    let bias = crate::testing::random(&[150], 0.0, 7).as_tensor().clone();
    crate::testing::same_with_gradients(
        &[x, a, b],
        |v| crate::lora_linear_4bit(v[0], &w, &bias, (v[1], v[2]), 2.0, None).unwrap(),
        |v| {
            let base = v[0].matmul(&dense.t().unwrap()).unwrap();
            let base = base.broadcast_add(&bias).unwrap();
            let low = v[0].matmul(&v[1].t().unwrap()).unwrap();
            let low = low.matmul(&v[2].t().unwrap()).unwrap();
            (base + (low * 2.0).unwrap()).unwrap()
        },
        1e-5,
    );
}
