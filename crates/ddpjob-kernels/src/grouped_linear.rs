//! `y = x·Wₑᵀ` for rows grouped by expert: a mixture of experts' products, each expert's one
//! GEMM over the rows routed to it (never every expert over every row, never a loop of tiny
//! products). The rows of `x` come sorted by expert, `counts[e]` of them for expert e, and `w`
//! holds every expert's weight, [experts, out, in]. Forward one GEMM per non-empty group; the
//! backward two (the input's gradient, when wanted, and the weight's, when wanted: frozen
//! experts come detached). The groups run side by side, each GEMM on one thread, so the values
//! are the same whatever the thread count. CPU f32 only ([`applies`]); elsewhere the model
//! composes the same products from candle's ops.

use candle_core::{CpuStorage, CustomOp2, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use crate::host::{Mat, Out, gemm_to, values, with_values};

/// Whether [`grouped_linear`] runs for these operands (f32 on the CPU).
pub fn applies(x: &Tensor, w: &Tensor) -> bool {
    crate::host::applies(x) && crate::host::applies(w)
}

/// `x` [rows, in] (sorted by group), `w` [groups, out, in], `counts` the rows of each group
/// (summing to `rows`) → [rows, out], group e's rows times `w[e]ᵀ`.
pub fn grouped_linear(x: &Tensor, w: &Tensor, counts: &[usize]) -> Result<Tensor> {
    let (rows, inputs) = x.dims2()?;
    let (groups, _, w_inputs) = w.dims3()?;
    if groups != counts.len() || counts.iter().sum::<usize>() != rows || w_inputs != inputs {
        candle_core::bail!(
            "grouped linear: {rows} rows of {inputs} in {} groups (Σ {}) against weights {:?}",
            counts.len(),
            counts.iter().sum::<usize>(),
            w.dims()
        );
    }
    x.contiguous()?.apply_op2(
        &w.contiguous()?,
        GroupedLinear {
            counts: counts.to_vec(),
        },
    )
}

struct GroupedLinear {
    counts: Vec<usize>,
}

impl GroupedLinear {
    /// Each group's (first row, rows), the empty ones left out.
    fn groups(&self) -> Vec<(usize, usize, usize)> {
        let mut first = 0;
        let mut out = Vec::new();
        for (e, &m) in self.counts.iter().enumerate() {
            if m > 0 {
                out.push((e, first, m));
            }
            first += m;
        }
        out
    }
}

/// Runs `f(group, first row, rows, out)` for every group side by side, `out` pointing at the
/// group's block of `dst` (`block(first, e)` its offset, `stride` its row stride).
fn per_group(
    groups: &[(usize, usize, usize)],
    dst: &mut [f32],
    stride: usize,
    block: impl Fn(usize, usize) -> usize + Sync,
    f: impl Fn(usize, usize, usize, Out) + Sync,
) {
    let out = Out {
        ptr: dst.as_mut_ptr(),
        row_stride: stride,
    };
    groups.par_iter().for_each(|&(e, first, m)| {
        f(e, first, m, out.offset(block(first, e)));
    });
}

impl CustomOp2 for GroupedLinear {
    fn name(&self) -> &'static str {
        "ddpjob-grouped-linear"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        x_layout: &Layout,
        w: &CpuStorage,
        w_layout: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (rows, inputs) = x_layout.shape().dims2()?;
        let (_, outputs, _) = w_layout.shape().dims3()?;
        let (x, w) = (values(x, x_layout)?, values(w, w_layout)?);
        let mut y = vec![0f32; rows * outputs];
        let block = |first: usize, _| first * outputs;
        per_group(
            &self.groups(),
            &mut y,
            outputs,
            block,
            |e, first, m, out| {
                let x = Mat::new(&x[first * inputs..], m, inputs);
                let w = Mat::new(&w[e * outputs * inputs..], outputs, inputs).t();
                // SAFETY: each group writes its own rows of `y`, which outlives the calls.
                unsafe { gemm_to(out, x, w, false, 1) }
            },
        );
        Ok((CpuStorage::F32(y), Shape::from((rows, outputs))))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _out: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (rows, inputs) = x.dims2()?;
        let (experts, outputs, _) = w.dims3()?;
        let groups = self.groups();
        let device = x.device();
        let (gx, gw) = with_values(grad, |gy| {
            with_values(x, |xv| {
                with_values(w, |wv| {
                    let gx = x.track_op().then(|| {
                        let mut gx = vec![0f32; rows * inputs];
                        let block = |first: usize, _| first * inputs;
                        per_group(&groups, &mut gx, inputs, block, |e, first, m, out| {
                            let gy = Mat::new(&gy[first * outputs..], m, outputs);
                            let w = Mat::new(&wv[e * outputs * inputs..], outputs, inputs);
                            // SAFETY: each group writes its own rows of `gx`.
                            unsafe { gemm_to(out, gy, w, false, 1) }
                        });
                        gx
                    });
                    let gw = w.track_op().then(|| {
                        // Experts no row reached keep a zero gradient.
                        let mut gw = vec![0f32; experts * outputs * inputs];
                        let block = |_, e: usize| e * outputs * inputs;
                        per_group(&groups, &mut gw, inputs, block, |_, first, m, out| {
                            let gy = Mat::new(&gy[first * outputs..], m, outputs).t();
                            let x = Mat::new(&xv[first * inputs..], m, inputs);
                            // SAFETY: each group writes its own expert's block of `gw`.
                            unsafe { gemm_to(out, gy, x, false, 1) }
                        });
                        gw
                    });
                    Ok((gx, gw))
                })
            })
        })?;
        let gx = gx
            .map(|g| Tensor::from_vec(g, (rows, inputs), device))
            .transpose()?;
        let gw = gw
            .map(|g| Tensor::from_vec(g, (experts, outputs, inputs), device))
            .transpose()?;
        Ok((gx, gw))
    }
}

