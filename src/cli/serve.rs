//! `mamba3 serve`: the OpenAI-compatible HTTP server (see [`crate::serve`]).

use super::{PathArg, RunOpts};
use crate::engine::{Device, DeviceChoice};
use crate::error::{Error, Result};
use crate::serve::scheduler::SchedulerConfig;
use crate::serve::ServeConfig;
use crate::text::ModelSource;
use std::net::SocketAddr;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Model directory (config.json, weights, tokenizer.json, tokenizer_config.json).
    #[arg(long)]
    pub model: Option<PathArg>,
    /// tokenizer.json to use instead of the model directory's.
    #[arg(long)]
    pub tokenizer: Option<PathArg>,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Require `Authorization: Bearer KEY` on /v1/*.
    #[arg(long)]
    pub api_key: Option<String>,
    /// The model name clients send (default: the model directory's name).
    #[arg(long)]
    pub model_name: Option<String>,
    /// Serve from several devices, one model replica on each: `cuda:0,cuda:1`, `all` (every
    /// GPU), or `cpu,cpu` (for tests). A prompt goes where its cached prefix is, else to
    /// the least loaded replica. Overrides --device.
    #[arg(long)]
    pub devices: Option<String>,
    /// Sequences decoded together at most (per replica).
    #[arg(long, default_value_t = 64)]
    pub max_batch: usize,
    /// Sequences waiting for a slot at most; past it requests get 429.
    #[arg(long, default_value_t = 256)]
    pub max_queue: usize,
    /// Prompt tokens prefilled per scheduler turn (between two decode steps): a running
    /// stream waits at most one such chunk's prefill for its next token.
    #[arg(long, default_value_t = 512)]
    pub prefill_chunk: usize,
    /// Prefix-state cache budget in MiB (0 disables it).
    #[arg(long, default_value_t = 1024)]
    pub cache_mib: usize,
    /// Tokens one request may generate at most.
    #[arg(long, default_value_t = 4096)]
    pub max_tokens_limit: usize,
    /// Tokens a prompt may have at most.
    #[arg(long, default_value_t = 131072)]
    pub max_prompt_tokens: usize,
    /// On SIGTERM or Ctrl-C: seconds running requests may go on before they are ended
    /// (`finish_reason` "abort", then `[DONE]`).
    #[arg(long, default_value_t = 30.0)]
    pub shutdown_grace: f64,
    #[command(flatten)]
    pub run: RunOpts,
}

impl Args {
    pub fn config(&self) -> Result<ServeConfig> {
        let source = ModelSource::resolve(self.model.as_deref())?;
        let ip: std::net::IpAddr = self.host.parse().map_err(|_| {
            Error::input(format!(
                "--host {}: expected an IP address such as 127.0.0.1",
                self.host
            ))
        })?;
        let mut cfg = ServeConfig::new(source);
        cfg.tokenizer = self.tokenizer.clone();
        cfg.device = self.run.device.resolve();
        if let Some(list) = &self.devices {
            cfg.devices = parse_devices(list, crate::engine::cuda_device_count())?;
            cfg.device = cfg.devices[0];
        }
        cfg.dtype = self.run.dtype;
        cfg.addr = SocketAddr::new(ip, self.port);
        cfg.api_key = self.api_key.clone().filter(|k| !k.is_empty());
        cfg.model_name = self.model_name.clone();
        cfg.max_queue = self.max_queue;
        cfg.max_tokens_limit = self.max_tokens_limit.max(1);
        cfg.max_prompt_tokens = self.max_prompt_tokens.max(1);
        if !(self.shutdown_grace.is_finite() && self.shutdown_grace >= 0.0) {
            return Err(Error::input(format!(
                "--shutdown-grace {}: expected a number of seconds, 0 or more",
                self.shutdown_grace
            )));
        }
        cfg.timeouts.shutdown_grace =
            std::time::Duration::from_secs_f64(self.shutdown_grace.min(86_400.0));
        cfg.scheduler = SchedulerConfig {
            max_batch: self.max_batch.max(1),
            prefill_chunk: self.prefill_chunk.max(1),
            cache_bytes: self.cache_mib << 20,
            ..SchedulerConfig::default()
        };
        Ok(cfg)
    }
}

/// `--devices`: a comma-separated list of cpu, cuda, cuda:N, or `all` (the `cuda_count`
/// GPUs of this machine). A GPU may be named once; `cpu` any number of times.
pub fn parse_devices(list: &str, cuda_count: usize) -> Result<Vec<Device>> {
    if list.trim().eq_ignore_ascii_case("all") {
        if cuda_count == 0 {
            return Err(Error::input(
                "--devices all: this machine (or build) has no CUDA device; name them (cpu,cpu)",
            ));
        }
        return Ok((0..cuda_count).map(Device::Cuda).collect());
    }
    let mut out = Vec::new();
    for item in list.split(',') {
        let d = match item.trim().parse::<DeviceChoice>() {
            Ok(DeviceChoice::Exact(d)) => d,
            Ok(DeviceChoice::Auto) => {
                return Err(Error::input(format!(
                    "--devices {list}: `auto` is not a device here; expected cpu, cuda:N or all"
                )))
            }
            Err(_) => {
                return Err(Error::input(format!(
                    "--devices {list}: `{}` is not a device; expected a comma-separated list \
                     of cpu, cuda:N, or all",
                    item.trim()
                )))
            }
        };
        if let Device::Cuda(n) = d {
            if out.contains(&d) {
                return Err(Error::input(format!(
                    "--devices {list}: cuda:{n} is named twice (one replica per GPU)"
                )));
            }
            if n >= cuda_count {
                return Err(Error::input(format!(
                    "--devices {list}: cuda:{n} does not exist ({cuda_count} CUDA devices here)"
                )));
            }
        }
        out.push(d);
    }
    Ok(out)
}

pub fn run(a: Args) -> Result<()> {
    a.run.init_threads();
    crate::serve::run(a.config()?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_lists_parse_or_say_what_was_expected() {
        assert_eq!(parse_devices("cpu,cpu", 0).unwrap(), vec![Device::Cpu; 2]);
        assert_eq!(
            parse_devices("cuda:1, cuda:0", 2).unwrap(),
            vec![Device::Cuda(1), Device::Cuda(0)]
        );
        assert_eq!(
            parse_devices("ALL", 3).unwrap(),
            vec![Device::Cuda(0), Device::Cuda(1), Device::Cuda(2)]
        );
        let err = |s: &str, n| parse_devices(s, n).unwrap_err().to_string();
        assert!(
            err("all", 0).contains("no CUDA device"),
            "{}",
            err("all", 0)
        );
        assert!(err("cuda:0,cuda:0", 2).contains("named twice"));
        assert!(err("cuda:2", 2).contains("does not exist (2 CUDA devices"));
        let e = err("cpu,tpu", 0);
        assert!(
            e.contains("`tpu` is not a device") && e.contains("cpu, cuda:N"),
            "{e}"
        );
        assert!(err("", 0).contains("is not a device"));
        assert!(err("auto", 1).contains("`auto` is not a device here"));
    }
}
