//! A small team of threads for work too short for the rayon pool: a decode step of a small
//! model. Its phases last microseconds each, and a rayon parallel loop per phase wakes a
//! sleeping worker each time (futex wake-ups were a third of a d_model 256 · 4 layers step).
//! A team job instead runs one closure on every member at once — the calling thread is
//! member 0 — and the members meet at spin barriers between phases; the workers spin a
//! little after each job before they sleep, so back-to-back steps wake nobody.
//!
//! The workers are this module's own threads, never rayon's, so a member spinning at a
//! barrier cannot be waiting for a job queued behind itself. One job runs at a time; a
//! caller that finds the team busy runs its job alone (member 0 of 1).

use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// How long a worker spins for the next job before it sleeps: longer than the gap between
/// two decode steps (sampling, detokenising), short enough to cost nothing when idle.
const SPIN_BEFORE_SLEEP: Duration = Duration::from_micros(300);

/// How long a member spins at a barrier before it sleeps there: longer than the members'
/// usual imbalance within a step, short enough that on a machine busy with other work a
/// member whose partner was descheduled gives its core up instead of spinning through the
/// partner's time slice. At least this; for a long phase, [`SPIN_PHASE_SHARE`] of it.
const SPIN_AT_BARRIER: Duration = Duration::from_micros(30);

/// A member spins at a barrier for up to this share (1/n) of the phase it just ran (since
/// the barrier before), if longer than [`SPIN_AT_BARRIER`]: in a large model's step
/// (phases of a few hundred µs, streaming memory) members arrive more than 30 µs apart
/// often enough (with fixed halves of each product, at 1 to 41 of the 97 barriers of a
/// mamba-130m-shaped bf16 step on the 2-core machine) that each sleep's wake-up adds up.
const SPIN_PHASE_SHARE: u32 = 4;

/// Jobs run on the calling thread alone after one whose members had to sleep at
/// [`LATE_SLEEPS`] barriers or more, and at one in [`LATE_SHARE`] of its barriers or more
/// (members kept off their cores: other work on the machine, or both members placed on
/// one core, where every barrier then costs a spin and a sleep; a single late barrier is
/// a passing interruption). The share keeps a long job — a decode step of a large model
/// passes a hundred barriers, phases of a few hundred µs apart — on the team when a few
/// of its phases drift apart by more than the spin. The next team job tries again.
const ALONE_AFTER_LATE: u32 = 64;
const LATE_SLEEPS: usize = 3;
const LATE_SHARE: usize = 8;

/// ... but for no longer than this the first time, twice as long after each team job
/// that was late again (a machine that stays busy), and again this after one that was not.
/// 64 steps of a small model last ~10 ms, of a large one a second: on the idle 2-core
/// machine, passing interruptions (two jobs with 16 and 37 late barriers of 97 in a run of
/// 256 mamba-130m-shaped bf16 steps) had sent half the steps alone, 12.9–13.4 ms/token
/// against 10.6 with the team never going alone; a fixed 20 ms, under a busy loop on one
/// core, tried the team again too often (up to 28 ms/token against 24 on the pool).
const ALONE_AT_FIRST: Duration = Duration::from_millis(20);

/// One member's view of a running job.
pub struct Member<'a> {
    /// 0 (the caller) to `n − 1`.
    pub id: usize,
    /// Members of this job.
    pub n: usize,
    barrier: &'a Barrier,
}

impl Member<'_> {
    /// Wait until every member has reached this point; what each wrote before is then
    /// visible to all.
    pub fn barrier(&self) {
        self.barrier.wait();
    }

    /// This member's share `start..end` of `0..len`, cut in `n` contiguous pieces whose
    /// bounds are multiples of `align` (the last piece takes the rest).
    pub fn share(&self, len: usize, align: usize) -> std::ops::Range<usize> {
        let per = len.div_ceil(self.n).next_multiple_of(align.max(1));
        let start = (self.id * per).min(len);
        start..((self.id + 1) * per).min(len)
    }

    /// Pieces `start..end` of `0..len`, `chunk` long (the last the rest), handed out to
    /// whichever member asks next: a member that runs ahead takes more, so the members
    /// reach the next barrier together where fixed shares of a long phase (a large model's
    /// products, hundreds of µs) drift apart. One such loop per phase: the counter is reset
    /// when the members pass a barrier.
    pub fn chunks(
        &self,
        len: usize,
        chunk: usize,
    ) -> impl Iterator<Item = std::ops::Range<usize>> + '_ {
        let chunk = chunk.max(1);
        std::iter::from_fn(move || {
            let start = self
                .barrier
                .next
                .fetch_add(1, Ordering::Relaxed)
                .saturating_mul(chunk);
            (start < len).then(|| start..(start + chunk).min(len))
        })
    }
}

