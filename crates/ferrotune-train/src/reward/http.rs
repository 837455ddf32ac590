//! Rewards from an HTTP endpoint: each batch is POSTed as the worker's JSON request
//! (`Content-Type: application/json`), and the response body is the worker's answer
//! (`{"rewards": [...]}`, or `{"error": ..., "row": ...}`). `http://` here (HTTP/1.1, one
//! connection a request; a `Content-Length` or chunked body); `https://` through
//! [`super::https`] (reqwest and rustls), with the same messages.

use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use serde_json::Value;

use super::{read_answer, RewardBatch, RewardFn};

/// An `http://host[:port]/path` URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    /// Host name or address.
    pub host: String,
    /// Port (80 unless given).
    pub port: u16,
    /// Path and query, `/` at least.
    pub path: String,
}

impl Endpoint {
    /// Parses `url`.
    pub fn parse(url: &str) -> Result<Endpoint> {
        let Some(rest) = url.strip_prefix("http://") else {
            bail!("http: '{url}': only http:// and https:// URLs are served");
        };
        let (authority, path) = match rest.find('/') {
            Some(i) => (&rest[..i], &rest[i..]),
            None => (rest, "/"),
        };
        let (host, port) = match authority.rsplit_once(':') {
            Some((h, p)) => (
                h,
                p.parse::<u16>()
                    .map_err(|_| anyhow!("http: '{url}': bad port '{p}'"))?,
            ),
            None => (authority, 80),
        };
        if host.is_empty() {
            bail!("http: '{url}': no host");
        }
        Ok(Endpoint {
            host: host.to_string(),
            port,
            path: path.to_string(),
        })
    }

    /// POSTs `body` (JSON) and returns the response's JSON, all within `timeout`.
    pub fn post(&self, body: &[u8], timeout: Duration) -> Result<Value> {
        let start = Instant::now();
        let addr = (self.host.as_str(), self.port)
            .to_socket_addrs()
            .with_context(|| format!("resolving {}", self.host))?
            .next()
            .ok_or_else(|| anyhow!("{} resolves to no address", self.host))?;
        let mut stream = TcpStream::connect_timeout(&addr, timeout)
            .with_context(|| format!("connecting to {}:{}", self.host, self.port))?;
        let left = |what: &str| -> Result<Duration> {
            timeout
                .checked_sub(start.elapsed())
                .filter(|d| !d.is_zero())
                .ok_or_else(|| {
                    anyhow!(
                        "no answer within {:.3} s (the timeout) {what}",
                        timeout.as_secs_f64()
                    )
                })
        };
        stream.set_write_timeout(Some(left("sending")?))?;
        let head = format!(
            "POST {} HTTP/1.1\r\nHost: {}:{}\r\nContent-Type: application/json\r\n\
             Accept: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
            self.path,
            self.host,
            self.port,
            body.len()
        );
        stream.write_all(head.as_bytes())?;
        stream.write_all(body)?;
        stream.flush()?;
        let mut raw = Vec::new();
        let mut buf = [0u8; 16384];
        loop {
            stream.set_read_timeout(Some(left("reading")?))?;
            match stream.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => raw.extend_from_slice(&buf[..n]),
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) =>
                {
                    bail!(
                        "no answer within {:.3} s (the timeout)",
                        timeout.as_secs_f64()
                    )
                }
                Err(e) => return Err(e.into()),
            }
        }
        let split = raw
            .windows(4)
            .position(|w| w == b"\r\n\r\n")
            .ok_or_else(|| anyhow!("the response has no header end"))?;
        let head = String::from_utf8_lossy(&raw[..split]).to_string();
        let mut body = raw[split + 4..].to_vec();
        let status = head.lines().next().unwrap_or_default().to_string();
        let code = status.split_whitespace().nth(1).unwrap_or_default();
        let chunked = head.lines().any(|l| {
            let l = l.to_ascii_lowercase();
            l.starts_with("transfer-encoding:") && l.contains("chunked")
        });
        if chunked {
            body = dechunk(&body)?;
        }
        answer_json(code == "200", &status, &String::from_utf8_lossy(&body))
    }
}

