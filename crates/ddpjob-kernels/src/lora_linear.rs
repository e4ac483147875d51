//! A frozen linear layer and its LoRA adapter as one op: `y = x·Wᵀ + b + s·(d(x)·Aᵀ)·Bᵀ`, `d`
//! the adapter's input dropout. Composed from ops, each adapted layer keeps three more
//! [rows, out] tensors alive until the backward (the base's output, the adapter's, and its
//! scaled copy); for SmolLM2-135M's shape with adapters on all seven projections that was 1.9 GB
//! of a 4.4 GB step. Here the graph holds `x`, `A` and `B` only: the base and its bias are
//! frozen (LoRA trains the adapters alone), held by the op, and the low-rank `d(x)·Aᵀ` and the
//! dropout mask are recomputed in the backward (r columns; the mask from its rows' seeds).
//! The base is an f32 weight, or a 4-bit one (QLoRA: [`lora_linear_4bit`]) de-quantised a
//! panel at a time in both passes (see `quant4::linear`).

use candle_core::{CpuStorage, CustomOp3, Layout, Result, Shape, Tensor, bail};

use crate::host::{Mat, gemm, product, threads, values, with_values};
use crate::quant4::Quantized4Weight;

/// The adapter's input dropout: each row's seed, the layer's site and the probability; the
/// mask is a function of these (see `dropout`).
#[derive(Clone)]
pub struct AdapterDropout {
    pub row_seeds: Vec<u64>,
    pub site: usize,
    pub p: f64,
    /// Draws the mask of `rows` rows of `row_len` values.
    pub mask: fn(&[u64], usize, usize, f64) -> Vec<f32>,
}

impl AdapterDropout {
    /// The mask of `len` values: one row per seed (a sample's positions one after another, as
    /// the model's own dropout draws them).
    fn mask_of(&self, len: usize) -> Vec<f32> {
        let row_len = len / self.row_seeds.len().max(1);
        (self.mask)(&self.row_seeds, self.site, row_len, self.p)
    }
}

/// `x·Wᵀ + b + scale·(d(x)·Aᵀ)·Bᵀ` for `x` [n, in], frozen `weight` [out, in] and `bias`
/// `[out]`, the adapter's `a` [r, in] and `b` [r, out]ᵀ = [out, r]; differentiable in `x`, `a` and
/// `b`. CPU f32 (see [`super::applies`]).
pub fn lora_linear(
    x: &Tensor,
    weight: &Tensor,
    bias: &Tensor,
    (a, b): (&Tensor, &Tensor),
    scale: f64,
    dropout: Option<AdapterDropout>,
) -> Result<Tensor> {
    let base = Base::Dense(weight.contiguous()?);
    apply(x, base, bias, (a, b), scale, dropout)
}

/// [`lora_linear`] over a frozen 4-bit weight (QLoRA's layers): `x·Wᵀ + b + scale·(d(x)·Aᵀ)·Bᵀ`
/// with W de-quantised a panel at a time, never whole.
pub fn lora_linear_4bit(
    x: &Tensor,
    weight: &Quantized4Weight,
    bias: &Tensor,
    ab: (&Tensor, &Tensor),
    scale: f64,
    dropout: Option<AdapterDropout>,
) -> Result<Tensor> {
    apply(x, Base::Packed(weight.clone()), bias, ab, scale, dropout)
}

fn apply(
    x: &Tensor,
    base: Base,
    bias: &Tensor,
    (a, b): (&Tensor, &Tensor),
    scale: f64,
    dropout: Option<AdapterDropout>,
) -> Result<Tensor> {
    let op = LoraLinearOp {
        base,
        bias: bias.contiguous()?,
        scale: scale as f32,
        dropout,
    };
    x.contiguous()?
        .apply_op3(&a.contiguous()?, &b.contiguous()?, op)
}

/// The frozen base weight [out, in].
enum Base {
    Dense(Tensor),
    Packed(Quantized4Weight),
}

impl Base {
    fn dims(&self) -> Result<(usize, usize)> {
        match self {
            Base::Dense(w) => w.dims2(),
            Base::Packed(q) => Ok(q.dims()),
        }
    }

    /// x·Wᵀ + bias for `n` rows of x.
    fn forward(&self, x: &[f32], bias: &Tensor, n: usize) -> Result<Vec<f32>> {
        with_values(bias, |bias| match self {
            Base::Dense(w) => with_values(w, |w| Ok(super::linear::forward(x, w, bias, n))),
            Base::Packed(q) => {
                let mut y = q.forward_values(x, n);
                if bias.iter().any(|&b| b != 0.0) {
                    for row in y.chunks_exact_mut(bias.len()) {
                        row.iter_mut().zip(bias).for_each(|(y, b)| *y += b);
                    }
                }
                Ok(y)
            }
        })
    }