/// A barrier that spins, then sleeps; a member that panicked poisons it, so the others
/// leave (by panicking too) instead of waiting forever.
struct Barrier {
    n: usize,
    arrived: AtomicUsize,
    generation: AtomicUsize,
    poisoned: AtomicBool,
    sleepers: AtomicUsize,
    lock: Mutex<()>,
    wake: Condvar,
    /// How many times members slept at a barrier after the first.
    late: AtomicUsize,
    /// When the barrier was made, and when it last let its members go (ns after).
    t0: Instant,
    released_ns: AtomicU64,
    /// The next piece of the phase's [`Member::chunks`].
    next: AtomicUsize,
}

impl Barrier {
    fn new(n: usize) -> Barrier {
        Barrier {
            n,
            arrived: AtomicUsize::new(0),
            generation: AtomicUsize::new(0),
            poisoned: AtomicBool::new(false),
            sleepers: AtomicUsize::new(0),
            lock: Mutex::new(()),
            wake: Condvar::new(),
            late: AtomicUsize::new(0),
            t0: Instant::now(),
            released_ns: AtomicU64::new(0),
            next: AtomicUsize::new(0),
        }
    }

    fn wait(&self) {
        if self.n == 1 {
            self.next.store(0, Ordering::Relaxed);
            return;
        }
        let g = self.generation.load(Ordering::Acquire);
        if self.arrived.fetch_add(1, Ordering::AcqRel) + 1 == self.n {
            self.arrived.store(0, Ordering::Relaxed);
            // (every member is here: nobody takes a piece until the release below)
            self.next.store(0, Ordering::Relaxed);
            let now = self.t0.elapsed().as_nanos() as u64;
            self.released_ns.store(now, Ordering::Relaxed);
            self.generation.fetch_add(1, Ordering::SeqCst);
            if self.sleepers.load(Ordering::SeqCst) > 0 {
                let _guard = self.lock.lock().unwrap_or_else(|e| e.into_inner());
                self.wake.notify_all();
            }
            return;
        }
        let t0 = Instant::now();
        let phase = (t0 - self.t0).saturating_sub(Duration::from_nanos(
            self.released_ns.load(Ordering::Relaxed),
        ));
        let spin = SPIN_AT_BARRIER.max(phase / SPIN_PHASE_SHARE);
        let mut spins = 0u32;
        while self.generation.load(Ordering::Acquire) == g {
            if self.poisoned.load(Ordering::Relaxed) {
                panic!("another member of the thread team panicked");
            }
            spins += 1;
            if spins.is_multiple_of(64) && t0.elapsed() > spin {
                let mut guard = self.lock.lock().unwrap_or_else(|e| e.into_inner());
                self.sleepers.fetch_add(1, Ordering::SeqCst);
                // (the first barrier may wait for a worker that was asleep: not late)
                if g > 0 {
                    self.late.fetch_add(1, Ordering::Relaxed);
                }
                // (the timeout only re-checks the poison flag)
                while self.generation.load(Ordering::SeqCst) == g
                    && !self.poisoned.load(Ordering::SeqCst)
                {
                    guard = self
                        .wake
                        .wait_timeout(guard, Duration::from_millis(1))
                        .unwrap_or_else(|e| e.into_inner())
                        .0;
                }
                self.sleepers.fetch_sub(1, Ordering::SeqCst);
            } else {
                std::hint::spin_loop();
            }
        }
    }
}

type JobFn<'a> = dyn Fn(&Member) + Sync + 'a;

