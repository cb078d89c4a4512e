//! The thread that syncs the redo log behind the writer.
//!
//! Why it exists: with a redo log, a batch's commit is its record's write,
//! one fdatasync, the publication of its rows to readers, then its hooks
//! and answers. Done on the writer thread, the writer sat out every sync
//! while the next batch's jobs queued behind it (a quarter of its time at
//! 32 connections, `perf trace`). Handed here, the writer runs the next
//! batch while the last one's sync is in flight, and one sync covers every
//! record written meanwhile. A lone submit (one job, nothing queued, nothing
//! in hand here) is still synced by the thread running its batch: a hand-over costs a
//! thread wake-up, which is all cost when nothing overlaps it.
//!
//! Invariants (asserted where they can be):
//! - A batch is published, its hooks run and its jobs answered only after
//!   a sync that began after its record was written; batches go out in
//!   the order they were handed over.
//! - After a failure (the sync, or the publication), every record handed
//!   over and not yet answered is voided, its jobs are answered with the
//!   error, and no record is written until the writer settles
//!   (`settle`): it then aborts the pending transaction, which holds those
//!   batches' rows, gives a new one the overlay's rows (every answered
//!   batch's, and no refused one's), and writes on where the first voided
//!   record began. Voiding every record, not just the first, matters: a
//!   later record of the same length as the first voided one would end
//!   where the next voided one begins, and a replay would read on into it.
//! - The writer settles before whatever must find every answered batch
//!   published and no refused one in the pending transaction: a
//!   checkpoint, an abort, a reopen's replay of the log.
//!
//! Decided: a batch refused here is answered with the error, not run
//! again job by job as a batch the writer refused is (a record the disk
//! would not sync means the log cannot take writes; a job run alone would
//! meet the same disk).

use crate::locks::Held;
use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use super::overlay::{Overlay, Staged};
use super::redo::{self, RecordBuf, RedoLog, Urgency};
use super::{StoreError, StoreResult};

/// What a batch leaves to do once its sync is done (run its hooks, answer
/// its jobs), or once it is refused (answer them with why).
pub(super) trait Answer: Send + 'static {
    fn answer(self, refused: Option<StoreError>);
}

/// The syncer of one store's redo log; its thread ends when this is
/// dropped (after answering what it has in hand).
pub(super) struct Syncer {
    shared: Arc<Between>,
}

/// A handed batch's `Answer`, boxed.
type AnswerFn = Box<dyn FnOnce(Option<StoreError>) + Send>;

/// Batches handed over and not yet taken by the thread, at most; the
/// writer waits for room past it. The write queue bounds the jobs waiting
/// for the writer (`WRITE_QUEUE_DEPTH`); this bounds those waiting after
/// it, on a disk whose syncs fall far behind, and so what one failed sync
/// refuses. The thread takes every waiting batch at once, so on a healthy
/// disk a handful wait at most.
const MAX_HANDED_BATCHES: usize = 64;

/// What the writer and the syncer thread share.
struct Between {
    state: Mutex<State>,
    /// Signalled when `State` changes (work handed over, work done).
    changed: Condvar,
}

struct State {
    /// Batches handed over and not yet taken by the thread, in order.
    handed: VecDeque<Handed>,
    /// Whether the thread holds batches taken off `handed`.
    in_hand: bool,
    /// A failure the writer has not settled yet.
    failed: Option<Failure>,
    closing: bool,
    /// Batches handed over and refused so far, for tests to know which
    /// path their writes took.
    #[cfg(test)]
    counted: Counted,
}

#[cfg(test)]
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Counted {
    pub(super) handed: u64,
    pub(super) refused: u64,
    /// Batches whose record could not be written.
    pub(super) not_taken: u64,
}

/// A batch whose record is written and not yet synced.
struct Handed {
    /// Where its record starts; `None` for a batch that wrote no rows
    /// (it is still answered in order, after the batches before it).
    start: Option<u64>,
    staged: Staged,
    answers: AnswerFn,
    /// The `redo.commit` failpoint fails its publication (read from the
    /// record's rows when it was written; always false without the
    /// `failpoints` feature).
    publish_fails: bool,
}

/// Why the handed batches were refused, and where the first voided record
/// began (`None`: none of them had a record).
pub(super) struct Failure {
    pub(super) error: StoreError,
    pub(super) from: Option<u64>,
    /// Refused records whose headers could not be voided: the log voids
    /// them before it writes again (`RedoLog::remember_unvoided`).
    pub(super) unvoided: Vec<u64>,
}

impl Syncer {
    /// Starts the thread, syncing `file` (the log's, `RedoLog::sync_handle`)
    /// and publishing to `overlay`.
    pub(super) fn start(file: std::fs::File, overlay: Arc<Overlay>) -> StoreResult<Syncer> {
        let shared = Arc::new(Between {
            state: Mutex::new(State {
                handed: VecDeque::new(),
                in_hand: false,
                failed: None,
                closing: false,
                #[cfg(test)]
                counted: Counted::default(),
            }),
            changed: Condvar::new(),
        });
        let thread_shared = shared.clone();
        std::thread::Builder::new()
            .name("berth-store-sync".into())
            .spawn(move || sync_loop(&thread_shared, &file, &overlay))
            .map_err(|e| {
                StoreError::other(format!("cannot start the redo log's sync thread: {e}"))
            })?;
        Ok(Syncer { shared })
    }

    /// Whether nothing is handed over and not yet answered.
    pub(super) fn idle(&self) -> bool {
        let state = self.shared.lock();
        state.handed.is_empty() && !state.in_hand && state.failed.is_none()
    }