    /// dx = g·W (written over dx).
    fn input_gradient(&self, g: &[f32], d: Dims, dx: &mut [f32]) -> Result<()> {
        match self {
            Base::Dense(w) => with_values(w, |w| {
                gemm(
                    dx,
                    Mat::new(g, d.n, d.outputs),
                    Mat::new(w, d.outputs, d.inputs),
                    false,
                    threads(),
                );
                Ok(())
            }),
            Base::Packed(q) => {
                q.input_gradient_into(g, d.n, dx, false);
                Ok(())
            }
        }
    }
}

struct LoraLinearOp {
    base: Base,
    bias: Tensor,
    scale: f32,
    dropout: Option<AdapterDropout>,
}

/// The sizes of one call: rows, inputs, outputs, rank.
#[derive(Clone, Copy)]
struct Dims {
    n: usize,
    inputs: usize,
    outputs: usize,
    r: usize,
}

impl LoraLinearOp {
    fn dims(&self, x: &Shape, a: &Shape, b: &Shape) -> Result<Dims> {
        let (n, inputs) = x.dims2()?;
        let (r, a_inputs) = a.dims2()?;
        let (outputs, b_r) = b.dims2()?;
        let (w_outputs, w_inputs) = self.base.dims()?;
        if a_inputs != inputs || b_r != r || w_inputs != inputs || w_outputs != outputs {
            bail!(
                "lora linear: input [{n}, {inputs}], A [{r}, {a_inputs}], B [{outputs}, {b_r}] \
                 and weight [{w_outputs}, {w_inputs}] do not fit"
            );
        }
        Ok(Dims {
            n,
            inputs,
            outputs,
            r,
        })
    }

    /// The adapter's input: `x` with its dropout mask applied, or `x` itself.
    fn dropped<'x>(&self, x: &'x [f32]) -> std::borrow::Cow<'x, [f32]> {
        match &self.dropout {
            Some(drop) => {
                let mask = drop.mask_of(x.len());
                std::borrow::Cow::Owned(x.iter().zip(&mask).map(|(v, m)| v * m).collect())
            }
            None => std::borrow::Cow::Borrowed(x),
        }
    }

    /// `scale·(xd·Aᵀ)` [n, r].
    fn low(&self, xd: &[f32], a: &[f32], d: Dims) -> Vec<f32> {
        let mut h = product(
            Mat::new(xd, d.n, d.inputs),
            Mat::new(a, d.r, d.inputs).t(),
            threads(),
        );
        h.iter_mut().for_each(|v| *v *= self.scale);
        h
    }
}

impl CustomOp3 for LoraLinearOp {
    fn name(&self) -> &'static str {
        "ddpjob-lora-linear"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        x_layout: &Layout,
        a: &CpuStorage,
        a_layout: &Layout,
        b: &CpuStorage,
        b_layout: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let d = self.dims(x_layout.shape(), a_layout.shape(), b_layout.shape())?;
        let (x, a, b) = (
            values(x, x_layout)?,
            values(a, a_layout)?,
            values(b, b_layout)?,
        );
        let mut y = self.base.forward(x, &self.bias, d.n)?;
        let h = self.low(&self.dropped(x), a, d);
        gemm(
            &mut y,
            Mat::new(&h, d.n, d.r),
            Mat::new(b, d.outputs, d.r).t(),
            true,
            threads(),
        );
        Ok((CpuStorage::F32(y), Shape::from((d.n, d.outputs))))
    }

    /// With g the output's gradient and hs = scale·d(x)·Aᵀ: dB = gᵀ·hs; gh = scale·g·B;
    /// dA = ghᵀ·d(x); dx = g·W + d(gh·A) (the mask applied to the adapter's share).
    fn bwd(
        &self,
        x: &Tensor,
        a: &Tensor,
        b: &Tensor,
        _y: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let d = self.dims(x.shape(), a.shape(), b.shape())?;
        let (want_x, want_a, want_b) = (x.track_op(), a.track_op(), b.track_op());
        let (dx, da, db) = with_values(x, |xv| {
            with_values(a, |av| {
                with_values(b, |bv| {
                    with_values(grad, |g| self.backward(xv, av, bv, g, d, want_x))
                })
            })
        })?;
        let device = x.device();
        Ok((
            match dx {
                Some(dx) => Some(Tensor::from_vec(dx, (d.n, d.inputs), device)?),
                None => None,
            },
            want_a
                .then(|| Tensor::from_vec(da, (d.r, d.inputs), device))
                .transpose()?,
            want_b
                .then(|| Tensor::from_vec(db, (d.outputs, d.r), device))
                .transpose()?,
        ))
    }
}