/// What the caller publishes for the workers.
struct Shared {
    /// Bumped once per job; a worker runs the job whose number it has not run yet.
    job_no: AtomicU64,
    /// Members of the current job (workers with `id >= size` skip it).
    size: AtomicUsize,
    /// The current job and its barrier, their lifetimes erased: valid until every member
    /// of the job is done.
    job: Mutex<Option<(&'static JobFn<'static>, &'static Barrier)>>,
    /// Workers that finished the current job.
    done: AtomicUsize,
    panicked: AtomicBool,
    sleeping: AtomicUsize,
    sleep_lock: Mutex<()>,
    wake: Condvar,
}

pub struct Team {
    shared: &'static Shared,
    workers: usize,
    /// Jobs still to run alone (see [`ALONE_AFTER_LATE`]).
    alone_left: u32,
    /// ... until then.
    alone_until: Instant,
    /// The last such window ([`ALONE_AT_FIRST`]); zero after a team job on time.
    alone_for: Duration,
}

static TEAM: OnceLock<Mutex<Team>> = OnceLock::new();

fn team() -> &'static Mutex<Team> {
    TEAM.get_or_init(|| {
        let shared: &'static Shared = Box::leak(Box::new(Shared {
            job_no: AtomicU64::new(0),
            size: AtomicUsize::new(0),
            job: Mutex::new(None),
            done: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
            sleeping: AtomicUsize::new(0),
            sleep_lock: Mutex::new(()),
            wake: Condvar::new(),
        }));
        // As many members as the rayon pool has threads (`--threads`), the caller included.
        let workers = rayon::current_num_threads().saturating_sub(1);
        for id in 1..=workers {
            std::thread::Builder::new()
                .name(format!("mamba3-team-{id}"))
                .spawn(move || worker(shared, id))
                .expect("spawning a thread of the decode team");
        }
        Mutex::new(Team {
            shared,
            workers,
            alone_left: 0,
            alone_until: Instant::now(),
            alone_for: Duration::ZERO,
        })
    })
}

/// The most members a job can have: the rayon pool's thread count.
pub fn max_members() -> usize {
    rayon::current_num_threads().max(1)
}

/// Weight bytes per member of a decode step on the team: a step that reads less than twice
/// this runs on the calling thread alone, a larger one on up to [`max_members`]. (On the
/// 2-core machine, one thread streams a step's weights at ~25 GB/s and two at ~55 GB/s:
/// 7.3 MB take ~250 µs against ~130 µs; the team's barriers, a few per layer, and its
/// wake-up cost a few µs, worth paying from about a megabyte: a choice from these rates,
/// not a measured crossover.)
const BYTES_PER_MEMBER: usize = 512 << 10;

/// How many threads a decode step that reads `step_bytes` of weights runs on: the one
/// place that decides between the calling thread alone and the team.
pub fn members_for(step_bytes: usize) -> usize {
    (step_bytes / BYTES_PER_MEMBER).clamp(1, max_members())
}

fn worker(sh: &'static Shared, id: usize) {
    let mut last = 0u64;
    loop {
        // Spin for the next job, then sleep until one comes.
        let t0 = Instant::now();
        let mut spins = 0u32;
        let mut no = sh.job_no.load(Ordering::Acquire);
        while no == last {
            spins += 1;
            if spins.is_multiple_of(64) && t0.elapsed() > SPIN_BEFORE_SLEEP {
                let mut guard = sh.sleep_lock.lock().unwrap_or_else(|e| e.into_inner());
                sh.sleeping.fetch_add(1, Ordering::SeqCst);
                while sh.job_no.load(Ordering::SeqCst) == last {
                    guard = sh.wake.wait(guard).unwrap_or_else(|e| e.into_inner());
                }
                sh.sleeping.fetch_sub(1, Ordering::SeqCst);
                drop(guard);
            } else {
                std::hint::spin_loop();
            }
            no = sh.job_no.load(Ordering::Acquire);
        }
        last = no;
        if id >= sh.size.load(Ordering::Acquire) {
            continue;
        }
        // `run` published a closure and a barrier that live on its stack until `done`
        // counts every worker of this job, which happens below, after their last use.
        let Some((f, barrier)) = *sh.job.lock().unwrap_or_else(|e| e.into_inner()) else {
            continue;
        };
        let n = barrier.n;
        let ran = catch_unwind(AssertUnwindSafe(|| {
            f(&Member { id, n, barrier });
            barrier.wait();
        }));
        if ran.is_err() {
            sh.panicked.store(true, Ordering::SeqCst);
            barrier.poisoned.store(true, Ordering::SeqCst);
        }
        sh.done.fetch_add(1, Ordering::AcqRel);
    }
}

