//! The response relay: from the first bytes of an attempt to the last byte the client
//! gets. The decode's (or regular worker's) body streams through, cut into whole SSE
//! events ([`sse`]), watched for aborts and stalls, with the prefill leg still polled
//! ([`prefill`]); a continuable stream keeps its account ([`splice`]) and can be moved to
//! another worker through [`mover::Moves`], which the dispatcher implements.
//!
//! Invariants (see each module):
//! - The relay never runs an attempt itself and never names the dispatcher: arrows point
//!   down (`dispatch` → `relay` → `legs`, `request`, `skim`).
//! - Bytes pass unchanged unless a rewrite is needed (a move's splice, usage the client
//!   did not ask for, merged prefill logprobs); the body is never buffered whole.
//! - Every load counter and leg is released or cancelled when the body is dropped.

pub mod body;
pub mod logprobs;
pub mod mover;
pub mod parts;
pub mod prefill;
pub mod splice;
pub mod sse;

pub use body::{FailureError, PdBody};
pub use mover::{MoveFuture, MoveOutcome, Mover, Moves};
pub use parts::{Passive, PdBodyParts, Ready, Trials};
pub use prefill::{LostSeen, PrefillFuture, PrefillWatch, Verdict};
