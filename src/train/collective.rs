//! How the ranks of a data-parallel run add up their gradients: the [`Collective`] trait
//! (an all-reduce sum of ranges of one flat f32 buffer, on the host or a device), and
//! [`HostCollective`], its stand-in on the host — threads meeting at a barrier, the sum
//! taken in rank order so that every run with the same ranks gives the same bits. The GPU
//! implementation over NCCL is `crate::train::cuda::nccl`.

use crate::error::{Error, Result};
use std::ops::Range;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

/// A rank's flat f32 buffer (the gradient, in `crate::train::flat::FlatLayout`).
pub enum FlatBuf<'a> {
    Host(&'a mut [f32]),
    /// `len` f32 elements at device address `ptr` on the rank's GPU; the reduction is
    /// queued on `stream` (that GPU's `CUstream`), after the work that wrote the buffer.
    Device {
        ptr: u64,
        len: usize,
        stream: *mut std::ffi::c_void,
    },
}

impl FlatBuf<'_> {
    pub fn len(&self) -> usize {
        match self {
            FlatBuf::Host(h) => h.len(),
            FlatBuf::Device { len, .. } => *len,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// One rank's end of a group of `world_size` ranks.
pub trait Collective: Send {
    fn rank(&self) -> usize;
    fn world_size(&self) -> usize;
    /// Replace each of `ranges` (element ranges) of `buf` by its sum over every rank: one
    /// bucket, reduced as one operation. Every rank calls it with the same ranges, and gets
    /// the same sums, bit for bit.
    fn all_reduce_sum(&mut self, buf: FlatBuf<'_>, ranges: &[Range<usize>]) -> Result<()>;
    /// A rank failed in the middle of a reduction: end the group, so that no rank waits
    /// for it any longer (a rank waiting, or coming later, gets an error). The group is
    /// unusable after; calling it again does nothing.
    fn abort(&mut self);
}

/// Checks every collective makes of a bucket's ranges.
pub fn check_ranges(buf_len: usize, ranges: &[Range<usize>]) -> Result<()> {
    for r in ranges {
        if r.start > r.end || r.end > buf_len {
            return Err(Error::input(format!(
                "all-reduce range {}..{} outside the buffer of {buf_len} elements",
                r.start, r.end
            )));
        }
    }
    Ok(())
}

/// What the ranks of a host group share: each rank's copy of the bucket, by rank, and
/// the meeting point where they wait for each other.
struct Shared {
    state: Mutex<Meeting>,
    met: Condvar,
}

struct Meeting {
    slots: Vec<Vec<f32>>,
    /// ranks at the meeting point now
    arrived: usize,
    /// meetings completed (a waiting rank leaves when this moves on)
    round: u64,
    /// a rank aborted the group
    aborted: bool,
}

/// The host stand-in of [`Collective`]: one per worker thread of a group made by
/// [`HostCollective::group`]. Each rank posts its bucket, waits for the others, and sums
/// the posted copies in rank order 0, 1, …, N−1 itself (every rank the same arithmetic,
/// so every rank the same bits).
pub struct HostCollective {
    rank: usize,
    world: usize,
    shared: Arc<Shared>,
}

impl HostCollective {
    /// The `n` ranks of one group (`n` ≥ 1), rank `i` at index `i`.
    pub fn group(n: usize) -> Result<Vec<HostCollective>> {
        if n == 0 {
            return Err(Error::input("a collective group needs at least one rank"));
        }
        let shared = Arc::new(Shared {
            state: Mutex::new(Meeting {
                slots: vec![Vec::new(); n],
                arrived: 0,
                round: 0,
                aborted: false,
            }),
            met: Condvar::new(),
        });
        Ok((0..n)
            .map(|rank| HostCollective {
                rank,
                world: n,
                shared: shared.clone(),
            })
            .collect())
    }

    fn lock(&self) -> Result<MutexGuard<'_, Meeting>> {
        let m = (self.shared.state.lock())
            .map_err(|_| Error::Other("a rank of the host collective panicked".into()))?;
        if m.aborted {
            return Err(aborted());
        }
        Ok(m)
    }

    /// Wait until every rank has come here (a barrier that an abort breaks).
    fn meet<'a>(&'a self, mut m: MutexGuard<'a, Meeting>) -> Result<MutexGuard<'a, Meeting>> {
        let round = m.round;
        m.arrived += 1;
        if m.arrived == self.world {
            m.arrived = 0;
            m.round += 1;
            self.shared.met.notify_all();
            return Ok(m);
        }
        while m.round == round && !m.aborted {
            m = (self.shared.met.wait(m))
                .map_err(|_| Error::Other("a rank of the host collective panicked".into()))?;
        }
        if m.round == round {
            return Err(aborted());
        }
        Ok(m)
    }
}

fn aborted() -> Error {
    Error::Other(
        "another rank of the data-parallel group failed; the reduction was abandoned".into(),
    )
}

impl Collective for HostCollective {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn all_reduce_sum(&mut self, buf: FlatBuf<'_>, ranges: &[Range<usize>]) -> Result<()> {
        let FlatBuf::Host(buf) = buf else {
            return Err(Error::input(
                "the host collective reduces host buffers; a device buffer needs NCCL",
            ));
        };
        check_ranges(buf.len(), ranges)?;
        if self.world == 1 {
            return Ok(());
        }
        let mine: Vec<f32> = ranges
            .iter()
            .flat_map(|r| &buf[r.clone()])
            .copied()
            .collect();
        let mut m = self.lock()?;
        m.slots[self.rank] = mine;
        // everyone's copy is posted
        let m = self.meet(m)?;
        let n = m.slots[0].len();
        if m.slots.iter().any(|s| s.len() != n) {
            return Err(Error::Other(
                "the ranks of a host collective reduced buckets of different sizes".into(),
            ));
        }
        let mut sum = m.slots[0].clone();
        for s in &m.slots[1..] {
            sum.iter_mut().zip(s).for_each(|(a, &b)| *a += b);
        }
        let mut it = sum.into_iter();
        for r in ranges {
            buf[r.clone()]
                .iter_mut()
                .for_each(|x| *x = it.next().expect("sized above"));
        }
        // nobody posts the next bucket before everyone has read this one
        drop(self.meet(m)?);
        Ok(())
    }

    fn abort(&mut self) {
        if let Ok(mut m) = self.shared.state.lock() {
            m.aborted = true;
        }
        self.shared.met.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_group_sums_in_rank_order_on_every_rank() {
        for n in [1, 2, 3, 4] {
            let group = HostCollective::group(n).unwrap();
            let handles: Vec<_> = group
                .into_iter()
                .map(|mut c| {
                    std::thread::spawn(move || {
                        let r = c.rank() as f32;
                        // values whose sum depends on the order: 1e8 + r·0.5 − 1e8 …
                        let mut buf: Vec<f32> = (0..10)
                            .map(|i| if r == 0.0 { 1e8 } else { r * 0.5 + i as f32 })
                            .collect();
                        c.all_reduce_sum(FlatBuf::Host(&mut buf), &[1..4, 6..10])
                            .unwrap();
                        buf
                    })
                })
                .collect();
            let out: Vec<Vec<f32>> = handles.into_iter().map(|h| h.join().unwrap()).collect();
            for i in 0..10 {
                let untouched = !(1..4).contains(&i) && !(6..10).contains(&i);
                let mut want = 1e8f32;
                if !untouched {
                    for r in 1..n {
                        want += r as f32 * 0.5 + i as f32;
                    }
                }
                for (rank, b) in out.iter().enumerate() {
                    let expect = if untouched {
                        if rank == 0 {
                            1e8
                        } else {
                            rank as f32 * 0.5 + i as f32
                        }
                    } else {
                        want
                    };
                    assert_eq!(
                        b[i].to_bits(),
                        expect.to_bits(),
                        "n {n} rank {rank} element {i}"
                    );
                }
            }
        }
    }

    #[test]
    fn an_abort_frees_the_ranks_waiting_for_a_failed_one() {
        let mut group = HostCollective::group(3).unwrap();
        let mut failed = group.pop().unwrap();
        // the buffer as two ranges
        let whole = || [0..2, 2..4];
        let waiting: Vec<_> = group
            .into_iter()
            .map(|mut c| {
                std::thread::spawn(move || {
                    let mut buf = vec![1f32; 4];
                    c.all_reduce_sum(FlatBuf::Host(&mut buf), &whole())
                })
            })
            .collect();
        // rank 2 never comes: it fails and aborts instead
        std::thread::sleep(std::time::Duration::from_millis(50));
        failed.abort();
        failed.abort();
        for h in waiting {
            let e = h.join().unwrap().unwrap_err().to_string();
            assert!(e.contains("another rank"), "{e}");
        }
        let mut buf = vec![1f32; 4];
        assert!(failed
            .all_reduce_sum(FlatBuf::Host(&mut buf), &whole())
            .is_err());
    }

    #[test]
    fn bad_ranges_and_device_buffers_are_refused() {
        let mut c = HostCollective::group(1).unwrap().pop().unwrap();
        let mut buf = vec![0f32; 4];
        let e = c
            .all_reduce_sum(FlatBuf::Host(&mut buf), &[0..1, 2..5])
            .unwrap_err();
        assert!(e.to_string().contains("outside the buffer of 4"), "{e}");
        let e = c
            .all_reduce_sum(
                FlatBuf::Device {
                    ptr: 0,
                    len: 4,
                    stream: std::ptr::null_mut(),
                },
                &[0..2, 2..4],
            )
            .unwrap_err();
        assert!(e.to_string().contains("NCCL"), "{e}");
        assert!(HostCollective::group(0).is_err());
    }
}