/// An endpoint's answer, `http://` or `https://`: its JSON when the status (`status`, as
/// named in the error) is 200 (`ok`), else an error quoting the start of the body.
pub(super) fn answer_json(ok: bool, status: &dyn std::fmt::Display, text: &str) -> Result<Value> {
    if !ok {
        bail!(
            "HTTP {status}: {}",
            text.chars().take(500).collect::<String>()
        );
    }
    serde_json::from_str(text).map_err(|e| {
        anyhow!(
            "the response is not JSON ({e}): {}",
            text.chars().take(200).collect::<String>()
        )
    })
}

/// A chunked body's data.
fn dechunk(mut raw: &[u8]) -> Result<Vec<u8>> {
    let mut out = Vec::new();
    loop {
        let eol = raw
            .windows(2)
            .position(|w| w == b"\r\n")
            .ok_or_else(|| anyhow!("a chunked response cut short"))?;
        let size_text = String::from_utf8_lossy(&raw[..eol]);
        let size = usize::from_str_radix(size_text.split(';').next().unwrap_or("").trim(), 16)
            .map_err(|_| anyhow!("a bad chunk size '{size_text}'"))?;
        raw = &raw[eol + 2..];
        if size == 0 {
            return Ok(out);
        }
        if raw.len() < size {
            bail!("a chunked response cut short");
        }
        out.extend_from_slice(&raw[..size]);
        raw = raw.get(size + 2..).unwrap_or_default();
    }
}

/// How an endpoint is reached.
enum Transport {
    Plain(Endpoint),
    Tls(super::https::TlsEndpoint),
}

/// An endpoint as a reward function.
pub struct HttpReward {
    endpoint: Transport,
    url: String,
    name: String,
    timeout: Duration,
    conversational: bool,
    group: usize,
}

impl HttpReward {
    /// The endpoint at `url`, logged as `name`; an `https://` one also trusts `ca_cert`.
    pub fn new(
        url: &str,
        name: String,
        (timeout, ca_cert): (Duration, Option<&std::path::Path>),
        conversational: bool,
        group: usize,
    ) -> Result<Self> {
        let endpoint = match url.starts_with("https://") {
            true => Transport::Tls(super::https::TlsEndpoint::new(url, ca_cert)?),
            false if ca_cert.is_some() => bail!("http: '{url}': ca_cert is for https:// URLs"),
            false => Transport::Plain(Endpoint::parse(url)?),
        };
        Ok(HttpReward {
            endpoint,
            url: url.to_string(),
            name,
            timeout,
            conversational,
            group,
        })
    }
}

impl RewardFn for HttpReward {
    fn name(&self) -> &str {
        &self.name
    }

    fn score(&mut self, batch: &RewardBatch) -> Result<Vec<f32>> {
        let request = batch.request(&self.name, self.conversational);
        let body = serde_json::to_vec(&request)?;
        let answer = match &self.endpoint {
            Transport::Plain(e) => e.post(&body, self.timeout),
            Transport::Tls(e) => e.post(&body, self.timeout),
        }
        .map_err(|e| {
            anyhow!(
                "reward function '{}' ({}) on a batch of {} completions: {e}",
                self.name,
                self.url,
                batch.len()
            )
        })?;
        read_answer(&answer, &self.name, batch, self.group)
            .map_err(|e| anyhow!("{e} ({})", self.url))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_and_chunks() {
        let e = Endpoint::parse("http://127.0.0.1:8123/score?x=1").unwrap();
        assert_eq!(
            (e.host.as_str(), e.port, e.path.as_str()),
            ("127.0.0.1", 8123, "/score?x=1")
        );
        assert_eq!(Endpoint::parse("http://h").unwrap().path, "/");
        assert!(Endpoint::parse("https://h/").is_err());
        assert!(Endpoint::parse("http://h:x/").is_err());
        assert_eq!(
            dechunk(b"3\r\nabc\r\n2;x\r\nde\r\n0\r\n\r\n").unwrap(),
            b"abcde"
        );
    }
}
