use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{AdamW, Optimizer, ParamsAdamW};

use super::*;
use crate::kit::head::vocab_blocks;
use crate::testing::{max_diff, values};

fn config(bias: bool, dropout: f64) -> GptConfig {
    GptConfig {
        vocab_size: 11,
        block_size: 8,
        n_layer: 2,
        n_head: 2,
        n_embd: 8,
        dropout,
        bias,
        activation: Activation::Gelu,
    }
}

fn gpt(config: &GptConfig) -> Gpt {
    Gpt::new(config, 3, &Device::Cpu, DType::F32).unwrap()
}

fn ids(rows: &[&[u32]]) -> Tensor {
    let t = rows[0].len();
    let flat: Vec<u32> = rows.iter().flat_map(|r| r.iter().copied()).collect();
    Tensor::from_vec(flat, (rows.len(), t), &Device::Cpu).unwrap()
}

#[test]
fn names_shapes_order_count_alias_and_decay_follow_nanogpt() {
    for bias in [true, false] {
        let cfg = config(bias, 0.0);
        let model = gpt(&cfg);
        let p = model.params();
        let got: Vec<(String, Vec<usize>)> = p
            .iter()
            .map(|(n, v)| (n.to_string(), v.dims().to_vec()))
            .collect();
        let c = 8;
        let mut want = vec![
            ("transformer.wte.weight".to_string(), vec![11, c]),
            ("transformer.wpe.weight".to_string(), vec![8, c]),
        ];
        for i in 0..2 {
            let layer: [(&str, Vec<usize>, bool); 12] = [
                ("ln_1.weight", vec![c], true),
                ("ln_1.bias", vec![c], false),
                ("attn.c_attn.weight", vec![3 * c, c], true),
                ("attn.c_attn.bias", vec![3 * c], false),
                ("attn.c_proj.weight", vec![c, c], true),
                ("attn.c_proj.bias", vec![c], false),
                ("ln_2.weight", vec![c], true),
                ("ln_2.bias", vec![c], false),
                ("mlp.c_fc.weight", vec![4 * c, c], true),
                ("mlp.c_fc.bias", vec![4 * c], false),
                ("mlp.c_proj.weight", vec![c, 4 * c], true),
                ("mlp.c_proj.bias", vec![c], false),
            ];
            for (name, shape, always) in layer {
                if always || bias {
                    want.push((format!("transformer.h.{i}.{name}"), shape));
                }
            }
        }
        want.push(("transformer.ln_f.weight".to_string(), vec![c]));
        if bias {
            want.push(("transformer.ln_f.bias".to_string(), vec![c]));
        }
        assert_eq!(got, want);
        let per_layer = 12 * c * c + if bias { 13 * c } else { 2 * c };
        let rest = (11 + 8) * c + if bias { 2 * c } else { c };
        assert_eq!(p.element_count(), 2 * per_layer + rest);
        for (i, (_, v)) in p.iter().enumerate() {
            assert_eq!(p.decays(i), v.rank() >= 2, "decay flag of parameter {i}");
        }
        let named = p.named_tensors();
        assert_eq!(named.len(), p.len() + 1);
        assert_eq!(p.named_len(), p.len() + 1);
        let (head, wte) = (&named["lm_head.weight"], &named["transformer.wte.weight"]);
        assert_eq!(values(head), values(wte));
        let aliases: Vec<_> = p.aliases().collect();
        assert_eq!(aliases, vec![("lm_head.weight", "transformer.wte.weight")]);
        let out = model.forward(&ids(&[&[1, 2, 3], &[4, 5, 6]]), &Mode::Eval);
        assert_eq!(out.unwrap().dims(), &[2, 3, 11]);
    }
}

#[test]
fn bad_configs_are_refused() {
    let mut cfg = config(true, 0.0);
    cfg.n_head = 3;
    let err = Gpt::new(&cfg, 0, &Device::Cpu, DType::F32).err().unwrap();
    assert!(err.to_string().contains("multiple of n_head"), "{err}");
    for broken in [
        GptConfig {
            block_size: 0,
            ..config(true, 0.0)
        },
        GptConfig {
            vocab_size: 0,
            ..config(true, 0.0)
        },
        GptConfig {
            dropout: 1.0,
            ..config(true, 0.0)
        },
    ] {
        assert!(Gpt::new(&broken, 0, &Device::Cpu, DType::F32).is_err());
    }
    let model = gpt(&config(true, 0.0));
    assert!(model.forward(&ids(&[&[0; 9]]), &Mode::Eval).is_err());
}

#[test]
fn packed_examples_are_computed_as_if_alone() {
    let mut c = config(true, 0.0);
    (c.vocab_size, c.block_size) = (300, 16);
    crate::kit::packed::check_examples_are_computed_alone(&gpt(&c));
}

