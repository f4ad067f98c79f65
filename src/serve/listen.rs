//! The accept loop: HTTP/1 connections served by hyper with a header read time-out (a
//! client that sends half a request head is dropped instead of holding a connection
//! forever), and a graceful shutdown: stop accepting, let the connections in flight
//! finish, and after a grace period ask the engine to end the streams still running.

use super::scheduler::Work;
use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use std::future::Future;
use std::time::Duration;
use tokio::net::TcpListener;

/// Time limits of a connection.
#[derive(Clone, Copy, Debug)]
pub struct Timeouts {
    /// From the connection's first byte (or the previous response) to the end of the
    /// request head.
    pub header: Duration,
    /// Reading the request body, once the head is in.
    pub body: Duration,
    /// After a shutdown signal, how long running requests may go on before the engine
    /// ends them (`finish_reason` "abort", then `[DONE]`).
    pub shutdown_grace: Duration,
}

impl Default for Timeouts {
    fn default() -> Self {
        Timeouts {
            header: Duration::from_secs(10),
            body: Duration::from_secs(30),
            shutdown_grace: Duration::from_secs(30),
        }
    }
}

/// Serve `router` on `listener` until `shutdown` resolves; then stop accepting (the
/// listening socket is closed), wait for the open connections, and after
/// `timeouts.shutdown_grace` tell the engine (through `work`) to end what still runs.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    timeouts: Timeouts,
    work: super::dispatch::Dispatch,
    shutdown: impl Future<Output = ()>,
) {
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(timeouts.header);
    let graceful = GracefulShutdown::new();
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let tcp = match accepted {
                    Ok((tcp, _)) => tcp,
                    // Out of file descriptors and the like: wait a moment rather than spin.
                    Err(_) => {
                        tokio::time::sleep(Duration::from_millis(20)).await;
                        continue;
                    }
                };
                // Streamed tokens are small writes: send each at once (no Nagle delay).
                let _ = tcp.set_nodelay(true);
                let svc = TowerToHyperService::new(router.clone());
                let conn = graceful.watch(http.serve_connection(TokioIo::new(tcp), svc));
                tokio::spawn(async move {
                    let _ = conn.await;
                });
            }
            _ = &mut shutdown => break,
        }
    }
    drop(listener);
    // Past the grace period the engine ends every sequence; their streams then close
    // with a finish reason and `[DONE]`, and the connections end.
    let ender = tokio::spawn(async move {
        tokio::time::sleep(timeouts.shutdown_grace).await;
        let _ = work.send(Work::Shutdown);
    });
    // A connection that outlives the grace period by far (a client that reads nothing)
    // does not keep the process alive.
    let limit = timeouts.shutdown_grace + Duration::from_secs(10);
    let _ = tokio::time::timeout(limit, graceful.shutdown()).await;
    ender.abort();
}
