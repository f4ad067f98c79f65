//! The HTTP server: OpenAI-compatible routes (completions, chat completions, embeddings,
//! models), `/health` and Prometheus `/metrics`, on axum + tokio, with continuous
//! batching and exact prefix-state reuse on one engine thread ([`scheduler`]).
//!
//! The server binds first and loads the model on the engine thread, so `/health` answers
//! 503 while the weights load and 200 once they are ready.

pub mod api;
pub mod app;
pub mod client;
pub mod dispatch;
pub mod emitter;
pub mod error;
pub mod event;
pub mod listen;
pub mod logprobs;
pub mod metrics;
pub mod prefix_cache;
mod reply;
pub mod routes;
pub mod scheduler;

use crate::engine::Device;
use crate::error::{Error, Result};
pub use app::{App, Ready, ServeConfig};
use axum::routing::{get, post};
use axum::Router;
use dispatch::{Dispatch, Replica};
use metrics::Metrics;
use prefix_cache::PrefixCache;
use scheduler::{Scheduler, Shared, Work};
use std::net::SocketAddr;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex, OnceLock};

pub fn router(app: Arc<App>) -> Router {
    let mut r = Router::new()
        .route("/v1/completions", post(routes::completions))
        .route("/v1/chat/completions", post(routes::chat))
        .route("/v1/embeddings", post(routes::embeddings))
        .route("/v1/models", get(routes::models))
        .route("/v1/models/{id}", get(routes::model))
        .route("/health", get(routes::health))
        .route("/metrics", get(routes::metrics));
    if app.cfg.debug_routes {
        r = r.route("/debug/panic", get(routes::panic_route));
    }
    r.fallback(routes::not_found)
        .method_not_allowed_fallback(routes::method_not_allowed)
        .layer(axum::middleware::from_fn_with_state(
            app.clone(),
            routes::guard,
        ))
        .layer(axum::extract::DefaultBodyLimit::max(app.cfg.max_body_bytes))
        .with_state(app)
}

/// Start replica `r`'s engine thread: it loads the model on the replica's device, marks
/// the app ready once every replica has, and serves `rx`. `on_loaded` hears the outcome
/// of the load (of every replica: called by the last one to finish, or the first to fail).
fn start_engine(
    app: Arc<App>,
    r: usize,
    rx: std::sync::mpsc::Receiver<Work>,
    cache: Arc<Mutex<PrefixCache>>,
    on_loaded: Arc<dyn Fn(std::result::Result<(), String>) + Send + Sync>,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    std::thread::Builder::new()
        .name(format!("mamba3-engine-{r}"))
        .spawn(move || {
            let cfg = &app.cfg;
            let device = cfg.replicas()[r];
            let loaded = cfg.source.load(device, cfg.dtype, cfg.tokenizer.as_deref());
            let loaded = match loaded {
                Ok(l) => l,
                Err(e) => {
                    let e = format!("{device}: {e}");
                    if app.load_error.set(e.clone()).is_ok() {
                        on_loaded(Err(e));
                    }
                    return;
                }
            };
            // On a GPU, each decode step of up to 64 sequences replays a CUDA graph of the
            // next bucket (captured here, before the server reports ready); rows of such a
            // batch are computed on their own, so the padding changes no result.
            if loaded.model.device() != Device::Cpu {
                // Eager passes (prefill turns, decode batches past the graphs) get their
                // work buffers now, at their largest.
                let s = &cfg.scheduler;
                let seqs = s.max_batch.max(1);
                if let Err(e) = loaded.model.reserve_passes(s.prefill_chunk.max(seqs), seqs) {
                    eprintln!("mamba3 serve: {device}: work buffers not reserved ({e}); they grow on demand");
                }
                for bucket in [1usize, 2, 4, 8, 16, 32, 64] {
                    if bucket > cfg.scheduler.max_batch.max(1).next_power_of_two() {
                        break;
                    }
                    if let Err(e) = loaded.model.capture_decode_graph(bucket) {
                        eprintln!("mamba3 serve: {device}: no decode graph for batch {bucket} ({e}); decoding eagerly");
                        break;
                    }
                }
            }
            let sched = Scheduler::new(
                loaded.model,
                loaded.tokenizer.clone(),
                cfg.scheduler.clone(),
                app.shared.clone(),
                app.metrics.devices[r].clone(),
                cache,
            );
            let sched = match sched {
                Ok(s) => s,
                Err(e) => {
                    let e = format!("{device}: starting the emitter thread failed: {e}");
                    if app.load_error.set(e.clone()).is_ok() {
                        on_loaded(Err(e));
                    }
                    return;
                }
            };
            if app.loading.fetch_sub(1, Relaxed) == 1 && app.load_error.get().is_none() {
                let d = sched.dims();
                let _ = app.ready.set(Ready {
                    vocab_size: d.vocab_size,
                    d_model: d.d_model,
                    max_token_bytes: loaded
                        .tokenizer
                        .as_ref()
                        .map_or(usize::MAX, |t| t.max_token_bytes()),
                    tokenizer: loaded.tokenizer.clone(),
                    chat: loaded.chat,
                });
                on_loaded(Ok(()));
            }
            drop(app);
            sched.run(rx);
        })
}