#[test]
fn attention_is_causal() {
    let model = gpt(&config(true, 0.0));
    let a: &[u32] = &[1, 5, 2, 7, 3, 9, 0, 4];
    let base = model.forward(&ids(&[a]), &Mode::Eval).unwrap();
    for j in [0, 3, 7] {
        let mut b = a.to_vec();
        b[j] = (b[j] + 1) % 11;
        let changed = model.forward(&ids(&[&b]), &Mode::Eval).unwrap();
        for pos in 0..8 {
            let before = values(&base.narrow(1, pos, 1).unwrap());
            let after = values(&changed.narrow(1, pos, 1).unwrap());
            let diff = max_diff(&before, &after);
            if pos < j {
                assert!(
                    diff <= 1e-6,
                    "position {pos} moved by {diff} when {j} changed"
                );
            } else if pos == j {
                assert!(diff > 1e-4, "position {j} did not see its own token");
            }
        }
    }
}

/// Values and gradients (of the input and of `params`) of `f` (fused) and `g` (composed) on
/// the same random input.
fn compare_with_ops(
    shape: &[usize],
    params: &[&Var],
    f: impl Fn(&Tensor) -> Tensor,
    g: impl Fn(&Tensor) -> Tensor,
) {
    let dev = Device::Cpu;
    let x = Var::from_tensor(&Tensor::randn(0f32, 1., shape, &dev).unwrap()).unwrap();
    let run = |h: &dyn Fn(&Tensor) -> Tensor| {
        let y = h(x.as_tensor());
        let grads = ddpjob_kernels::uneven_sum(&y).backward().unwrap();
        let mut all = vec![values(&y)];
        for v in std::iter::once(&&x).chain(params) {
            all.push(values(grads.get(v.as_tensor()).unwrap()));
        }
        all
    };
    let (fused, composed) = (run(&f), run(&g));
    for (i, (a, b)) in fused.iter().zip(&composed).enumerate() {
        let tol = if i == 0 { 1e-5 } else { 1e-4 };
        let diff = max_diff(a, b);
        assert!(
            diff < tol,
            "output {i} (0: values, 1: input gradient) differs by {diff}"
        );
    }
}

#[test]
fn fused_cpu_attention_matches_candle_ops_with_gradients() {
    let model = gpt(&config(true, 0.0));
    compare_with_ops(
        &[3, 8, 24],
        &[],
        |x| {
            let y = attention::causal_attention(&x.reshape((24, 24)).unwrap(), 2, 8).unwrap();
            y.reshape((3, 8, 8)).unwrap()
        },
        |x| {
            attention::with_ops(x, 2, None, &model.causal_mask)
                .unwrap()
                .0
        },
    );
    // 70 positions: query blocks of 32, 32 and 6 rows, each attending to the keys up to its end.
    let long = gpt(&GptConfig {
        block_size: 70,
        ..config(true, 0.0)
    });
    compare_with_ops(
        &[2, 70, 24],
        &[],
        |x| {
            let y = attention::causal_attention(&x.reshape((140, 24)).unwrap(), 2, 70).unwrap();
            y.reshape((2, 70, 8)).unwrap()
        },
        |x| {
            attention::with_ops(x, 2, None, &long.causal_mask)
                .unwrap()
                .0
        },
    );
}

#[test]
fn init_follows_gpt2() {
    let cfg = GptConfig {
        n_embd: 64,
        n_head: 4,
        n_layer: 3,
        ..config(true, 0.0)
    };
    let model = gpt(&cfg);
    let named = model.params().named_tensors();
    let std = |name: &str| {
        let v = values(&named[name]);
        let mean = v.iter().sum::<f32>() / v.len() as f32;
        (v.iter().map(|x| (x - mean).powi(2)).sum::<f32>() / v.len() as f32).sqrt()
    };
    let proj = 0.02 / (6f32).sqrt();
    assert!((std("transformer.h.1.attn.c_attn.weight") / 0.02 - 1.0).abs() < 0.05);
    assert!((std("transformer.wte.weight") / 0.02 - 1.0).abs() < 0.15);
    assert!((std("transformer.h.2.attn.c_proj.weight") / proj - 1.0).abs() < 0.05);
    assert!((std("transformer.h.0.mlp.c_proj.weight") / proj - 1.0).abs() < 0.05);
    for (name, t) in &named {
        let v = values(t);
        if name.ends_with(".bias") {
            assert!(v.iter().all(|&x| x == 0.0), "{name}");
        } else if name.contains("ln_") {
            assert!(v.iter().all(|&x| x == 1.0), "{name}");
        }
    }
    // The same seed gives the same weights.
    let again = gpt(&cfg).params().named_tensors();
    assert_eq!(
        values(&again["transformer.h.1.mlp.c_fc.weight"]),
        values(&named["transformer.h.1.mlp.c_fc.weight"])
    );
}

