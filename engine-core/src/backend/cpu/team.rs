//! A team of threads that wait for work by spinning, for decode's many short matrix-vector
//! products.
//!
//! A decode step of the 0.8B shape makes about 190 of them, 10-300 µs each. Through rayon's
//! pool each one cost a hand-off of about 50 µs on a 2-vCPU VM: the caller is not one of the
//! pool's threads, so it wakes a sleeping worker and sleeps until the last task ends, and every
//! wake-up of an idle virtual CPU is slow. Measured on 150 products of 3584x1024 Q4_K weights
//! (2 MB each) that together make one 300 MB matrix: 15.8 GB/s as 150 rayon calls, 24.8 GB/s
//! as one call. Like llama.cpp's thread pool, the team's threads keep spinning for a while
//! after each job, so that the next one starts at once, and the caller works on the job too.
//! A thread that has spun for [`SPIN`] without work sleeps until the next job, so the team
//! costs nothing between requests.

use std::any::Any;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// How long an idle thread spins before it sleeps: longer than the gaps between one decode
/// step's products (norms, the recurrent state update), far shorter than a human notices.
const SPIN: Duration = Duration::from_millis(2);

/// The job being run: `f(i)` for every `i < chunks`, `f` living on the caller's stack until
/// the caller has seen every chunk finish.
#[derive(Clone, Copy)]
struct Job {
    f: *const (dyn Fn(usize) + Sync),
    chunks: usize,
    epoch: u32,
}

// SAFETY: `f` is `Sync`, and `run` keeps it alive while any thread may call it.
unsafe impl Send for Job {}

struct Shared {
    /// The latest job; its `epoch` is the high half of `ticket` while it runs.
    job: Mutex<Option<Job>>,
    /// `epoch << 32 | next chunk to take`, stored (under `job`'s lock) when a job is posted:
    /// the waiting threads watch its epoch move. A thread takes a chunk only with a
    /// compare-exchange on the whole, so it never takes one of a newer job than the one it read.
    ticket: AtomicU64,
    /// Chunks of the current job that have finished.
    finished: AtomicUsize,
    /// A panic in one of the team's threads, for the caller to resume.
    panic: Mutex<Option<Box<dyn Any + Send>>>,
    /// Sleeping threads wait here for the ticket's epoch to move.
    wake: Condvar,
    sleeping: Mutex<usize>,
}

/// The team: its threads and the lock that lets one caller run a job at a time.
pub struct Team {
    shared: Arc<Shared>,
    threads: usize,
    caller: Mutex<()>,
}

impl Team {
    /// A team of `threads` counting the caller (so `threads - 1` threads of its own).
    fn new(threads: usize) -> Team {
        let shared = Arc::new(Shared {
            job: Mutex::new(None),
            ticket: AtomicU64::new(0),
            finished: AtomicUsize::new(0),
            panic: Mutex::new(None),
            wake: Condvar::new(),
            sleeping: Mutex::new(0),
        });
        for i in 1..threads {
            let shared = shared.clone();
            std::thread::Builder::new()
                .name(format!("tether-team-{i}"))
                .spawn(move || helper(&shared))
                .expect("spawn a team thread");
        }
        Team {
            shared,
            threads,
            caller: Mutex::new(()),
        }
    }

    /// The process's team, as many threads as rayon's pool (which `--threads` sizes).
    pub fn global() -> &'static Team {
        static TEAM: OnceLock<Team> = OnceLock::new();
        TEAM.get_or_init(|| Team::new(rayon::current_num_threads()))
    }

    /// `f(i, chunk i)` for every chunk of `len` elements of `data` (the last may be shorter),
    /// spread over the team. None, without running anything, if another caller is using the
    /// team (run the job some other way).
    pub fn chunks_mut<T: Send>(
        &self,
        data: &mut [T],
        len: usize,
        f: impl Fn(usize, &mut [T]) + Sync,
    ) -> Option<()> {
        assert!(len > 0);
        let _caller = match self.caller.try_lock() {
            Ok(g) => g,
            // A job that panicked leaves nothing half done: every chunk finished first.
            Err(std::sync::TryLockError::Poisoned(e)) => e.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return None,
        };
        let (base, total) = (data.as_mut_ptr() as usize, data.len());
        let each = |i: usize| {
            let start = i * len;
            let n = len.min(total - start);
            // SAFETY: chunk `i` is taken exactly once per job, and chunks do not overlap, so
            // this is the only reference to these elements while `f` runs; `data` is borrowed
            // mutably until `run` returns, after every chunk finished.
            let chunk = unsafe { std::slice::from_raw_parts_mut((base as *mut T).add(start), n) };
            f(i, chunk);
        };
        self.run(total.div_ceil(len), &each);
        Some(())
    }

    /// Calls `f(i)` for every `i < chunks` on the team and returns when all have finished.
    fn run(&self, chunks: usize, f: &(dyn Fn(usize) + Sync)) {
        if self.threads == 1 || chunks <= 1 {
            return (0..chunks).for_each(f);
        }
        let s = &self.shared;
        // SAFETY: only the lifetime is erased. `f` outlives every call the team makes: this
        // function returns only after all `chunks` calls finished, and no thread takes a chunk
        // of this job after that (the ticket's epoch moves on with the next job).
        let f: *const (dyn Fn(usize) + Sync) = unsafe { std::mem::transmute(f) };
        let job = {
            let mut slot = s.job.lock().unwrap_or_else(|e| e.into_inner());
            // Epoch 0 is the threads' "nothing seen yet".
            let epoch = slot.map_or(1, |j| j.epoch.wrapping_add(1).max(1));
            let job = Job { f, chunks, epoch };
            s.finished.store(0, Ordering::Relaxed);
            *slot = Some(job);
            s.ticket.store(u64::from(epoch) << 32, Ordering::Release);
            job
        };
        if *s.sleeping.lock().unwrap_or_else(|e| e.into_inner()) > 0 {
            s.wake.notify_all();
        }
        work(s, job);
        while s.finished.load(Ordering::Acquire) < chunks {
            std::hint::spin_loop();
        }
        if let Some(p) = s.panic.lock().unwrap_or_else(|e| e.into_inner()).take() {
            std::panic::resume_unwind(p);
        }
    }
}