    /// Whether a failure waits for the writer to settle it.
    pub(super) fn failed(&self) -> bool {
        self.shared.lock().failed.is_some()
    }

    /// Writes the batch's record to `log` (unless it has no rows) and hands
    /// the batch over, to be synced, published and answered. The write
    /// happens under the syncer's lock, so none follows a failure the
    /// writer has not settled. Gives `answers` back, with the error, when
    /// the write fails or such a failure is pending.
    pub(super) fn hand<A: Answer>(
        &self,
        log: &mut RedoLog,
        record: &mut RecordBuf,
        urgency: Urgency,
        staged: Staged,
        answers: A,
    ) -> Result<(), (StoreError, A)> {
        let mut state = self.shared.lock();
        while state.handed.len() >= MAX_HANDED_BATCHES && state.failed.is_none() {
            state = self
                .shared
                .changed
                .wait(state)
                .unwrap_or_else(|p| p.into_inner());
        }
        if let Some(failure) = &state.failed {
            return Err((failure.error.clone(), answers));
        }
        let publish_fails = crate::failpoints::hit_in("redo.commit", record.rows());
        let written = match crate::failpoints::hit_in("redo.append", record.rows()) {
            true => Err(StoreError::injected("redo.append")),
            false if record.rows().is_empty() => Ok(None),
            false => log.write(record, urgency).map(Some),
        };
        let start = match written {
            Ok(start) => start,
            Err(error) => {
                #[cfg(test)]
                {
                    state.counted.not_taken += 1;
                }
                return Err((error, answers));
            }
        };
        state.handed.push_back(Handed {
            start,
            staged,
            answers: Box::new(move |refused| answers.answer(refused)),
            publish_fails,
        });
        #[cfg(test)]
        {
            state.counted.handed += 1;
        }
        drop(state);
        self.shared.changed.notify_all();
        Ok(())
    }

    /// Waits until every batch handed over is answered; returns the
    /// failure met meanwhile, if any, which the caller must settle: abort
    /// the pending transaction, restore it from the overlay, and rewind
    /// the log to `Failure::from`. Afterwards the syncer takes batches
    /// again.
    pub(super) fn settle(&self) -> Option<Failure> {
        let mut state = self.shared.lock();
        while !state.handed.is_empty() || state.in_hand {
            state = self
                .shared
                .changed
                .wait(state)
                .unwrap_or_else(|p| p.into_inner());
        }
        state.failed.take()
    }
}

#[cfg(test)]
impl Syncer {
    pub(super) fn counted(&self) -> Counted {
        self.shared.lock().counted
    }
}

impl Drop for Syncer {
    fn drop(&mut self) {
        self.shared.lock().closing = true;
        self.shared.changed.notify_all();
    }
}

impl Between {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.held()
    }
}

/// The thread: takes every batch handed over so far, syncs once for them
/// all, then publishes and answers them in order.
fn sync_loop(shared: &Between, file: &std::fs::File, overlay: &Overlay) {
    loop {
        let mut batches: VecDeque<Handed> = {
            let mut state = shared.lock();
            while state.handed.is_empty() && !state.closing {
                state = shared
                    .changed
                    .wait(state)
                    .unwrap_or_else(|p| p.into_inner());
            }
            if state.handed.is_empty() {
                return;
            }
            debug_assert!(
                state.failed.is_none(),
                "a batch handed over after a failure"
            );
            state.in_hand = true;
            std::mem::take(&mut state.handed)
        };
        let mut failure = match batches.iter().any(|b| b.start.is_some()) {
            true => file.sync_data().map_err(StoreError::from).err(),
            false => None,
        };
        while failure.is_none() {
            let Some(batch) = batches.pop_front() else {
                break;
            };
            if batch.publish_fails {
                failure = Some(StoreError::injected("redo.commit"));
                batches.push_front(batch);
                break;
            }
            overlay.publish_staged(batch.staged);
            answer(batch.answers, None);
        }
        let mut state = shared.lock();
        if let Some(error) = failure {
            // Nothing more is written until the writer settles: the lock
            // is held while every record handed over is voided.
            let refused: Vec<Handed> = batches.into_iter().chain(state.handed.drain(..)).collect();
            let from = refused.iter().find_map(|b| b.start);
            let mut unvoided = Vec::new();
            for start in refused.iter().filter_map(|b| b.start) {
                if let Err(e) = redo::void_at(file, start) {
                    tracing::error!(error = %e, "cannot void a refused record in the redo log; it is voided before the log is written again");
                    unvoided.push(start);
                }
            }
            tracing::error!(error = %error, batches = refused.len(),
                "a redo log sync (or the publication after it) failed; its batches are refused");
            #[cfg(test)]
            {
                state.counted.refused += refused.len() as u64;
            }
            state.failed = Some(Failure {
                error: error.clone(),
                from,
                unvoided,
            });
            for batch in refused {
                answer(batch.answers, Some(error.clone()));
            }
        } else {
            debug_assert!(batches.is_empty());
        }
        state.in_hand = false;
        drop(state);
        shared.changed.notify_all();
    }
}

/// Runs a batch's answers. A panic there must not take this thread with
/// it: every later batch would wait for an answer for ever, and the
/// writer with them at its next settle. (The writer's answers already
/// catch a panicking hook, `writer::run_hooks`; this covers any other
/// `Answer`.) The panic is logged; the jobs its unwinding skipped see
/// their answer dropped (the caller's closed-store error).
fn answer(answers: AnswerFn, refused: Option<StoreError>) {
    let answered = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| answers(refused)));
    if answered.is_err() {
        tracing::error!("a hook or answer of a synced batch panicked; the syncer goes on");
    }
}
