//! The 4-bit weight and its saved form, round trips and refusals.
use candle_core::{Device, Tensor};

use super::*;

fn weight(double_quant: bool) -> (PackedWeight, Vec<f32>) {
    let spec = QuantizeSpec {
        kind: QuantType::Nf4,
        block_size: 64,
        double_quant,
    };
    let values: Vec<f32> = (0..24 * 128).map(|i| ((i as f32) * 0.37).sin()).collect();
    let w = PackedWeight::blank("w", 24, 128, spec).unwrap();
    w.fill(&values).unwrap();
    (w, values)
}

/// What a job's final weights hold of a 4-bit weight (bitsandbytes' tensors) reads back
/// as the same codes and scales, and de-quantises to its values within the type's step.
#[test]
fn saved_weights_read_back_the_same_and_dequantize() {
    for nested in [false, true] {
        let (w, values) = weight(nested);
        let saved: std::collections::HashMap<String, Tensor> =
            w.saved("w", &Device::Cpu).unwrap().into_iter().collect();
        let state = state_name("w", saved.keys()).unwrap().clone();
        assert_eq!(state, "w.quant_state.bitsandbytes__nf4");
        assert!(
            saved.keys().all(|n| is_part_of(n, "w")),
            "{:?}",
            saved.keys()
        );
        let again = PackedWeight::blank("w", 24, 128, w.spec).unwrap();
        let get = |n: &str| saved.get(n).cloned().ok_or(n.to_string());
        again.fill_saved("w", &state, &get).unwrap();
        assert!(again.get().unwrap().stored() == w.get().unwrap().stored());
        let dense = dequantize_saved(saved).unwrap();
        let dense: Vec<f32> = dense["w"].flatten_all().unwrap().to_vec1().unwrap();
        assert_eq!(dense, w.get().unwrap().dequantized());
        let worst = dense.iter().zip(&values).map(|(a, b)| (a - b).abs());
        assert!(worst.fold(0f32, f32::max) < 0.2, "nested {nested}");
    }
}

/// A saved weight of another format or shape is refused with what to set.
#[test]
fn saved_weights_of_another_format_are_refused() {
    let (w, _) = weight(true);
    let saved: std::collections::HashMap<String, Tensor> =
        w.saved("w", &Device::Cpu).unwrap().into_iter().collect();
    let get = |n: &str| saved.get(n).cloned().ok_or(n.to_string());
    let state = "w.quant_state.bitsandbytes__nf4";
    let plain = QuantizeSpec {
        double_quant: false,
        ..w.spec
    };
    let err = PackedWeight::blank("w", 24, 128, plain)
        .unwrap()
        .fill_saved("w", state, &get)
        .unwrap_err();
    assert!(
        err.contains("set [model.quantize] as it was saved"),
        "{err}"
    );
    let err = PackedWeight::blank("w", 12, 256, w.spec)
        .unwrap()
        .fill_saved("w", state, &get)
        .unwrap_err();
    assert!(err.contains("the model expects [12, 256]"), "{err}");
    let err = PackedWeight::blank("w", 24, 100, w.spec).unwrap_err();
    assert!(err.contains("not a multiple of it"), "{err}");
}