#[test]
fn kv_cache_matches_the_full_forward() {
    for compute in [DType::F32, DType::BF16] {
        let model = Gpt::new(&config(true, 0.1), 5, &Device::Cpu, compute).unwrap();
        let seq: &[u32] = &[3, 1, 4, 1, 5, 9, 2, 6];
        let mut cache = KvCache::default();
        let tol = if compute == DType::F32 { 1e-4 } else { 2e-2 };
        for end in 3..=8 {
            let fed = if end == 3 {
                &seq[..3]
            } else {
                &seq[end - 1..end]
            };
            let cached = model.forward_cached(fed, &mut cache).unwrap();
            assert_eq!(cached.dims(), &[11]);
            assert_eq!(cache.len(), end);
            let full = model.forward(&ids(&[&seq[..end]]), &Mode::Eval).unwrap();
            let last = values(&full.narrow(1, end - 1, 1).unwrap());
            let diff = max_diff(&values(&cached), &last);
            assert!(diff < tol, "{compute:?}: position {end} differs by {diff}");
        }
        let err = model.forward_cached(&[0], &mut cache).err().unwrap();
        assert!(err.to_string().contains("block_size"), "{err}");
        cache.clear();
        assert!(cache.is_empty());
        assert!(model.forward_cached(&seq[..8], &mut cache).is_ok());
    }
}

#[test]
fn dropout_masks_follow_the_row_seeds() {
    let model = gpt(&config(true, 0.2));
    let (a, b): (&[u32], &[u32]) = (&[1, 2, 3, 4, 5, 6], &[6, 5, 4, 3, 2, 1]);
    let train = |rows: &[&[u32]], seeds: &[u64]| {
        let mode = Mode::Train {
            row_seeds: seeds.to_vec(),
        };
        model.forward(&ids(rows), &mode).unwrap()
    };
    let both = train(&[a, b], &[10, 20]);
    assert_eq!(values(&both), values(&train(&[a, b], &[10, 20])));
    // 2 workers × B/2 = 1 worker × B: row a's logits do not depend on its batch. The masks
    // are identical; the GEMMs may round differently for another number of rows (last bit).
    let alone = train(&[a], &[10]);
    assert!(max_diff(&values(&both.narrow(0, 0, 1).unwrap()), &values(&alone)) < 1e-6);
    let b_alone = train(&[b], &[20]);
    assert!(max_diff(&values(&both.narrow(0, 1, 1).unwrap()), &values(&b_alone)) < 1e-6);
    assert_ne!(values(&alone), values(&train(&[a], &[11])));
    let eval = model.forward(&ids(&[a]), &Mode::Eval).unwrap();
    assert!(max_diff(&values(&eval), &values(&alone)) > 1e-3);
    assert!(
        model
            .forward(&ids(&[a]), &Mode::Train { row_seeds: vec![] })
            .is_err()
    );

    let plain = gpt(&config(true, 0.0));
    let eval = plain.forward(&ids(&[a, b]), &Mode::Eval).unwrap();
    let train = plain
        .forward(
            &ids(&[a, b]),
            &Mode::Train {
                row_seeds: vec![1, 2],
            },
        )
        .unwrap();
    assert_eq!(values(&eval), values(&train));
}

#[test]
fn bf16_compute_returns_f32_logits_close_to_f32() {
    let cfg = config(false, 0.0);
    let wide = gpt(&cfg);
    let narrow = Gpt::new(&cfg, 3, &Device::Cpu, DType::BF16).unwrap();
    let x = ids(&[&[1, 2, 3, 4], &[5, 6, 7, 8]]);
    let (l32, l16) = (
        wide.forward(&x, &Mode::Eval).unwrap(),
        narrow.forward(&x, &Mode::Eval).unwrap(),
    );
    assert_eq!(l16.dtype(), DType::F32);
    assert!(max_diff(&values(&l32), &values(&l16)) < 2e-2);
    let loss = l16.sqr().unwrap().mean_all().unwrap();
    let grads = loss.backward().unwrap();
    let (name, var) = narrow.params().iter().nth(2).unwrap();
    assert_eq!(
        grads.get(var.as_tensor()).unwrap().dtype(),
        DType::F32,
        "{name}"
    );
}

#[test]
fn a_tiny_gpt_learns_a_repeating_sequence() {
    let cfg = GptConfig {
        block_size: 16,
        n_embd: 16,
        ..config(true, 0.0)
    };
    let model = gpt(&cfg);
    let text: Vec<u32> = (0..64).map(|i| (i * 7 % 11) as u32).collect();
    let windows: Vec<&[u32]> = (0..8).map(|s| &text[s * 3..s * 3 + 16]).collect();
    let targets: Vec<&[u32]> = (0..8).map(|s| &text[s * 3 + 1..s * 3 + 17]).collect();
    let (x, y) = (ids(&windows), ids(&targets).flatten_all().unwrap());
    let vars: Vec<Var> = model.params().vars().cloned().collect();
    let adam = ParamsAdamW {
        lr: 1e-2,
        weight_decay: 0.0,
        ..ParamsAdamW::default()
    };
    let mut opt = AdamW::new(vars, adam).unwrap();
    let loss_of = |logits: Tensor| {
        candle_nn::loss::cross_entropy(&logits.reshape((8 * 16, 11)).unwrap(), &y).unwrap()
    };
    let first = loss_of(model.forward(&x, &Mode::Eval).unwrap())
        .to_scalar::<f32>()
        .unwrap();
    assert!((first - (11f32).ln()).abs() < 0.2, "initial loss {first}");
    for _ in 0..100 {
        opt.backward_step(&loss_of(model.forward(&x, &Mode::Eval).unwrap()))
            .unwrap();
    }
    let last = loss_of(model.forward(&x, &Mode::Eval).unwrap())
        .to_scalar::<f32>()
        .unwrap();
    assert!(last < 0.3, "loss {first} -> {last}");
}