/// Run `f` on `want` members at once (fewer when the team is busy or smaller), the calling
/// thread being member 0; returns, when every member has returned, how many ran it. A
/// panic in any member is raised here.
pub fn run(want: usize, f: &(dyn Fn(&Member) + Sync)) -> usize {
    run_on(want, f, false)
}

/// [`run`] on exactly `min(want, max_members())` members: waits for a busy team and
/// ignores [`ALONE_AFTER_LATE`] (tests use it to hold a job to its members).
pub fn run_exact(want: usize, f: &(dyn Fn(&Member) + Sync)) -> usize {
    run_on(want, f, true)
}

fn run_on(want: usize, f: &(dyn Fn(&Member) + Sync), exact: bool) -> usize {
    let alone = |f: &(dyn Fn(&Member) + Sync)| {
        let barrier = Barrier::new(1);
        f(&Member {
            id: 0,
            n: 1,
            barrier: &barrier,
        });
        1
    };
    if want <= 1 {
        return alone(f);
    }
    let mut team = match team().try_lock() {
        Ok(t) => t,
        Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
        Err(std::sync::TryLockError::WouldBlock) if exact => {
            team().lock().unwrap_or_else(|e| e.into_inner())
        }
        Err(std::sync::TryLockError::WouldBlock) => return alone(f),
    };
    let n = want.min(team.workers + 1);
    if n <= 1 {
        return alone(f);
    }
    if team.alone_left > 0 && Instant::now() >= team.alone_until {
        team.alone_left = 0;
    }
    if team.alone_left > 0 && !exact {
        team.alone_left -= 1;
        drop(team);
        return alone(f);
    }
    let sh = team.shared;
    let barrier = Barrier::new(n);
    // SAFETY (of the lifetime erasure): the workers use these references only until they
    // count themselves in `done`; this function waits for all of them below, panicking
    // member or not, and clears them, before `f` and `barrier` go out of scope.
    let published: (&'static JobFn<'static>, &'static Barrier) = unsafe {
        (
            std::mem::transmute::<&JobFn<'_>, &'static JobFn<'static>>(f),
            &*(&barrier as *const Barrier),
        )
    };
    *sh.job.lock().unwrap_or_else(|e| e.into_inner()) = Some(published);
    sh.done.store(0, Ordering::SeqCst);
    sh.panicked.store(false, Ordering::SeqCst);
    sh.size.store(n, Ordering::SeqCst);
    sh.job_no.fetch_add(1, Ordering::SeqCst);
    if sh.sleeping.load(Ordering::SeqCst) > 0 {
        let _guard = sh.sleep_lock.lock().unwrap_or_else(|e| e.into_inner());
        sh.wake.notify_all();
    }
    let mine = catch_unwind(AssertUnwindSafe(|| {
        f(&Member {
            id: 0,
            n,
            barrier: &barrier,
        })
    }));
    if mine.is_err() {
        barrier.poisoned.store(true, Ordering::SeqCst);
    }
    // Every member passes this last barrier before it counts itself done, so the wait
    // below is short.
    if mine.is_ok() {
        barrier.wait();
    }
    let mut spins = 0u32;
    while sh.done.load(Ordering::Acquire) < n - 1 {
        spins += 1;
        if spins < 1024 {
            std::hint::spin_loop();
        } else {
            std::thread::yield_now();
        }
    }
    let worker_panicked = sh.panicked.load(Ordering::SeqCst);
    let late = barrier.late.load(Ordering::Relaxed);
    let passed = barrier.generation.load(Ordering::Relaxed);
    if late >= LATE_SLEEPS.max(passed / LATE_SHARE) && !exact {
        team.alone_left = ALONE_AFTER_LATE;
        // (capped: 64 jobs end a window first anyway)
        team.alone_for = (team.alone_for * 2).clamp(ALONE_AT_FIRST, Duration::from_secs(60));
        team.alone_until = Instant::now() + team.alone_for;
    } else if !exact {
        team.alone_for = Duration::ZERO;
    }
    *sh.job.lock().unwrap_or_else(|e| e.into_inner()) = None;
    drop(team);
    if let Err(e) = mine {
        resume_unwind(e);
    }
    if worker_panicked {
        panic!("a member of the thread team panicked");
    }
    n
}

/// A buffer that the members of a job share: each writes its own disjoint part in one
/// phase, and reads the whole in a later one, the phases separated by a barrier.
pub struct SharedBuf<'a, T> {
    ptr: *mut T,
    len: usize,
    _borrow: std::marker::PhantomData<&'a mut [T]>,
}

