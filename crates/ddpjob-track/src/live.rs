//! Following a job as it trains: a thread of node 0's launcher that sends what the job
//! records every few seconds (see `run`), so a slow or dead server never slows a step (the
//! workers never wait on it; the launcher only reads their `metrics.jsonl`). A server out of
//! reach is one warning, then tried again with backoff; when it answers the backlog goes. At
//! the end the run is ended as the job ended, within a bounded wait; what could not go by
//! then is `ddpjob sync`'s.

use std::sync::mpsc::{self, RecvTimeoutError, Sender};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::run::Tracker;

/// How often the records are read while the server answers.
const EVERY: Duration = Duration::from_secs(2);
/// The longest wait between tries while it does not.
const BACKOFF_AT_MOST: Duration = Duration::from_secs(30);
/// The longest a backlog is sent before the thread looks whether the job has ended.
const SLICE: Duration = Duration::from_secs(10);

/// What the thread tells the user: a warning, or a note (the run's address).
pub type Say = Box<dyn Fn(Note) + Send>;

/// A line for the user.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Note {
    Info(String),
    Warning(String),
}

/// The following thread.
pub struct Live {
    stop: Sender<()>,
    /// The tracker, the user's lines, and whether the server ever answered.
    thread: JoinHandle<(Tracker, Say, bool)>,
}

impl Live {
    /// Follows the job of `tracker`, marking its run running on `world_size` workers.
    pub fn start(mut tracker: Tracker, world_size: usize, say: Say) -> Live {
        let (stop, stopped) = mpsc::channel();
        let thread = std::thread::spawn(move || {
            let mut down = false;
            let mut wait = Duration::ZERO;
            let mut first = true;
            let mut ever_up = false;
            loop {
                match stopped.recv_timeout(wait) {
                    Ok(()) | Err(RecvTimeoutError::Disconnected) => break,
                    Err(RecvTimeoutError::Timeout) => {}
                }
                // A backlog goes a slice at a time, so a stop is seen within a slice.
                let slice = Some(Instant::now() + SLICE);
                let tried = match first {
                    true => (tracker.running(world_size)).and_then(|()| tracker.sync_until(slice)),
                    false => tracker.sync_until(slice),
                };
                // A run made is a server that answered, even if the rest then failed.
                ever_up |= tracker.run_id().is_some();
                match tried {
                    Ok(_) => {
                        if first {
                            say(Note::Info(format!(
                                "mlflow: logging to run {} at {}",
                                tracker.run_id().unwrap_or("?"),
                                tracker.uri()
                            )));
                        } else if down {
                            say(Note::Info(format!(
                                "mlflow: {} answers again; what it missed is sent",
                                tracker.uri()
                            )));
                        }
                        (first, down, wait, ever_up) = (false, false, EVERY, true);
                    }
                    Err(e) => {
                        if !down {
                            say(Note::Warning(format!(
                                "mlflow: {e}; training goes on, and the metrics are sent when \
                                 it answers (or by `ddpjob sync` afterwards)"
                            )));
                        }
                        down = true;
                        wait = (wait * 2).clamp(EVERY, BACKOFF_AT_MOST);
                        if !e.is_transient() && first {
                            // A refusal (a bad token, not a tracking server) will not pass by
                            // itself: stop asking, and say so once.
                            break;
                        }
                    }
                }
            }
            (tracker, say, ever_up)
        });
        Live { stop, thread }
    }

    /// Stops following and ends the run as `state.json` says the job ended, trying for at most
    /// `patience` (a moment only when the server never answered while the job trained).
    pub fn finish(self, patience: Duration) {
        let _ = self.stop.send(());
        let Ok((mut tracker, say, ever_up)) = self.thread.join() else {
            return;
        };
        let patience = match ever_up {
            true => patience,
            false => patience.min(Duration::from_secs(2)),
        };
        let until = Instant::now() + patience;
        let mut wait = Duration::from_millis(500);
        loop {
            match tracker.finish_until(Some(until)) {
                Ok(warnings) => {
                    for w in warnings {
                        say(Note::Warning(format!("mlflow: {w}")));
                    }
                    return;
                }
                Err(e) if e.is_transient() && Instant::now() + wait < until => {
                    std::thread::sleep(wait);
                    wait = (wait * 2).min(BACKOFF_AT_MOST);
                }
                Err(e) => {
                    say(Note::Warning(format!(
                        "mlflow: {e}; the run is not complete there: `ddpjob sync {}` sends \
                         the rest",
                        tracker.job_name()
                    )));
                    return;
                }
            }
        }
    }
}