#[test]
fn fused_head_loss_matches_logits_and_cross_entropy_with_gradients() {
    // 300 rows against 1,100 symbols: logits in chunks of 128 rows (fewer on a pool of more
    // than two threads) and a partial one. 2,100 symbols: made in blocks of vocabulary
    // columns (`vocab_blocks`), the last one partial.
    // Masked: every third target ignored (instruction data's prompts and padding).
    for masked in [false, true] {
        for (rows, vocab) in [(300, 1100), (150, 2100)] {
            fused_head_matches_composed(rows, 16, vocab, masked);
        }
    }
}

fn fused_head_matches_composed(rows: usize, channels: usize, vocab: usize, masked: bool) {
    let dev = Device::Cpu;
    let x = Var::from_tensor(&Tensor::randn(0f32, 1., (rows, channels), &dev).unwrap()).unwrap();
    let w = Var::from_tensor(&Tensor::randn(0f32, 0.5, (vocab, channels), &dev).unwrap()).unwrap();
    let ids: Vec<u32> = (0..rows as u32)
        .map(|i| match masked && i % 3 == 1 {
            true => ddpjob_seam::task::IGNORE_TARGET,
            false => (i * 7 + 3) % vocab as u32,
        })
        .collect();
    let targets = Tensor::new(ids.as_slice(), &dev).unwrap();
    let composed_logits = x.as_tensor().matmul(&w.as_tensor().t().unwrap()).unwrap();
    let run = |loss: Tensor| {
        let grads = (&loss * 3.0).unwrap().backward().unwrap();
        vec![
            values(&loss.reshape(1).unwrap()),
            values(grads.get(x.as_tensor()).unwrap()),
            values(grads.get(w.as_tensor()).unwrap()),
        ]
    };
    let fused = run(head::loss(x.as_tensor(), w.as_tensor(), &targets).unwrap());
    let composed = run(ddpjob_seam::task::cross_entropy(&composed_logits, &targets).unwrap());
    for (i, (a, b)) in fused.iter().zip(&composed).enumerate() {
        let diff = max_diff(a, b);
        assert!(
            diff < 1e-5,
            "vocabulary {vocab}: output {i} (0: loss, 1: dx, 2: dw) differs by {diff}"
        );
    }
    let (sum, correct) = head::score(x.as_tensor(), w.as_tensor(), &targets).unwrap();
    let (sum2, correct2) =
        ddpjob_seam::task::loss_sum_and_correct(&composed_logits, &targets).unwrap();
    assert!((sum - sum2).abs() < 1e-3, "{sum} vs {sum2}");
    assert_eq!(correct, correct2);
    // The forward keeps its log-sum-exps and logits (for a vocabulary made in blocks) for the
    // backward: the same gradients, bit for bit, as making them again.
    let (xv, wv) = (values(x.as_tensor()), values(w.as_tensor()));
    let ids: Vec<usize> = ids.iter().map(|&i| i as usize).collect();
    let (loss, kept) = head::mean_loss(&xv, &wv, &ids, true).unwrap();
    // (A large vocabulary's training loss is made by `fused_grads`, its sums in another order.)
    assert!(
        (loss - fused[0][0]).abs() < 1e-6 * loss.abs().max(1.0),
        "{loss} vs {}",
        fused[0][0]
    );
    // Asked not to keep them (activation checkpointing), the same loss and log-sum-exps, no
    // logits: the backward then makes them again, to the same bits (below).
    let (unkept_loss, unkept) = head::mean_loss(&xv, &wv, &ids, false).unwrap();
    assert_eq!(unkept_loss.to_bits(), loss.to_bits());
    assert!(unkept.logits.is_empty() && unkept.lse == kept.lse);
    let blocked = vocab_blocks::applies(vocab);
    assert_eq!(kept.lse.len(), if blocked { rows } else { 0 });
    assert_eq!(kept.logits.len(), if blocked { rows * vocab } else { 0 });
    let backward = |kept: &vocab_blocks::Kept| {
        let mut dx = vec![0f32; xv.len()];
        let dw = head::loss_bwd(&xv, &wv, &ids, 3.0, &mut dx, kept, true).unwrap();
        (dx, dw)
    };
    let lse_only = vocab_blocks::Kept {
        lse: kept.lse.clone(),
        logits: Vec::new(),
    };
    let known = backward(&kept);
    for (what, other) in [
        ("log-sum-exps", &lse_only),
        ("nothing", &Default::default()),
    ] {
        assert!(
            known == backward(other),
            "vocabulary {vocab}: kept logits and {what} give other gradients"
        );
    }
    assert!(max_diff(&known.0, &fused[1]) < 1e-5 && max_diff(&known.1, &fused[2]) < 1e-5);
    let outside = Tensor::new(&[0u32, vocab as u32], &dev).unwrap();
    let two = x.as_tensor().narrow(0, 0, 2).unwrap();
    let err = head::loss(&two, w.as_tensor(), &outside).unwrap_err();
    assert!(
        err.to_string()
            .contains(&format!("target {vocab} is outside")),
        "{err}"
    );
}

