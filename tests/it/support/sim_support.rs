//! Tiny HTTP/1 client helpers shared by the simulator's integration tests.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::Request;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

/// Status, content type (without parameters) and body of an answer.
#[derive(Debug, Clone)]
pub struct Answer {
    pub status: u16,
    pub content_type: String,
    pub body: String,
}

impl Answer {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.body))
    }

    /// SSE `data:` payloads in order (including `[DONE]`).
    pub fn events(&self) -> Vec<String> {
        self.body
            .split("\n\n")
            .filter_map(|e| e.strip_prefix("data: "))
            .map(str::to_string)
            .collect()
    }
}

fn split_url(url: &str) -> (String, String) {
    let rest = url.strip_prefix("http://").expect("http url");
    match rest.find('/') {
        Some(i) => (rest[..i].to_string(), rest[i..].to_string()),
        None => (rest.to_string(), "/".to_string()),
    }
}

/// One request on a fresh connection; `Err` when the connection was dropped or cut.
pub async fn try_request(method: &str, url: &str, body: Option<&str>) -> Result<Answer, String> {
    let (addr, path) = split_url(url);
    let stream = TcpStream::connect(&addr).await.map_err(|e| e.to_string())?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| e.to_string())?;
    tokio::spawn(conn);
    let req = Request::builder()
        .method(method)
        .uri(path)
        .header("host", addr)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.unwrap_or("").to_string())))
        .map_err(|e| e.to_string())?;
    let resp = sender.send_request(req).await.map_err(|e| e.to_string())?;
    let status = resp.status().as_u16();
    let content_type = resp
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .split(';')
        .next()
        .unwrap_or("")
        .to_string();
    let body = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| e.to_string())?
        .to_bytes();
    Ok(Answer {
        status,
        content_type,
        body: String::from_utf8_lossy(&body).into_owned(),
    })
}

/// Like [`try_request`] but panics on transport errors (bounded by 20 s).
pub async fn request(method: &str, url: &str, body: Option<&str>) -> Answer {
    tokio::time::timeout(Duration::from_secs(20), try_request(method, url, body))
        .await
        .unwrap_or_else(|_| panic!("{method} {url}: no answer within 20 s"))
        .unwrap_or_else(|e| panic!("{method} {url}: {e}"))
}

pub async fn get(url: &str) -> Answer {
    request("GET", url, None).await
}

pub async fn post(url: &str, body: &str) -> Answer {
    request("POST", url, Some(body)).await
}

/// Polls `f` up to 200 times, 10 ms apart, until it holds (no timing assertion:
/// it only waits for guards released right after an answer was sent).
pub async fn eventually(mut f: impl FnMut() -> bool) -> bool {
    for _ in 0..200 {
        if f() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    f()
}