type Grads = (Option<Vec<f32>>, Vec<f32>, Vec<f32>);

impl LoraLinearOp {
    // The op's operands and what to form: one caller, `bwd`.
    fn backward(
        &self,
        x: &[f32],
        a: &[f32],
        b: &[f32],
        g: &[f32],
        d: Dims,
        want_x: bool,
    ) -> Result<Grads> {
        let xd = self.dropped(x);
        let hs = self.low(&xd, a, d);
        let db = product(
            Mat::new(g, d.n, d.outputs).t(),
            Mat::new(&hs, d.n, d.r),
            threads(),
        );
        let mut gh = product(
            Mat::new(g, d.n, d.outputs),
            Mat::new(b, d.outputs, d.r),
            threads(),
        );
        gh.iter_mut().for_each(|v| *v *= self.scale);
        let da = product(
            Mat::new(&gh, d.n, d.r).t(),
            Mat::new(&xd, d.n, d.inputs),
            threads(),
        );
        let dx = want_x.then(|| -> Result<Vec<f32>> {
            let mut dx = super::scratch::take(d.n * d.inputs);
            self.base.input_gradient(g, d, &mut dx)?;
            let gha = Mat::new(&gh, d.n, d.r);
            let am = Mat::new(a, d.r, d.inputs);
            match &self.dropout {
                None => gemm(&mut dx, gha, am, true, threads()),
                Some(drop) => {
                    let through = product(gha, am, threads());
                    let mask = drop.mask_of(dx.len());
                    for ((dx, t), m) in dx.iter_mut().zip(&through).zip(&mask) {
                        *dx += t * m;
                    }
                }
            }
            Ok(dx)
        });
        Ok((dx.transpose()?, da, db))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Var};

    use super::*;

    /// A mask that keeps every other value, doubled: what the op must apply and differentiate
    /// through as the composed ops do.
    fn every_other(seeds: &[u64], site: usize, row_len: usize, _p: f64) -> Vec<f32> {
        let n = seeds.len() * row_len;
        (0..n).map(|i| ((i + site) % 2) as f32 * 2.0).collect()
    }

    #[test]
    fn the_fused_layer_matches_its_composition_with_gradients() {
        let dev = &Device::Cpu;
        let var = |shape: (usize, usize), seed: f32| {
            let n = shape.0 * shape.1;
            let v: Vec<f32> = (0..n).map(|i| ((i as f32 + seed) * 0.37).sin()).collect();
            Var::from_tensor(&Tensor::from_vec(v, shape, dev).unwrap()).unwrap()
        };
        // 2 samples of 3 positions, 5 inputs, 4 outputs, rank 2.
        let (x, a, b) = (var((6, 5), 1.0), var((2, 5), 2.0), var((4, 2), 3.0));
        let (w, bias) = (var((4, 5), 4.0).as_tensor().clone(), var((1, 4), 5.0));
        let bias = bias.as_tensor().flatten_all().unwrap();
        for dropped in [false, true] {
            let dropout = dropped.then(|| AdapterDropout {
                row_seeds: vec![7, 9],
                site: 1,
                p: 0.5,
                mask: every_other,
            });
            let fused =
                lora_linear(x.as_tensor(), &w, &bias, (&a, &b), 1.5, dropout.clone()).unwrap();
            let xd = match &dropout {
                Some(d) => {
                    let mask = Tensor::from_vec(d.mask_of(30), (6, 5), dev).unwrap();
                    (x.as_tensor() * mask).unwrap()
                }
                None => x.as_tensor().clone(),
            };
            let base = x.as_tensor().matmul(&w.t().unwrap()).unwrap();
            let base = base.broadcast_add(&bias).unwrap();
            let low = xd.matmul(&a.t().unwrap()).unwrap().matmul(&b.t().unwrap());
            let composed = (base + (low.unwrap() * 1.5).unwrap()).unwrap();
            let diff = |p: &Tensor, q: &Tensor| -> f32 {
                let d = (p - q).unwrap().abs().unwrap().flatten_all().unwrap();
                d.max(0).unwrap().to_scalar().unwrap()
            };
            assert!(diff(&fused, &composed) < 1e-5, "outputs, dropout {dropped}");
            let gf = crate::uneven_sum(&fused).backward().unwrap();
            let gc = crate::uneven_sum(&composed).backward().unwrap();
            for (name, v) in [("x", &x), ("A", &a), ("B", &b)] {
                let (p, q) = (gf.get(v).unwrap(), gc.get(v).unwrap());
                assert!(diff(p, q) < 1e-5, "gradient of {name}, dropout {dropped}");
            }
        }
    }
}
