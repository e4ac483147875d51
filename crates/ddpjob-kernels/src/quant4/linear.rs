//! A frozen linear layer whose weight [out, in] is held in 4 bits ([`Quantized4`]): y = x·Wᵀ
//! with W de-quantised a panel at a time, never whole: the forward takes [`ROWS`] of W's rows
//! per task (its output columns), the backward [`COLUMNS`] of W's columns per task (its input
//! gradient's columns), each panel f32 in a task's own buffer for one product. W gets no
//! gradient (QLoRA trains adapters beside it). Each task's product and order are fixed, so the
//! results are the same bits for any thread count. CPU, f32 (and `bf16-matmul`'s products).

use std::sync::Arc;

use candle_core::{CpuStorage, CustomOp1, Layout, Result, Shape, Tensor, bail};
use rayon::prelude::*;

use super::Quantized4;
use crate::host::{Out, Products, strided_product, values, with_values};

/// W's rows de-quantised per forward task.
const ROWS: usize = 64;
/// W's columns de-quantised per backward task (a multiple of every block size up to 256, so
/// a panel's rows are whole blocks).
const COLUMNS: usize = 256;

/// A 4-bit weight [out, in] ready for products: its codes and each block's scale.
#[derive(Clone, Debug)]
pub struct Quantized4Weight {
    weight: Arc<Quantized4>,
    /// Each block's absmax (de-quantised once where nested).
    scales: Arc<Vec<f32>>,
    out: usize,
    inputs: usize,
}

impl Quantized4Weight {
    /// `weight` read as [out, inputs] (row-major, as torch's `nn.Linear.weight`). Its blocks
    /// must not straddle rows: `inputs` a multiple of the block size.
    pub fn new(weight: Quantized4, out: usize, inputs: usize) -> std::result::Result<Self, String> {
        if weight.len != out * inputs {
            return Err(format!(
                "a 4-bit weight of {} values is not [{out}, {inputs}]",
                weight.len
            ));
        }
        if !inputs.is_multiple_of(weight.blocksize) {
            return Err(format!(
                "{inputs} input features are not a multiple of the quantisation block size {}: \
                 choose a block size that divides them",
                weight.blocksize
            ));
        }
        let scales = Arc::new(weight.absmaxes());
        Ok(Quantized4Weight {
            weight: Arc::new(weight),
            scales,
            out,
            inputs,
        })
    }

    /// The whole weight in f32 (for tests, merges and exports; training never makes it).
    pub fn dequantized(&self) -> Vec<f32> {
        let mut w = vec![0f32; self.out * self.inputs];
        self.weight
            .dequantize_into(&self.scales, 0..w.len(), &mut w);
        w
    }

    /// Bytes held: the codes and the scales.
    pub fn bytes(&self) -> usize {
        self.weight.codes.len() + 4 * self.scales.len()
    }
}

/// x [rows, in] · Wᵀ: [rows, out], differentiable in x only.
pub fn quantized_linear(x: &Tensor, w: &Quantized4Weight) -> Result<Tensor> {
    x.contiguous()?.apply_op1(w.clone())
}

impl Quantized4Weight {
    fn rows_of(&self, shape: &Shape) -> Result<usize> {
        let (rows, inputs) = shape.dims2()?;
        if inputs != self.inputs {
            bail!(
                "4-bit linear: input {shape:?} for a weight of {} inputs",
                self.inputs
            );
        }
        Ok(rows)
    }
}

impl Quantized4Weight {
    /// The weight's shape [out, in].
    pub fn dims(&self) -> (usize, usize) {
        (self.out, self.inputs)
    }

    /// Each block's absmax (de-quantised once where nested).
    pub fn scales(&self) -> &[f32] {
        &self.scales
    }

    /// The codes and scales as stored (what a checkpoint's fingerprint and an export read).
    pub fn stored(&self) -> &Quantized4 {
        &self.weight
    }

    /// x [rows, in] · Wᵀ as values: [rows, out], a panel of 64 of W's rows per task.
    pub fn forward_values(&self, x: &[f32], rows: usize) -> Vec<f32> {
        let (out, inputs) = (self.out, self.inputs);
        let mut y = vec![0f32; rows * out];
        let dst = Out {
            ptr: y.as_mut_ptr(),
            row_stride: out,
        };
        let tasks = if rows == 0 { 0 } else { out.div_ceil(ROWS) };
        (0..tasks).into_par_iter().for_each(|task| {
            let (o0, o1) = (task * ROWS, ((task + 1) * ROWS).min(out));
            let mut panel = vec![0f32; (o1 - o0) * inputs];
            self.weight
                .dequantize_into(&self.scales, o0 * inputs..o1 * inputs, &mut panel);
            // SAFETY: x is rows × inputs, the panel (o1 − o0) × inputs read transposed, and
            // y's columns o0..o1 of its `rows` rows (stride out) are this task's alone.
            unsafe {
                strided_product(
                    (rows, o1 - o0, inputs),
                    (dst.offset(o0).ptr, out),
                    false,
                    (x.as_ptr(), inputs, 1),
                    (panel.as_ptr(), 1, inputs),
                    Products::for_depth(inputs),
                )
            }
        });
        y
    }

    /// dy [rows, out] · W into `dx` [rows, in] (added to it when `accumulate`), a panel of
    /// 256 of W's columns per task.
    pub fn input_gradient_into(&self, dy: &[f32], rows: usize, dx: &mut [f32], accumulate: bool) {
        let (out, inputs) = (self.out, self.inputs);
        assert_eq!(
            dx.len(),
            rows * inputs,
            "4-bit linear: dx of the wrong size"
        );
        let dst = Out {
            ptr: dx.as_mut_ptr(),
            row_stride: inputs,
        };
        let tasks = if rows == 0 {
            0
        } else {
            inputs.div_ceil(COLUMNS)
        };
        (0..tasks).into_par_iter().for_each(|task| {
            let (c0, c1) = (task * COLUMNS, ((task + 1) * COLUMNS).min(inputs));
            let width = c1 - c0;
            let mut panel = vec![0f32; out * width];
            for (o, row) in panel.chunks_exact_mut(width).enumerate() {
                let at = o * inputs;
                self.weight
                    .dequantize_into(&self.scales, at + c0..at + c1, row);
            }
            // SAFETY: dy is rows × out, the panel out × width, and dx's columns c0..c1 of
            // its `rows` rows (stride inputs) are this task's alone.
            unsafe {
                strided_product(
                    (rows, width, out),
                    (dst.offset(c0).ptr, inputs),
                    accumulate,
                    (dy.as_ptr(), out, 1),
                    (panel.as_ptr(), width, 1),
                    Products::for_depth(out),
                )
            }
        });
    }
}

impl CustomOp1 for Quantized4Weight {
    fn name(&self) -> &'static str {
        "ddpjob-quantized4-linear"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let rows = self.rows_of(layout.shape())?;
        let y = self.forward_values(values(storage, layout)?, rows);
        Ok((CpuStorage::F32(y), Shape::from((rows, self.out))))
    }

    /// dx = dy · W, a panel of W's columns per task; W itself gets no gradient.
    fn bwd(&self, x: &Tensor, _y: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let rows = self.rows_of(x.shape())?;
        let mut dx = vec![0f32; rows * self.inputs];
        with_values(grad, |dy| {
            self.input_gradient_into(dy, rows, &mut dx, false);
            Ok(())
        })?;
        Ok(Some(Tensor::from_vec(dx, x.shape(), x.device())?))
    }
}