#[test]
fn the_hand_written_pass_matches_autograd() {
    // 8 channels keep the attention probabilities for the backward (2 heads × 6 positions ≤
    // 4 × 8); 2 channels make it recompute them. 16 channels over 8 positions take the
    // attention's register tiles where the CPU has AVX2 and FMA.
    use Activation::{Gelu, GeluNew};
    for (bias, dropout, n_embd, positions, activation) in [
        (true, 0.0, 8, 6, Gelu),
        (false, 0.0, 8, 6, Gelu),
        (true, 0.3, 8, 6, Gelu),
        (true, 0.0, 2, 6, Gelu),
        (true, 0.3, 16, 8, Gelu),
        (true, 0.3, 8, 6, GeluNew),
    ] {
        let model = gpt(&GptConfig {
            n_embd,
            activation,
            ..config(bias, dropout)
        });
        // Gains and biases away from 1 and 0, so their gradients are exercised too; q, k and
        // v 40 times GPT-2's scale, so each head's probabilities are far from uniform (and a
        // backward that used the wrong head's would be seen).
        let mut rng = ddpjob_rng::Mt19937::new(9);
        for (name, var) in model.params().iter() {
            let gain = if name.ends_with("c_attn.weight") {
                40.0
            } else {
                1.0
            };
            let values: Vec<f32> = (0..var.elem_count())
                .map(|_| gain * (0.5 + 0.3 * rng.normal()))
                .collect();
            let noisy = Tensor::from_vec(values, var.shape(), &Device::Cpu).unwrap();
            var.set(&(var.as_tensor() * &noisy).unwrap()).unwrap();
        }
        // With 6 of 8 positions the position embeddings of the last two get no gradient.
        let x = ids(&[
            &[1, 2, 3, 4, 5, 6, 7, 8][..positions],
            &[7, 8, 9, 10, 0, 1, 2, 3][..positions],
            &[3, 3, 3, 3, 3, 3, 3, 3][..positions],
        ]);
        let y = ids(&[
            &[2, 3, 4, 5, 6, 7, 8, 9][..positions],
            &[8, 9, 10, 0, 1, 2, 3, 4][..positions],
            &[3, 4, 5, 6, 7, 8, 9, 10][..positions],
        ]);
        let mode = Mode::Train {
            row_seeds: vec![11, 12, 13],
        };
        let loss = model.loss(&x, &y, &mode).unwrap();
        let store = (&loss * 0.7).unwrap().backward().unwrap();
        let pass = model
            .train_pass(&x, &y, &mode)
            .unwrap()
            .expect("f32 on the CPU");
        let (hand_loss, hand) = (pass.loss().clone(), pass.backward(0.7).unwrap());
        let case = format!("bias {bias}, dropout {dropout}, {n_embd} channels, {activation:?}");
        let (l1, l2) = (
            loss.to_scalar::<f32>().unwrap(),
            hand_loss.to_scalar::<f32>().unwrap(),
        );
        assert!((l1 - l2).abs() < 1e-5, "{case}: loss {l1} vs {l2}");
        assert_eq!(hand.len(), model.params().len());
        for ((name, var), grad) in model.params().iter().zip(&hand) {
            let auto = values(store.get(var.as_tensor()).unwrap());
            let hand = values(grad.as_ref().unwrap_or_else(|| panic!("{case}: no {name}")));
            let scale = auto.iter().fold(1e-3f32, |m, v| m.max(v.abs()));
            let diff = max_diff(&auto, &hand);
            assert!(diff < 1e-5 * scale, "{case}: {name} differs by {diff}");
        }
    }
    let bf16 = Gpt::new(&config(true, 0.0), 3, &Device::Cpu, DType::BF16).unwrap();
    let x = ids(&[&[1, 2]]);
    assert!(bf16.train_pass(&x, &x, &Mode::Eval).unwrap().is_none());
}