/// The same products from candle's ops, one `matmul` per group (the reference, and the path
/// of other devices and dtypes).
pub fn grouped_linear_with_ops(x: &Tensor, w: &Tensor, counts: &[usize]) -> Result<Tensor> {
    let mut parts = Vec::new();
    let mut first = 0;
    for (e, &m) in counts.iter().enumerate() {
        if m > 0 {
            let rows = x.narrow(0, first, m)?;
            parts.push(rows.matmul(&w.get(e)?.t()?)?);
        }
        first += m;
    }
    Tensor::cat(&parts, 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{random, same_with_gradients};

    /// Values and both gradients agree with one candle `matmul` per group, with empty groups
    /// (an expert no row reached: its gradient is zero) and groups of one row.
    #[test]
    fn grouped_products_and_their_gradients_match_one_matmul_per_group() {
        let counts = [3, 0, 1, 7, 0, 5];
        let rows: usize = counts.iter().sum();
        let x = random(&[rows, 24], 0.0, 1);
        let w = random(&[counts.len(), 40, 24], 0.0, 2);
        same_with_gradients(
            &[x, w.clone()],
            |v| grouped_linear(v[0], v[1], &counts).unwrap(),
            |v| grouped_linear_with_ops(v[0], v[1], &counts).unwrap(),
            1e-4,
        );
        // The composed path gives an unreached expert no gradient at all; the op a zero one.
        let x = random(&[rows, 24], 0.0, 3);
        let y = grouped_linear(x.as_tensor(), w.as_tensor(), &counts).unwrap();
        let grads = y.sum_all().unwrap().backward().unwrap();
        let gw = grads.get(w.as_tensor()).unwrap();
        let unreached = gw.get(1).unwrap().abs().unwrap().sum_all().unwrap();
        assert_eq!(unreached.to_scalar::<f32>().unwrap(), 0.0);
    }

    /// The same bits on one thread as on several (each group's GEMM is single-threaded).
    #[test]
    fn the_values_do_not_depend_on_the_thread_count() {
        let counts = [64, 32, 96, 16];
        let rows: usize = counts.iter().sum();
        let x = random(&[rows, 48], 0.0, 4);
        let w = random(&[4, 64, 48], 0.0, 5);
        let run = || {
            let y = grouped_linear(x.as_tensor(), w.as_tensor(), &counts).unwrap();
            let grads = crate::host::uneven_sum(&y).backward().unwrap();
            let gw = grads.get(w.as_tensor()).unwrap().flatten_all().unwrap();
            (crate::f32_bits(&y), crate::f32_bits(&gw))
        };
        let one = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .build()
            .unwrap()
            .install(run);
        assert!(one == run());
    }

    #[test]
    fn counts_that_do_not_add_up_are_refused() {
        let x = random(&[5, 8], 0.0, 6);
        let w = random(&[2, 4, 8], 0.0, 7);
        let err = grouped_linear(x.as_tensor(), w.as_tensor(), &[2, 2]).unwrap_err();
        assert!(err.to_string().contains("2 groups (Σ 4)"), "{err}");
    }
}
