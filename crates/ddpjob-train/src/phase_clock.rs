//! Where a step's time goes, phase by phase (for `bench step`). On a GPU the phases are read
//! from CUDA events queued between them: the device's clock, and the step is never stopped to
//! take them; on the CPU, where work is done when its call returns, from the host's clock.

use std::time::{Duration, Instant};

use candle_core::{Device, Result};

/// A step's time by phase.
#[derive(Debug, Clone, Copy, Default)]
pub struct Phases {
    pub forward: Duration,
    pub backward: Duration,
    pub sync: Duration,
    pub update: Duration,
    /// Whether any phase was timed (a world-size-invariant step's are not).
    pub timed: bool,
    /// Whether the device's clock (CUDA events) gave the times, rather than the host's: the
    /// device's time from one phase's end to the next's, which includes any wait of the
    /// device for the host's launches.
    pub device_clock: bool,
}

/// The phase a mark ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Phase {
    Forward,
    Backward,
    Sync,
    Update,
}

impl Phases {
    fn of(&mut self, phase: Phase) -> &mut Duration {
        match phase {
            Phase::Forward => &mut self.forward,
            Phase::Backward => &mut self.backward,
            Phase::Sync => &mut self.sync,
            Phase::Update => &mut self.update,
        }
    }
}

/// A point in the work a step has queued: when the host got there (CPU), or an event the
/// device records when it gets there (GPU).
pub(super) enum Mark {
    Host(Instant),
    #[cfg(feature = "cuda")]
    Device(cudarc::driver::CudaEvent),
}

impl Mark {
    /// Now, in `device`'s queue of work.
    pub(super) fn now(device: &Device) -> Result<Mark> {
        #[cfg(feature = "cuda")]
        if let Device::Cuda(gpu) = device {
            use cudarc::driver::sys::CUevent_flags;
            // A timing event (the default flags): recorded behind everything queued so far.
            let event = gpu
                .cuda_stream()
                .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(|e| candle_core::Error::Msg(format!("cannot record a CUDA event: {e}")))?;
            return Ok(Mark::Device(event));
        }
        // Any other accelerator: wait for it, then read the host's clock.
        device.synchronize()?;
        Ok(Mark::Host(Instant::now()))
    }

    /// The later of two marks of one step's parallel parts (CPU row shards end their forwards
    /// at different times). A device's marks are taken as `other` being the later: a GPU step
    /// has no row shards (`ShardPool::for_device`), so its parts come in the order queued.
    pub(super) fn later(self, other: Mark) -> Mark {
        match (self, other) {
            (Mark::Host(a), Mark::Host(b)) => Mark::Host(a.max(b)),
            #[cfg(feature = "cuda")]
            (_, other) => other,
        }
    }

    /// The time from `self` to `later`, waiting for the device to reach `later`.
    fn until(&self, later: &Mark) -> Result<Duration> {
        match (self, later) {
            (Mark::Host(a), Mark::Host(b)) => Ok(b.saturating_duration_since(*a)),
            #[cfg(feature = "cuda")]
            (Mark::Device(a), Mark::Device(b)) => {
                let ms = a.elapsed_ms(b).map_err(|e| {
                    candle_core::Error::Msg(format!("cannot time between CUDA events: {e}"))
                })?;
                debug_assert!(ms >= 0.0, "a phase's marks out of order: {ms} ms");
                Ok(Duration::from_secs_f64(f64::from(ms.max(0.0)) / 1e3))
            }
            #[cfg(feature = "cuda")]
            _ => Err(candle_core::Error::Msg(
                "a step's phases were marked on two clocks (host and device)".into(),
            )),
        }
    }

    fn on_device(&self) -> bool {
        !matches!(self, Mark::Host(_))
    }
}

/// The marks of one step's phases, kept only when they are asked for; read once the step is
/// queued, so timing a GPU's phases adds events to its queue and never a wait between phases.
pub(super) struct PhaseClock<'a> {
    device: &'a Device,
    /// The step's start, then the end of each phase in order; `None` when not timed.
    marks: Option<Vec<(Option<Phase>, Mark)>>,
}

impl<'a> PhaseClock<'a> {
    pub(super) fn new(device: &'a Device, on: bool) -> Result<Self> {
        let marks = match on {
            true => Some(vec![(None, Mark::now(device)?)]),
            false => None,
        };
        Ok(PhaseClock { device, marks })
    }

    pub(super) fn timed(&self) -> bool {
        self.marks.is_some()
    }

