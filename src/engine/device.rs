//! Where a model runs.

use crate::error::{Error, Result};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Device {
    Cpu,
    /// An NVIDIA GPU by ordinal.
    Cuda(usize),
}

/// What the user asked for on the command line: a device, or "whatever is best here".
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceChoice {
    Auto,
    Exact(Device),
}

impl DeviceChoice {
    /// CUDA device 0 when one is present (and the build has CUDA support), else the CPU.
    pub fn resolve(self) -> Device {
        match self {
            DeviceChoice::Exact(d) => d,
            DeviceChoice::Auto => {
                if crate::engine::cuda_device_count() > 0 {
                    Device::Cuda(0)
                } else {
                    Device::Cpu
                }
            }
        }
    }
}

impl std::str::FromStr for DeviceChoice {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        let s = s.trim().to_ascii_lowercase();
        match s.as_str() {
            "auto" => Ok(DeviceChoice::Auto),
            "cpu" => Ok(DeviceChoice::Exact(Device::Cpu)),
            "cuda" | "gpu" => Ok(DeviceChoice::Exact(Device::Cuda(0))),
            _ => match s.strip_prefix("cuda:").map(str::parse::<usize>) {
                Some(Ok(n)) => Ok(DeviceChoice::Exact(Device::Cuda(n))),
                _ => Err(Error::input(format!(
                    "unknown device `{s}`: expected cpu, cuda, cuda:N or auto"
                ))),
            },
        }
    }
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}