// SAFETY: access goes through the unsafe methods below, whose callers keep writers
// disjoint and separate them from readers by barriers.
unsafe impl<T: Send> Sync for SharedBuf<'_, T> {}
unsafe impl<T: Send> Send for SharedBuf<'_, T> {}

impl<'a, T> SharedBuf<'a, T> {
    pub fn new(buf: &'a mut [T]) -> Self {
        SharedBuf {
            ptr: buf.as_mut_ptr(),
            len: buf.len(),
            _borrow: std::marker::PhantomData,
        }
    }

    /// The whole buffer, to read.
    ///
    /// # Safety
    /// No member writes any of it until the reader is past the next barrier.
    pub unsafe fn get(&self) -> &[T] {
        std::slice::from_raw_parts(self.ptr, self.len)
    }

    /// `range` of the buffer, to write.
    ///
    /// # Safety
    /// No other member reads or writes any of `range` until the next barrier.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn part(&self, range: std::ops::Range<usize>) -> &mut [T] {
        assert!(range.start <= range.end && range.end <= self.len);
        std::slice::from_raw_parts_mut(self.ptr.add(range.start), range.end - range.start)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn members_share_work_and_meet_at_barriers() {
        for want in [1, 2, 3, 8] {
            let mut buf = vec![0usize; 1000];
            let mut sums = vec![0usize; 8];
            {
                let shared = SharedBuf::new(&mut buf);
                let sums = SharedBuf::new(&mut sums);
                let ran = run_exact(want, &|m| {
                    for round in 1..=50 {
                        let r = m.share(1000, 4);
                        // SAFETY: shares are disjoint; the barrier ends the phase.
                        unsafe { shared.part(r.clone()) }
                            .iter_mut()
                            .for_each(|v| *v += round);
                        m.barrier();
                        // SAFETY: nobody writes until after the next barrier.
                        let total: usize = unsafe { shared.get() }.iter().sum();
                        assert_eq!(total, 1000 * round * (round + 1) / 2);
                        m.barrier();
                    }
                    // SAFETY: each member writes only its own slot.
                    let slot = unsafe { sums.part(m.id..m.id + 1) };
                    slot[0] = m.n;
                });
                assert_eq!(ran, want.min(max_members()));
            }
            assert!(buf.iter().all(|&v| v == 50 * 51 / 2));
            assert!(sums[0] >= 1);
        }
    }

    #[test]
    fn pieces_cover_each_phase_once_whoever_takes_them() {
        for want in [1, 2, 3] {
            let mut hits = vec![0u32; 3 * 1000];
            {
                let shared = SharedBuf::new(&mut hits);
                run_exact(want, &|m| {
                    // Three phases of different lengths and piece sizes, each its own loop.
                    for (phase, (len, piece)) in
                        [(1000, 7), (999, 16), (5, 100)].into_iter().enumerate()
                    {
                        for r in m.chunks(len, piece) {
                            // SAFETY: each piece goes to one member.
                            let part = unsafe {
                                shared.part(phase * 1000 + r.start..phase * 1000 + r.end)
                            };
                            part.iter_mut().for_each(|v| *v += 1);
                        }
                        m.barrier();
                    }
                });
            }
            for (phase, len) in [1000, 999, 5].into_iter().enumerate() {
                let h = &hits[phase * 1000..(phase + 1) * 1000];
                assert!(
                    h[..len].iter().all(|&v| v == 1),
                    "{want} members, phase {phase}"
                );
                assert!(
                    h[len..].iter().all(|&v| v == 0),
                    "{want} members, phase {phase}"
                );
            }
        }
    }

    #[test]
    fn a_panicking_member_raises_in_the_caller() {
        let r = std::panic::catch_unwind(|| {
            run(2, &|m| {
                if m.id == m.n - 1 {
                    panic!("boom");
                }
                m.barrier();
            })
        });
        assert!(r.is_err());
        // The team still works afterwards.
        let mut hits = vec![0u8; 2];
        let s = SharedBuf::new(&mut hits);
        run(2, &|m| {
            // SAFETY: each member writes only its own slot.
            let slot = unsafe { s.part(m.id..m.id + 1) };
            slot[0] = 1;
        });
        assert_eq!(hits[0], 1);
    }
}