/// Takes chunks of `job` until none is left (or a newer job has replaced it).
fn work(s: &Shared, job: Job) {
    let mut t = s.ticket.load(Ordering::Acquire);
    loop {
        let next = t as u32 as usize;
        if epoch(t) != job.epoch || next >= job.chunks {
            return;
        }
        match s
            .ticket
            .compare_exchange_weak(t, t + 1, Ordering::AcqRel, Ordering::Acquire)
        {
            Ok(_) => {
                // SAFETY: the chunk belongs to `job`, whose caller waits for it to finish.
                let f = unsafe { &*job.f };
                let done = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(next)));
                if let Err(p) = done {
                    *s.panic.lock().unwrap_or_else(|e| e.into_inner()) = Some(p);
                }
                s.finished.fetch_add(1, Ordering::Release);
                t = s.ticket.load(Ordering::Acquire);
            }
            Err(now) => t = now,
        }
    }
}

/// The epoch of the job `ticket` belongs to.
fn epoch(ticket: u64) -> u32 {
    (ticket >> 32) as u32
}

/// A team thread: waits for each new job (spinning, then sleeping) and works on it.
fn helper(s: &Shared) {
    let mut seen = 0;
    loop {
        seen = wait_for_job(s, seen);
        let job = *s.job.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(job) = job {
            work(s, job);
        }
    }
}

/// Returns the ticket's epoch once it differs from `seen`: spinning for up to [`SPIN`], then
/// asleep on the condition variable.
fn wait_for_job(s: &Shared, seen: u32) -> u32 {
    let start = Instant::now();
    let mut spins = 0u32;
    loop {
        let now = epoch(s.ticket.load(Ordering::Acquire));
        if now != seen {
            return now;
        }
        spins += 1;
        if spins.is_multiple_of(256) {
            if start.elapsed() > SPIN {
                break;
            }
            // Let another runnable thread (rayon's, during a prefill) have this core.
            std::thread::yield_now();
        }
        std::hint::spin_loop();
    }
    let mut sleeping = s.sleeping.lock().unwrap_or_else(|e| e.into_inner());
    *sleeping += 1;
    loop {
        let now = epoch(s.ticket.load(Ordering::Acquire));
        if now != seen {
            *sleeping -= 1;
            return now;
        }
        sleeping = s.wake.wait(sleeping).unwrap_or_else(|e| e.into_inner());
    }
}

#[cfg(test)]
mod tests {
    use super::Team;

    /// Every chunk is visited once, with its own elements, over many jobs in a row (the
    /// threads spinning between them) and after a pause long enough for them to sleep.
    #[test]
    fn every_chunk_once_per_job() {
        let team = Team::new(3);
        for round in 0..200usize {
            if round == 100 {
                std::thread::sleep(super::SPIN * 3);
            }
            let len = 1 + round % 7;
            let mut data = vec![0usize; 50 + round];
            team.chunks_mut(&mut data, len, |i, c| {
                for v in c.iter_mut() {
                    *v += i + 1;
                }
            })
            .expect("the team is free");
            for (j, v) in data.iter().enumerate() {
                assert_eq!(*v, j / len + 1, "round {round}, element {j}");
            }
        }
    }

    /// A panic on any thread reaches the caller, and the team still works afterwards.
    #[test]
    fn a_panic_reaches_the_caller() {
        let team = Team::new(2);
        let mut data = vec![0u8; 64];
        let hit = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            team.chunks_mut(&mut data, 1, |i, _| assert!(i != 40, "chunk 40"))
        }));
        assert!(hit.is_err());
        team.chunks_mut(&mut data, 8, |_, c| c.fill(1)).unwrap();
        assert!(data.iter().all(|&v| v == 1));
    }
}
