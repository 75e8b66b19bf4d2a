//! Response body type used by every handler: boxed so that JSON answers, pass-through
//! streams and PD streams share one type.

use std::convert::Infallible;

use bytes::Bytes;
use http_body_util::{combinators::UnsyncBoxBody, BodyExt, Full};

/// Errors a body can end with; ending with an error makes hyper cut the connection,
/// which is how a non-SSE response signals a broken upstream after headers.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

pub type RespBody = UnsyncBoxBody<Bytes, BoxError>;

pub fn full_body(b: impl Into<Bytes>) -> RespBody {
    Full::new(b.into())
        .map_err(|e: Infallible| match e {})
        .boxed_unsync()
}