/// The app and the work queue of each replica with its prefix cache.
type Queues = Vec<(std::sync::mpsc::Receiver<Work>, Arc<Mutex<PrefixCache>>)>;

fn make_app(cfg: ServeConfig) -> (Arc<App>, Queues) {
    let devices = cfg.replicas();
    let names: Vec<String> = devices.iter().map(|d| d.to_string()).collect();
    let metrics = Arc::new(Metrics::for_devices(&names));
    let mut replicas = Vec::new();
    let mut queues = Vec::new();
    for r in 0..devices.len() {
        let (tx, rx) = std::sync::mpsc::channel();
        let cache = Arc::new(Mutex::new(PrefixCache::new(cfg.scheduler.cache_bytes)));
        replicas.push(Replica {
            work: tx,
            cache: cache.clone(),
            metrics: metrics.devices[r].clone(),
        });
        queues.push((rx, cache));
    }
    let name = cfg.model_name.clone().unwrap_or_else(|| cfg.source.name());
    let app = Arc::new(App {
        name,
        created: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
        shared: Arc::new(Shared {
            metrics: metrics.clone(),
            queued: Default::default(),
        }),
        metrics,
        work: Dispatch::new(replicas, cfg.scheduler.branch_min_tokens),
        ready: OnceLock::new(),
        load_error: OnceLock::new(),
        loading: devices.len().into(),
        cfg,
    });
    (app, queues)
}

/// Start every replica's engine thread.
fn start_engines(
    app: &Arc<App>,
    queues: Queues,
    on_loaded: impl Fn(std::result::Result<(), String>) + Send + Sync + 'static,
) -> Result<()> {
    let on_loaded: Arc<dyn Fn(std::result::Result<(), String>) + Send + Sync> = Arc::new(on_loaded);
    for (r, (rx, cache)) in queues.into_iter().enumerate() {
        start_engine(app.clone(), r, rx, cache, on_loaded.clone())
            .map_err(|e| Error::Other(format!("starting the engine thread failed: {e}")))?;
    }
    Ok(())
}