#[test]
fn the_hand_written_score_matches_the_logits_of_the_ops_forward() {
    for bias in [true, false] {
        let model = gpt(&config(bias, 0.0));
        // 150 windows of 7: more positions than one piece of the hand-written score holds, the
        // last piece a partial one.
        let mut rng = ddpjob_rng::Mt19937::new(4);
        let mut draw = || (rng.normal().abs() * 4.0) as u32 % 11;
        let (xs, ys): (Vec<u32>, Vec<u32>) = (0..150 * 7).map(|_| (draw(), draw())).unzip();
        let x = Tensor::from_vec(xs, (150, 7), &Device::Cpu).unwrap();
        let y = Tensor::from_vec(ys, (150, 7), &Device::Cpu).unwrap();
        const { assert!(150 * 7 > 2 * super::manual::SCORE_POSITIONS) };
        let (sum, correct) = model.score(&x, &y).unwrap();
        let logits = model.forward(&x, &Mode::Eval).unwrap();
        let (want_sum, want_correct) =
            ddpjob_seam::task::loss_sum_and_correct(&logits, &y).unwrap();
        assert!(
            (sum - want_sum).abs() < 1e-4 * want_sum,
            "bias {bias}: loss sum {sum} vs {want_sum}"
        );
        assert_eq!(correct, want_correct, "bias {bias}");
        assert!(correct > 0 && correct < 150 * 7, "a non-trivial count");
    }
}

#[test]
fn attention_tiles_match_candle_ops_and_kept_or_recomputed_probabilities_alike() {
    // Contexts and head sizes that are multiples of 8 take the register tiles where the CPU
    // has AVX2 and FMA (the others, above, take gemm).
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
        use crate::kit::attention::tiles;
        assert!(tiles::applies(64, 32) && tiles::applies(16, 8));
        assert!(!tiles::applies(70, 32) && !tiles::applies(64, 4));
    }
    for (t, c, heads) in [(16, 16, 2), (64, 64, 2), (24, 96, 3)] {
        let model = gpt(&GptConfig {
            block_size: t,
            n_embd: c,
            n_head: heads,
            ..config(true, 0.0)
        });
        compare_with_ops(
            &[2, t, 3 * c],
            &[],
            |x| {
                let y = attention::causal_attention(&x.reshape((2 * t, 3 * c)).unwrap(), heads, t);
                y.unwrap().reshape((2, t, c)).unwrap()
            },
            |x| {
                attention::with_ops(x, heads, None, &model.causal_mask)
                    .unwrap()
                    .0
            },
        );
        let dev = Device::Cpu;
        let x = values(&Tensor::randn(0f32, 1., t * 3 * c, &dev).unwrap());
        let dy = values(&Tensor::randn(0f32, 1., t * c, &dev).unwrap());
        let (mut y, mut kept) = (vec![0f32; t * c], vec![0f32; heads * t * t]);
        attention::sequence(&x, &mut y, t, heads, &mut kept);
        let backward = |kept: Option<&[f32]>| {
            let mut dx = vec![f32::NAN; t * 3 * c];
            let mut work = vec![f32::NAN; 2 * t * t];
            attention::sequence_bwd(&x, &dy, &mut dx, t, heads, kept, &mut work);
            dx
        };
        let (from_kept, recomputed) = (backward(Some(&kept)), backward(None));
        assert!(
            from_kept.iter().all(|v| v.is_finite()),
            "t {t}: every gradient written"
        );
        assert_eq!(from_kept, recomputed, "t {t}, C {c}");
    }
}

/// Frozen linear layers, the (tied) embedding and a LayerNorm get no gradient from either
/// backward (a frozen weight's product is never formed), while every other parameter's is
/// unchanged.
#[test]
fn frozen_layers_get_no_gradient_from_either_backward() {
    let x = ids(&[&[1, 2, 3, 4, 5, 6], &[7, 8, 9, 10, 0, 1]]);
    let y = ids(&[&[2, 3, 4, 5, 6, 7], &[8, 9, 10, 0, 1, 2]]);
    let mode = Mode::Eval;
    let grads = |freeze: &[&str]| {
        let model = gpt(&config(true, 0.0));
        if !freeze.is_empty() {
            let patterns: Vec<String> = freeze.iter().map(|p| p.to_string()).collect();
            model.params().freeze(&patterns).unwrap();
        }
        let loss = model.loss(&x, &y, &mode).unwrap();
        let store = loss.backward().unwrap();
        let auto: Vec<Option<Vec<f32>>> = model
            .params()
            .vars()
            .map(|v| store.get(v.as_tensor()).map(values))
            .collect();
        let pass = model.train_pass(&x, &y, &mode).unwrap().unwrap();
        let hand: Vec<Option<Vec<f32>>> = pass
            .backward(1.0)
            .unwrap()
            .iter()
            .map(|g| g.as_ref().map(values))
            .collect();
        let names: Vec<String> = model.params().iter().map(|(n, _)| n.to_string()).collect();
        (names, auto, hand)
    };
    let (names, all_auto, all_hand) = grads(&[]);
    let frozen_layers = [
        "transformer.h.0.mlp.c_fc",
        "transformer.h.1.attn.c_attn",
        "transformer.wte",
        "transformer.h.0.ln_1",
    ];
    let (_, auto, hand) = grads(&frozen_layers);
    for (i, name) in names.iter().enumerate() {
        let frozen = frozen_layers
            .iter()
            .any(|l| name.starts_with(&format!("{l}.")));
        if frozen {
            assert!(
                auto[i].is_none() && hand[i].is_none(),
                "{name} got a gradient"
            );
        } else {
            assert_eq!(auto[i], all_auto[i], "{name} (autograd)");
            assert_eq!(hand[i], all_hand[i], "{name} (hand-written)");
        }
    }
}

