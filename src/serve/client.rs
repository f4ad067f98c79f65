//! A small blocking HTTP/1.1 client for loopback: enough to drive the server in tests and
//! benchmarks (JSON requests, chunked responses, server-sent events) without pulling in an
//! HTTP client stack. One connection per request (`Connection: close`).

use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

#[derive(Debug, Clone)]
pub struct Response {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Response {
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or(serde_json::Value::Null)
    }
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// The body of a response as it arrives: plain, sized, or chunked.
enum Body {
    Chunked { left: usize, done: bool },
    Sized(usize),
    ToEnd,
}

pub struct BodyReader {
    r: BufReader<TcpStream>,
    body: Body,
}

impl Read for BodyReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match &mut self.body {
            Body::ToEnd => self.r.read(buf),
            Body::Sized(left) => {
                if *left == 0 {
                    return Ok(0);
                }
                let n = (*left).min(buf.len());
                let got = self.r.read(&mut buf[..n])?;
                *left -= got;
                Ok(got)
            }
            Body::Chunked { left, done } => {
                if *done {
                    return Ok(0);
                }
                if *left == 0 {
                    let mut line = String::new();
                    self.r.read_line(&mut line)?;
                    let size =
                        usize::from_str_radix(line.trim().split(';').next().unwrap_or(""), 16)
                            .map_err(|_| {
                                io::Error::new(
                                    io::ErrorKind::InvalidData,
                                    format!("bad chunk size {line:?}"),
                                )
                            })?;
                    if size == 0 {
                        *done = true;
                        // Trailers end with an empty line.
                        loop {
                            let mut t = String::new();
                            if self.r.read_line(&mut t)? == 0 || t.trim().is_empty() {
                                break;
                            }
                        }
                        return Ok(0);
                    }
                    *left = size;
                }
                let n = (*left).min(buf.len());
                let got = self.r.read(&mut buf[..n])?;
                if got == 0 {
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "connection closed inside a chunk",
                    ));
                }
                *left -= got;
                if *left == 0 {
                    let mut crlf = String::new();
                    self.r.read_line(&mut crlf)?;
                }
                Ok(got)
            }
        }
    }
}

/// Status, headers, and the body still to read.
pub type Head = (u16, Vec<(String, String)>, BodyReader);

/// Send a request and read the status line and headers; the body is left to read.
pub fn send(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&[u8]>,
) -> io::Result<Head> {
    let mut s = TcpStream::connect(addr)?;
    s.set_read_timeout(Some(Duration::from_secs(300)))?;
    s.set_nodelay(true)?;
    let mut req = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    if let Some(b) = body {
        if !headers
            .iter()
            .any(|(k, _)| k.eq_ignore_ascii_case("content-type"))
        {
            req.push_str("Content-Type: application/json\r\n");
        }
        req.push_str(&format!("Content-Length: {}\r\n", b.len()));
    }
    req.push_str("\r\n");
    let mut bytes = req.into_bytes();
    if let Some(b) = body {
        bytes.extend_from_slice(b);
    }
    s.write_all(&bytes)?;
    let mut r = BufReader::new(s);
    let mut line = String::new();
    r.read_line(&mut line)?;
    let status: u16 = line
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!("bad status line {line:?}"),
            )
        })?;
    let mut hdrs = Vec::new();
    loop {
        let mut h = String::new();
        if r.read_line(&mut h)? == 0 || h.trim().is_empty() {
            break;
        }
        if let Some((k, v)) = h.split_once(':') {
            hdrs.push((k.trim().to_string(), v.trim().to_string()));
        }
    }
    let get = |n: &str| {
        hdrs.iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(n))
            .map(|(_, v)| v.clone())
    };
    let body =
        if get("transfer-encoding").is_some_and(|v| v.to_ascii_lowercase().contains("chunked")) {
            Body::Chunked {
                left: 0,
                done: false,
            }
        } else if let Some(n) = get("content-length").and_then(|v| v.parse().ok()) {
            Body::Sized(n)
        } else {
            Body::ToEnd
        };
    Ok((status, hdrs, BodyReader { r, body }))
}

/// A whole request and response.
pub fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&[u8]>,
) -> io::Result<Response> {
    let (status, headers, mut r) = send(addr, method, path, headers, body)?;
    let mut body = Vec::new();
    r.read_to_end(&mut body)?;
    Ok(Response {
        status,
        headers,
        body,
    })
}

pub fn get(addr: SocketAddr, path: &str) -> io::Result<Response> {
    request(addr, "GET", path, &[], None)
}

pub fn post_json(addr: SocketAddr, path: &str, body: &serde_json::Value) -> io::Result<Response> {
    request(addr, "POST", path, &[], Some(body.to_string().as_bytes()))
}

/// Server-sent events of a streaming response, one `data:` payload at a time.
pub struct Events {
    pub status: u16,
    r: BufReader<BodyReader>,
}

impl Events {
    /// The next event's data (`None` at the end of the stream).
    pub fn next_data(&mut self) -> io::Result<Option<String>> {
        let mut data: Option<String> = None;
        loop {
            let mut line = String::new();
            if self.r.read_line(&mut line)? == 0 {
                return Ok(data);
            }
            let l = line.trim_end_matches(['\r', '\n']);
            if l.is_empty() {
                if data.is_some() {
                    return Ok(data);
                }
                continue;
            }
            if let Some(d) = l.strip_prefix("data:") {
                let d = d.strip_prefix(' ').unwrap_or(d);
                match &mut data {
                    Some(acc) => {
                        acc.push('\n');
                        acc.push_str(d);
                    }
                    None => data = Some(d.to_string()),
                }
            }
        }
    }

    /// Read the body that is left (the error body of a refused request).
    pub fn rest(mut self) -> String {
        let mut s = String::new();
        let _ = self.r.read_to_string(&mut s);
        s
    }
}

/// POST a JSON body and read the answer as server-sent events.
pub fn stream(
    addr: SocketAddr,
    path: &str,
    headers: &[(&str, &str)],
    body: &serde_json::Value,
) -> io::Result<Events> {
    stream_bytes(addr, path, headers, body.to_string().as_bytes())
}

/// [`stream`] with the JSON body already written.
pub fn stream_bytes(
    addr: SocketAddr,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> io::Result<Events> {
    let (status, _, r) = send(addr, "POST", path, headers, Some(body))?;
    Ok(Events {
        status,
        r: BufReader::new(r),
    })
}
