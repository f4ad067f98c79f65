//! The [`Collective`] of several GPUs of one host: NCCL communicators through `cudarc`'s
//! `nccl` bindings, loaded at run time — a build never needs NCCL, and a run needs it only
//! when it asks for data-parallel training on GPUs.
//!
//! `cudarc` looks for the library under the names of `cudarc::get_lib_name_candidates`
//! (`libnccl.so`, `libnccl.so.13`, `.12`, … `.1`), which leave out NCCL's own soname
//! `libnccl.so.2`: a folder on `LD_LIBRARY_PATH` must hold a `libnccl.so` (a link to
//! `libnccl.so.2`, e.g. PyTorch's `nvidia/nccl/lib/libnccl.so.2`; the README says how).

use crate::error::{Error, Result};
use crate::train::collective::{check_ranges, Collective, FlatBuf};
use cudarc::nccl::{result, sys};
use std::ops::Range;

/// One rank's communicator, on the GPU of its rank.
pub struct NcclCollective {
    comm: sys::ncclComm_t,
    rank: usize,
    world: usize,
    /// `ncclCommAbort` ended the communicator (a rank failed mid-reduction)
    aborted: bool,
}

// A communicator is used by one thread at a time: the worker thread it is handed to.
unsafe impl Send for NcclCollective {}

fn nccl_err(what: &str, e: result::NcclError) -> Error {
    Error::Device(format!("NCCL {what}: {e:?}"))
}

/// NCCL is loadable, or the error that says how to make it so.
pub fn check_nccl_present() -> Result<()> {
    if unsafe { sys::is_culib_present() } {
        return Ok(());
    }
    let names = cudarc::get_lib_name_candidates("nccl");
    Err(Error::Device(format!(
        "data-parallel training on GPUs needs NCCL, and no library of the names {} loads. \
         NCCL installs itself as libnccl.so.2 (PyTorch's copy: python3 -c \"import nvidia.nccl, \
         os; print(os.path.dirname(nvidia.nccl.__file__))\" → lib/libnccl.so.2); link it as \
         libnccl.so in a folder on LD_LIBRARY_PATH: mkdir -p ~/.cache/mamba3/nccl && ln -sf \
         DIR/libnccl.so.2 ~/.cache/mamba3/nccl/libnccl.so && export \
         LD_LIBRARY_PATH=~/.cache/mamba3/nccl:$LD_LIBRARY_PATH",
        names.join(", ")
    )))
}

impl NcclCollective {
    /// One communicator per GPU of `ordinals`, rank `i` on `ordinals[i]` (all made here,
    /// by `ncclCommInitAll`, then handed to the ranks' threads). Every ordinal once.
    pub fn group(ordinals: &[usize]) -> Result<Vec<NcclCollective>> {
        if ordinals.is_empty() {
            return Err(Error::input("a collective group needs at least one GPU"));
        }
        check_nccl_present()?;
        crate::options::nccl_without_nvlink_multicast();
        let devs: Vec<i32> = ordinals.iter().map(|&o| o as i32).collect();
        let mut comms: Vec<sys::ncclComm_t> = vec![std::ptr::null_mut(); devs.len()];
        unsafe { result::comm_init_all(comms.as_mut_ptr(), devs.len() as i32, devs.as_ptr()) }
            .map_err(|e| nccl_err("creating the communicators", e))?;
        let world = comms.len();
        Ok(comms
            .into_iter()
            .enumerate()
            .map(|(rank, comm)| NcclCollective {
                comm,
                rank,
                world,
                aborted: false,
            })
            .collect())
    }
}

impl Collective for NcclCollective {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    /// The bucket's ranges in place, one grouped `ncclAllReduce` each, queued on the
    /// rank's stream.
    fn all_reduce_sum(&mut self, buf: FlatBuf<'_>, ranges: &[Range<usize>]) -> Result<()> {
        let FlatBuf::Device { ptr, len, stream } = buf else {
            return Err(Error::input("NCCL reduces device buffers, not host ones"));
        };
        check_ranges(len, ranges)?;
        if self.aborted {
            return Err(Error::Device(
                "NCCL: the group was aborted after a rank failed".into(),
            ));
        }
        result::group_start().map_err(|e| nccl_err("group start", e))?;
        let mut failed = None;
        for r in ranges.iter().filter(|r| !r.is_empty()) {
            let at = (ptr + 4 * r.start as u64) as *mut std::ffi::c_void;
            let res = unsafe {
                result::all_reduce(
                    at,
                    at,
                    r.len(),
                    sys::ncclDataType_t::ncclFloat32,
                    sys::ncclRedOp_t::ncclSum,
                    self.comm,
                    stream as sys::cudaStream_t,
                )
            };
            if let Err(e) = res {
                failed = Some(e);
                break;
            }
        }
        // the group is closed whether or not every call went in
        let end = result::group_end();
        if let Some(e) = failed {
            return Err(nccl_err("all-reduce", e));
        }
        end.map_err(|e| nccl_err("group end", e))?;
        Ok(())
    }

    /// `ncclCommAbort`: the all-reduces this rank queued stop waiting for their peers.
    fn abort(&mut self) {
        if !self.aborted {
            self.aborted = true;
            unsafe {
                let _ = result::comm_abort(self.comm);
            }
        }
    }
}

impl Drop for NcclCollective {
    fn drop(&mut self) {
        if !self.aborted {
            unsafe {
                let _ = result::comm_destroy(self.comm);
            }
        }
    }
}