/// `train.activation_checkpointing`: the forward keeps each block's input only (an eighth or
/// less of what it keeps otherwise), and the backward, recomputing each block, gives the same
/// loss and gradients bit for bit, with dropout, with attention probabilities kept or
/// recomputed.
#[test]
fn checkpointed_blocks_are_recomputed_to_the_same_bits() {
    for (dropout, n_embd) in [(0.3, 8), (0.0, 2), (0.2, 16)] {
        let model = gpt(&GptConfig {
            n_embd,
            ..config(true, dropout)
        });
        let x = ids(&[&[1, 2, 3, 4, 5, 6, 7, 8], &[7, 8, 9, 10, 0, 1, 2, 3]]);
        let y = ids(&[&[2, 3, 4, 5, 6, 7, 8, 9], &[8, 9, 10, 0, 1, 2, 3, 4]]);
        let mode = Mode::Train {
            row_seeds: vec![5, 6],
        };
        let run = || {
            let pass = manual::forward(&model, &x, &y, &mode).unwrap();
            let kept = pass.kept_block_values();
            let loss = values(pass.loss());
            let grads: Vec<Vec<u32>> = Box::new(pass)
                .backward(0.5)
                .unwrap()
                .iter()
                .map(|g| {
                    values(g.as_ref().unwrap())
                        .iter()
                        .map(|v| v.to_bits())
                        .collect()
                })
                .collect();
            (loss, grads, kept)
        };
        let (loss, grads, kept) = run();
        model.checkpoint_activations().unwrap();
        let (again, recomputed, inputs_only) = run();
        let case = format!("dropout {dropout}, {n_embd} channels");
        assert_eq!(loss, again, "{case}");
        assert_eq!(grads, recomputed, "{case}");
        assert_eq!(
            inputs_only,
            2 * 16 * n_embd,
            "{case}: one [rows, C] input per block"
        );
        assert!(
            inputs_only * 8 <= kept,
            "{case}: {inputs_only} of {kept} values kept"
        );
    }
}

/// The loss's bits and each parameter's gradient's bits for 0.375 · loss: from the model's
/// training pass when it has one, else autograd over the whole model.
fn training_bits(model: &Gpt, x: &Tensor, y: &Tensor, mode: &Mode) -> Vec<Option<Vec<u32>>> {
    let scale = 0.375;
    let (loss, grads) = match model.train_pass(x, y, mode).unwrap() {
        Some(pass) => (pass.loss().clone(), pass.backward(scale).unwrap()),
        None => {
            let loss = model.loss(x, y, mode).unwrap();
            let store = (&loss * scale).unwrap().backward().unwrap();
            let grads = model.params().vars().map(|v| store.get(v).cloned());
            (loss, grads.collect())
        }
    };
    let bits = |t: &Tensor| ddpjob_kernels::f32_bits(&t.to_dtype(DType::F32).unwrap());
    std::iter::once(Some(bits(&loss)))
        .chain(grads.iter().map(|g| g.as_ref().map(bits)))
        .collect()
}

/// Where the hand-written pass does not run (bf16, packed rows; a GPU, LoRA), activation
/// checkpointing and streamed gradients go block by block through autograd
/// (`models::layered`), with the same loss and gradients bit for bit as autograd over the
/// whole model: dropout, the tied table's two gradients added in candle's order, a frozen
/// table.
#[test]
fn blocks_differentiated_one_at_a_time_give_autograds_bits() {
    let x = ids(&[&[1, 2, 3, 4, 5, 6, 7, 8], &[7, 8, 9, 10, 0, 1, 2, 3]]);
    let y = ids(&[&[2, 3, 4, 5, 6, 7, 8, 9], &[8, 9, 10, 0, 1, 2, 3, 4]]);
    // The same tokens as two packed examples a row: [id, position].
    let pairs: Vec<u32> = values(&x.to_dtype(DType::F32).unwrap())
        .iter()
        .enumerate()
        .flat_map(|(i, &id)| [id as u32, ((i % 8) % 5) as u32])
        .collect();
    let packed = Tensor::from_vec(pairs, (2, 8, 2), &Device::Cpu).unwrap();
    let mode = Mode::Train {
        row_seeds: vec![5, 6],
    };
    for (dtype, xs, freeze) in [
        (DType::BF16, &x, None),
        (DType::BF16, &packed, None),
        (DType::F32, &packed, None),
        (DType::BF16, &x, Some("transformer.wte")),
    ] {
        let case = format!("{dtype:?}, {:?}, frozen {freeze:?}", xs.dims());
        let build = || {
            let model = Gpt::new(&config(true, 0.2), 3, &Device::Cpu, dtype).unwrap();
            if let Some(layer) = freeze {
                model.params().freeze(&[layer.to_string()]).unwrap();
            }
            model
        };
        let model = build();
        assert!(model.train_pass(xs, &y, &mode).unwrap().is_none(), "{case}");
        let whole = training_bits(&model, xs, &y, &mode);
        model.stream_gradients().unwrap();
        assert!(model.train_pass(xs, &y, &mode).unwrap().is_some(), "{case}");
        assert_eq!(whole, training_bits(&model, xs, &y, &mode), "{case}: kept");
        let model = build();
        model.checkpoint_activations().unwrap();
        assert!(model.train_pass(xs, &y, &mode).unwrap().is_some(), "{case}");
        assert_eq!(
            whole,
            training_bits(&model, xs, &y, &mode),
            "{case}: recomputed"
        );
    }
}