/// A server running on a background thread (tests, benchmarks).
pub struct ServerHandle {
    pub addr: SocketAddr,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl ServerHandle {
    /// Stop accepting connections and wait for the server thread.
    pub fn stop(mut self) {
        self.stop_inner();
    }
    fn stop_inner(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for ServerHandle {
    fn drop(&mut self) {
        self.stop_inner();
    }
}

/// The async runtime of the HTTP side. Every streamed token costs it a JSON chunk and a
/// socket write per client; on the CPU two workers leave the cores to the model, on a GPU
/// the cores are free and many clients need more.
fn runtime(device: Device) -> Result<tokio::runtime::Runtime> {
    let workers = match device {
        Device::Cpu => 2,
        Device::Cuda(_) => std::thread::available_parallelism()
            .map_or(2, |n| n.get() / 4)
            .clamp(2, 8),
    };
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        .enable_all()
        .build()
        .map_err(|e| Error::Other(format!("starting the async runtime failed: {e}")))
}

/// Bind `cfg.addr` (port 0 picks a free one) and serve on a background thread.
pub fn spawn(cfg: ServeConfig) -> Result<ServerHandle> {
    let rt = runtime(cfg.replicas()[0])?;
    let listener = rt
        .block_on(tokio::net::TcpListener::bind(cfg.addr))
        .map_err(|e| Error::Other(format!("cannot listen on {}: {e}", cfg.addr)))?;
    let addr = listener
        .local_addr()
        .map_err(|e| Error::Other(e.to_string()))?;
    let (app, queues) = make_app(cfg);
    start_engines(&app, queues, |_| {})?;
    let (tx, stop) = tokio::sync::oneshot::channel::<()>();
    let thread = std::thread::Builder::new()
        .name("mamba3-http".into())
        .spawn(move || {
            rt.block_on(async move {
                let (timeouts, work) = (app.cfg.timeouts, app.work.clone());
                listen::serve(listener, router(app), timeouts, work, async move {
                    let _ = stop.await;
                })
                .await;
            });
        })
        .map_err(|e| Error::Other(format!("starting the server thread failed: {e}")))?;
    Ok(ServerHandle {
        addr,
        shutdown: Some(tx),
        thread: Some(thread),
    })
}

/// Serve in the foreground until Ctrl-C (the `mamba3 serve` command). Fails if the
/// address cannot be bound or the model cannot be loaded.
pub fn run(cfg: ServeConfig) -> Result<()> {
    let rt = runtime(cfg.replicas()[0])?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind(cfg.addr)
            .await
            .map_err(|e| Error::Other(format!("cannot listen on {}: {e}", cfg.addr)))?;
        let addr = listener
            .local_addr()
            .map_err(|e| Error::Other(e.to_string()))?;
        let (app, queues) = make_app(cfg);
        let (load_tx, load_rx) = tokio::sync::oneshot::channel();
        let load_tx = Mutex::new(Some(load_tx));
        let name = app.name.clone();
        start_engines(&app, queues, move |r| {
            if let Some(tx) = load_tx.lock().ok().and_then(|mut t| t.take()) {
                let _ = tx.send(r);
            }
        })?;
        let on: Vec<String> = app.cfg.replicas().iter().map(|d| d.to_string()).collect();
        eprintln!(
            "mamba3 serve: listening on http://{addr} (model `{name}` loading on {})",
            on.join(", ")
        );
        let (timeouts, work) = (app.cfg.timeouts, app.work.clone());
        let server = listen::serve(listener, router(app), timeouts, work, async move {
            shutdown_signal().await;
            eprintln!(
                "mamba3 serve: shutting down (no new connections; running requests have {} s)",
                timeouts.shutdown_grace.as_secs_f64()
            );
        });
        let server = tokio::spawn(server);
        match load_rx.await {
            Ok(Ok(())) => eprintln!("mamba3 serve: model ready"),
            Ok(Err(e)) => return Err(Error::Other(format!("loading the model failed: {e}"))),
            Err(_) => {
                return Err(Error::Other(
                    "the engine thread stopped while loading".into(),
                ))
            }
        }
        server
            .await
            .map_err(|e| Error::Other(format!("server task failed: {e}")))?;
        eprintln!("mamba3 serve: stopped");
        Ok(())
    })
}

/// Ctrl-C or SIGTERM (what service managers and `kill` send).
async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    match signal(SignalKind::terminate()) {
        Ok(mut term) => {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
        }
        Err(_) => {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}