    /// `phase` ends now.
    pub(super) fn lap(&mut self, phase: Phase) -> Result<()> {
        if let Some(marks) = &mut self.marks {
            marks.push((Some(phase), Mark::now(self.device)?));
        }
        Ok(())
    }

    /// A forward pass ended at `forward_end` (when it was marked) and its backward ends now.
    pub(super) fn split(&mut self, forward_end: Option<Mark>) -> Result<()> {
        if let (Some(marks), Some(end)) = (&mut self.marks, forward_end) {
            marks.push((Some(Phase::Forward), end));
        }
        self.lap(Phase::Backward)
    }

    /// Adds the step's phases to `phases` (on a GPU, once the device has done them).
    pub(super) fn finish(self, phases: &mut Phases) -> Result<()> {
        let Some(marks) = self.marks else {
            return Ok(());
        };
        for pair in marks.windows(2) {
            let [(_, from), (Some(phase), to)] = pair else {
                continue;
            };
            *phases.of(*phase) += from.until(to)?;
            phases.timed = true;
            phases.device_clock |= to.on_device();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wait(ms: u64) {
        std::thread::sleep(Duration::from_millis(ms));
    }

    #[test]
    fn each_phase_gets_the_time_up_to_its_mark() {
        let cpu = Device::Cpu;
        let started = Instant::now();
        let mut clock = PhaseClock::new(&cpu, true).unwrap();
        assert!(clock.timed());
        wait(30);
        let forward_end = Mark::now(&cpu).unwrap();
        wait(10);
        clock.split(Some(forward_end)).unwrap();
        clock.lap(Phase::Sync).unwrap();
        wait(20);
        clock.lap(Phase::Update).unwrap();
        let mut phases = Phases::default();
        clock.finish(&mut phases).unwrap();
        let total = started.elapsed();
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        assert!(ms(phases.forward) >= 30.0, "{phases:?}");
        assert!(ms(phases.backward) >= 10.0, "{phases:?}");
        assert!(ms(phases.update) >= 20.0, "{phases:?}");
        assert!(ms(phases.sync) < 10.0, "{phases:?}");
        let sum = phases.forward + phases.backward + phases.sync + phases.update;
        assert!(sum <= total, "{phases:?} in {total:?}");
        assert!(phases.timed && !phases.device_clock);
    }

    #[test]
    fn a_clock_not_asked_for_marks_nothing() {
        let cpu = Device::Cpu;
        let mut clock = PhaseClock::new(&cpu, false).unwrap();
        assert!(!clock.timed());
        clock.split(None).unwrap();
        clock.lap(Phase::Update).unwrap();
        let mut phases = Phases::default();
        clock.finish(&mut phases).unwrap();
        assert_eq!(
            phases.forward + phases.backward + phases.update,
            Duration::ZERO
        );
        assert!(!phases.timed);
    }

    #[test]
    fn parallel_parts_end_their_forward_at_the_latest_mark() {
        let instant = |mark: Mark| match mark {
            Mark::Host(t) => t,
            #[cfg(feature = "cuda")]
            Mark::Device(_) => panic!("host marks stay host marks"),
        };
        let early = Instant::now();
        let late = early + Duration::from_millis(5);
        for (a, b) in [(early, late), (late, early)] {
            assert_eq!(instant(Mark::Host(a).later(Mark::Host(b))), late);
        }
    }

    /// Runs where a GPU is: the phases of queued products are the device's times, taken from
    /// its events, and they fit in the time the host waited for the work.
    #[test]
    fn the_gpu_times_its_phases_with_events() {
        let Ok(gpu) = Device::new_cuda(0) else {
            eprintln!("skipping: no GPU");
            return;
        };
        let a = candle_core::Tensor::ones((2048, 2048), candle_core::DType::F32, &gpu).unwrap();
        a.matmul(&a).unwrap();
        gpu.synchronize().unwrap();
        let started = Instant::now();
        let mut clock = PhaseClock::new(&gpu, true).unwrap();
        let mut products = Vec::new();
        for _ in 0..8 {
            products.push(a.matmul(&a).unwrap());
        }
        clock.lap(Phase::Backward).unwrap();
        clock.lap(Phase::Update).unwrap();
        let mut phases = Phases::default();
        clock.finish(&mut phases).unwrap();
        let waited = started.elapsed();
        assert!(phases.device_clock);
        assert!(phases.backward > Duration::ZERO, "{phases:?}");
        assert!(phases.backward <= waited, "{phases:?} in {waited:?}");
        assert!(phases.update < phases.backward, "{phases:?}");
    }
}