/// A GPU's attention path (three products by the thirds of `c_attn`, then `of_parts`) gives
/// the fused projection's values and gradients, input and weight (checked here on the CPU).
#[test]
fn attention_from_three_products_matches_the_fused_projection() {
    let model = gpt(&config(true, 0.0));
    let block = &model.blocks[0];
    let (n, t, c) = (3, 8, 8);
    let weight = &block.c_attn.weight;
    compare_with_ops(
        &[n * t, c],
        &[weight],
        |x| {
            let [q, k, v] = block.c_attn.forward_thirds(x, DType::F32).unwrap();
            attention::of_parts((&q, &k, &v), n, 2, &model.causal_mask).unwrap()
        },
        |x| {
            let qkv = block.c_attn.forward(x, DType::F32).unwrap();
            let qkv = qkv.reshape((n, t, 3 * c)).unwrap();
            let y = attention::with_ops(&qkv, 2, None, &model.causal_mask)
                .unwrap()
                .0;
            y.reshape((n * t, c)).unwrap()
        },
    );
}

/// The memory estimate counts the logits the head keeps for its backward: none for a small
/// vocabulary, a sample's [t, vocab] for GPT-2's (within the head's 256 MB).
#[test]
fn the_estimate_counts_the_logits_the_head_keeps() {
    let small = config(true, 0.0);
    let large = GptConfig {
        vocab_size: 50_304,
        ..config(true, 0.0)
    };
    let per_sample = |c: &GptConfig| gpt(c).activation_bytes_per_sample(false).unwrap();
    let kept = per_sample(&large) - per_sample(&small);
    assert_eq!(kept, (small.block_size * 50_304 * 4) as f64);
}

/// From `attention::TILED_FROM` positions both of the GPT's CPU passes attend in tiles (no
/// [t, t] probabilities): the hand-written pass gives autograd's loss and gradients, and each
/// position's logits are those of the same window cut short (the [t, t] attention's, below the
/// threshold), within 1e-5.
#[test]
fn long_windows_attend_in_tiles_in_both_passes() {
    let t = crate::kit::attention::TILED_FROM + 6;
    let model = gpt(&GptConfig {
        block_size: t,
        n_layer: 1,
        ..config(true, 0.0)
    });
    let mut rng = ddpjob_rng::Mt19937::new(5);
    let tokens: Vec<u32> = (0..2 * t + 1).map(|_| rng.next_u32() % 11).collect();
    let x = Tensor::from_vec(tokens[..2 * t].to_vec(), (2, t), &Device::Cpu).unwrap();
    let y = Tensor::from_vec(tokens[1..].to_vec(), (2, t), &Device::Cpu).unwrap();
    let mode = Mode::Train {
        row_seeds: vec![1, 2],
    };
    let loss = model.loss(&x, &y, &mode).unwrap();
    let store = loss.backward().unwrap();
    let pass = model
        .train_pass(&x, &y, &mode)
        .unwrap()
        .expect("f32 on the CPU");
    let (hand_loss, hand) = (pass.loss().clone(), pass.backward(1.0).unwrap());
    let (l1, l2) = (
        loss.to_scalar::<f32>().unwrap(),
        hand_loss.to_scalar::<f32>().unwrap(),
    );
    assert!((l1 - l2).abs() < 1e-5, "loss {l1} vs {l2}");
    for ((name, var), grad) in model.params().iter().zip(&hand) {
        let auto = values(store.get(var.as_tensor()).unwrap());
        let scale = auto.iter().fold(1e-3f32, |m, v| m.max(v.abs()));
        let diff = max_diff(&auto, &values(grad.as_ref().unwrap()));
        assert!(diff < 1e-5 * scale, "{name} differs by {diff}");
    }
    // The first 64 positions, in tiles and as a short window through the [t, t] op.
    let long = model
        .forward(&x, &Mode::Eval)
        .unwrap()
        .narrow(1, 0, 64)
        .unwrap();
    let short = model
        .forward(&x.narrow(1, 0, 64).unwrap(), &Mode::Eval)
        .unwrap();
    assert!(max_diff(&values(&long), &values(&short)) < 1e-5);
}
