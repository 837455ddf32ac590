//! Rewards from an `https://` endpoint: the same JSON protocol as [`super::http`] (the batch
//! POSTed as `application/json`, the answer `{"rewards": [...]}` or `{"error": ..., "row": ...}`)
//! over TLS, with reqwest and rustls (already in the dependency tree for the Hub).
//!
//! The server's certificate is checked against the system's trust store (rustls' platform
//! verifier, as a browser or Python's `requests` with the system's CA bundle would) and, when the
//! entry names one, the PEM certificate(s) at `ca_cert: PATH`: a service behind a private
//! authority or a self-signed certificate is trusted that way. An untrusted certificate is an
//! error that says so and names `ca_cert`.

use std::path::Path;
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use serde_json::Value;

/// An `https://` endpoint and the client that reaches it.
pub struct TlsEndpoint {
    url: String,
    client: reqwest::Client,
    runtime: tokio::runtime::Runtime,
}

impl TlsEndpoint {
    /// A client for `url` (`https://...`), trusting the system's roots and `ca_cert` (PEM).
    pub fn new(url: &str, ca_cert: Option<&Path>) -> Result<TlsEndpoint> {
        check_url(url)?;
        let mut builder = reqwest::Client::builder();
        if let Some(path) = ca_cert {
            let pem = std::fs::read(path)
                .with_context(|| format!("ca_cert: reading {}", path.display()))?;
            let certs = reqwest::Certificate::from_pem_bundle(&pem)
                .map_err(|e| anyhow!("ca_cert: {}: not a PEM certificate: {e}", path.display()))?;
            if certs.is_empty() {
                bail!("ca_cert: {}: no PEM certificate in it", path.display());
            }
            builder = builder.tls_certs_merge(certs);
        }
        let client = builder
            .build()
            .map_err(|e| anyhow!("https: cannot start the TLS client: {}", chain(&e)))?;
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .context("https: cannot start the HTTP runtime")?;
        Ok(TlsEndpoint {
            url: url.to_string(),
            client,
            runtime,
        })
    }

    /// POSTs `body` (JSON) and returns the response's JSON, all within `timeout`.
    pub fn post(&self, body: &[u8], timeout: Duration) -> Result<Value> {
        let failed = |e: reqwest::Error| {
            let msg = chain(&e);
            if e.is_timeout() {
                anyhow!(
                    "no answer within {:.3} s (the timeout)",
                    timeout.as_secs_f64()
                )
            } else if msg.contains("certificate") || msg.contains("UnknownIssuer") {
                anyhow!(
                    "the server's TLS certificate is not trusted ({msg}); if it is yours, give \
                     the certificate of its authority (PEM) as `ca_cert: PATH` in the entry"
                )
            } else {
                anyhow!("{msg}")
            }
        };
        self.runtime.block_on(async {
            let resp = self
                .client
                .post(&self.url)
                .header("content-type", "application/json")
                .header("accept", "application/json")
                .timeout(timeout)
                .body(body.to_vec())
                .send()
                .await
                .map_err(failed)?;
            let status = resp.status();
            let text = resp.text().await.map_err(failed)?;
            super::http::answer_json(status == reqwest::StatusCode::OK, &status, &text)
        })
    }
}

/// Checks that `url` is an `https://` URL with a host.
pub fn check_url(url: &str) -> Result<()> {
    let rest = url
        .strip_prefix("https://")
        .ok_or_else(|| anyhow!("https: '{url}' is not an https:// URL"))?;
    if rest
        .split(['/', ':', '?'])
        .next()
        .unwrap_or_default()
        .is_empty()
    {
        bail!("https: '{url}': no host");
    }
    Ok(())
}

/// An error and its sources, one line.
fn chain(e: &dyn std::error::Error) -> String {
    let mut msg = e.to_string();
    let mut src = e.source();
    while let Some(s) = src {
        let s = s.to_string();
        if !msg.contains(&s) {
            msg = format!("{msg}: {s}");
        }
        src = src.and_then(|x| x.source());
    }
    msg
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{BufRead, BufReader, Read, Write};
    use std::net::TcpListener;
    use std::sync::Arc;

    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};

    fn fixture(name: &str) -> std::path::PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/tls")
            .join(name)
    }

    /// A loopback HTTPS server with the fixture certificate (signed by the fixture CA) that
    /// answers each POST with the rewards `[0.5, 2.0]`, echoing nothing; returns its URL.
    fn serve() -> String {
        let certs: Vec<CertificateDer<'static>> =
            CertificateDer::pem_file_iter(fixture("server.pem"))
                .unwrap()
                .map(|c| c.unwrap())
                .collect();
        let key = PrivateKeyDer::from_pem_file(fixture("server.key")).unwrap();
        let config = Arc::new(
            rustls::ServerConfig::builder()
                .with_no_client_auth()
                .with_single_cert(certs, key)
                .unwrap(),
        );
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!(
            "https://127.0.0.1:{}/score",
            listener.local_addr().unwrap().port()
        );
        std::thread::spawn(move || {
            for tcp in listener.incoming() {
                let Ok(tcp) = tcp else { continue };
                let config = config.clone();
                std::thread::spawn(move || {
                    let conn = rustls::ServerConnection::new(config).unwrap();
                    let mut tls = BufReader::new(rustls::StreamOwned::new(conn, tcp));
                    let mut length = 0usize;
                    loop {
                        let mut line = String::new();
                        if tls.read_line(&mut line).unwrap_or(0) == 0 {
                            return; // the handshake failed (an untrusting client)
                        }
                        let line = line.trim_end().to_ascii_lowercase();
                        if line.is_empty() {
                            break;
                        }
                        if let Some(v) = line.strip_prefix("content-length:") {
                            length = v.trim().parse().unwrap();
                        }
                    }
                    let mut body = vec![0u8; length];
                    tls.read_exact(&mut body).unwrap();
                    let request: Value = serde_json::from_slice(&body).unwrap();
                    assert_eq!(request["completions"].as_array().unwrap().len(), 2);
                    let answer = br#"{"rewards": [0.5, 2.0]}"#;
                    let head = format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\
                         content-length: {}\r\nconnection: close\r\n\r\n",
                        answer.len()
                    );
                    let stream = tls.get_mut();
                    stream.write_all(head.as_bytes()).unwrap();
                    stream.write_all(answer).unwrap();
                    stream.flush().unwrap();
                    stream.conn.send_close_notify();
                    let _ = stream.flush();
                });
            }
        });
        url
    }

    /// Trusting the fixture CA through `ca_cert`, the endpoint answers; without it, the
    /// certificate is refused with an error that says so and names `ca_cert`.
    #[test]
    fn https_endpoint_trusts_ca_cert_and_refuses_an_unknown_authority() {
        let url = serve();
        let body = br#"{"completions": ["a", "b"]}"#;
        let t = Duration::from_secs(20);
        let trusted = TlsEndpoint::new(&url, Some(&fixture("ca.pem"))).unwrap();
        let answer = trusted.post(body, t).unwrap();
        assert_eq!(answer["rewards"], serde_json::json!([0.5, 2.0]));

        let untrusted = TlsEndpoint::new(&url, None).unwrap();
        let err = untrusted.post(body, t).unwrap_err().to_string();
        assert!(
            err.contains("TLS certificate is not trusted") && err.contains("ca_cert"),
            "{err}"
        );
        assert!(check_url("https://h/x").is_ok());
        assert!(check_url("https:///x").is_err());
        assert!(check_url("http://h/").is_err());
        assert!(TlsEndpoint::new(&url, Some(&fixture("README.md"))).is_err());
    }
}
