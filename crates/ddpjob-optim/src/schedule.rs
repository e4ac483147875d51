//! Learning-rate schedules as pure functions of the optimizer step and epoch, so resuming only
//! needs the position (saved in every checkpoint).

use ddpjob_spec::{ScheduleKind, ScheduleSpec};

#[derive(Debug, Clone, Copy)]
pub struct Schedule {
    peak: f64,
    spec: ScheduleSpec,
    total_steps: usize,
}

impl Schedule {
    /// `total_steps`: optimizer steps in the whole run (cosine decays over them).
    pub fn new(peak: f64, spec: ScheduleSpec, total_steps: usize) -> Self {
        Schedule {
            peak,
            spec,
            total_steps,
        }
    }

    /// The learning rate for optimizer step `step` (0-based, global) taken during `epoch`.
    pub fn lr(&self, step: usize, epoch: usize) -> f64 {
        let warmup = self.spec.warmup_steps;
        let base = match self.spec.kind {
            ScheduleKind::Constant => self.peak,
            // torch.optim.lr_scheduler.StepLR(step_size, gamma), stepped once per epoch.
            ScheduleKind::Step { step_size, gamma } => {
                self.peak * gamma.powi((epoch / step_size) as i32)
            }
            // Cosine from peak (after warm-up) to min_lr at step `total_steps`, one past the
            // last step taken: transformers' get_cosine_schedule_with_warmup and torch's
            // CosineAnnealingLR(T_max = total steps) alike.
            ScheduleKind::Cosine { min_lr } => {
                let span = self.total_steps.saturating_sub(warmup).max(1) as f64;
                let progress = (step.saturating_sub(warmup) as f64 / span).min(1.0);
                min_lr
                    + (self.peak - min_lr) * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos())
            }
        };
        if step < warmup {
            base * (step + 1) as f64 / warmup as f64
        } else {
            base
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(kind: ScheduleKind, warmup_steps: usize) -> ScheduleSpec {
        // The parameters the schedule reads are in `kind`.
        ScheduleSpec {
            kind,
            warmup_steps,
            step_size: 1,
            gamma: 0.1,
            min_lr: 0.0,
        }
    }

    #[test]
    fn step_halves_every_epoch_like_steplr() {
        // torch: StepLR(opt, step_size=1, gamma=0.5) → lr 0.01, 0.005, 0.0025 for epochs 0, 1, 2.
        let s = Schedule::new(
            0.01,
            spec(
                ScheduleKind::Step {
                    step_size: 1,
                    gamma: 0.5,
                },
                0,
            ),
            100,
        );
        assert_eq!(s.lr(0, 0), 0.01);
        assert_eq!(s.lr(50, 1), 0.005);
        assert_eq!(s.lr(99, 2), 0.0025);
        let s2 = Schedule::new(
            1.0,
            spec(
                ScheduleKind::Step {
                    step_size: 2,
                    gamma: 0.1,
                },
                0,
            ),
            100,
        );
        assert_eq!(s2.lr(0, 1), 1.0);
        assert!((s2.lr(0, 2) - 0.1).abs() < 1e-12);
    }

    #[test]
    fn cosine_runs_from_peak_to_min_lr() {
        // lr(s) = min + (peak - min)(1 + cos(pi s / T)) / 2 with T = 10: s=5 is the midpoint.
        let s = Schedule::new(1.0, spec(ScheduleKind::Cosine { min_lr: 0.1 }, 0), 10);
        assert_eq!(s.lr(0, 0), 1.0);
        assert!((s.lr(5, 0) - 0.55).abs() < 1e-12);
        assert!((s.lr(10, 0) - 0.1).abs() < 1e-12);
    }

    #[test]
    fn warmup_ramps_linearly_then_hands_over() {
        let s = Schedule::new(0.4, spec(ScheduleKind::Constant, 4), 100);
        let lrs: Vec<f64> = (0..6).map(|i| s.lr(i, 0)).collect();
        assert_eq!(lrs, vec![0.1, 0.2, 0.30000000000000004, 0.4, 0.4, 0.4]);
        let c = Schedule::new(1.0, spec(ScheduleKind::Cosine { min_lr: 0.0 }, 2), 12);
        assert_eq!(c.lr(2, 0), 1.0);
        assert!((c.lr(7, 0) - 0.5).abs() < 1e-12);
    }
}
